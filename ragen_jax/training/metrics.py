"""Episode metrics of a rollout batch and the host-side early-stop signals.

``rollout_metrics`` is a pure jitted function of the ``Trajectory``; ``EarlyStop`` keeps the few
host counters the three stop signals need and serialises them for checkpoints (exact resume).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.starpo.reductions import group_std, group_view


@functools.partial(jax.jit, static_argnames=("group_size",))
def rollout_metrics(traj: Trajectory, group_size: int) -> dict[str, jax.Array]:
    """Batch means of the episode statistics; ``pass_at_{group_size}`` = any success within a group.

    ``in_group_reward_std`` is the mean over groups of the unbiased std of episode returns (the
    quantity RAGEN's filter calls "reward_variance" and its collapse stop watches).
    """
    success = traj.success.astype(jnp.float32)
    groups = success.reshape(-1, group_size)
    returns = group_view(traj.episode_return, group_size)
    metrics = {
        "success": success.mean(),
        f"pass_at_{group_size}": groups.max(axis=1).mean(),
        "return": traj.episode_return.mean(),
        "return_std": traj.episode_return.std(),
        "in_group_reward_std": group_std(returns).mean(),
        "num_turns": traj.num_turns.astype(jnp.float32).mean(),
        "num_actions": traj.num_actions.astype(jnp.float32).mean(),
        "valid_action_rate": traj.valid_action_rate.mean(),
        "effective_action_rate": traj.effective_action_rate.mean(),
        "response_length": traj.response_length.astype(jnp.float32).mean(),
        "sequence_length": traj.lengths.astype(jnp.float32).mean(),
        "sequence_length_max": traj.lengths.max().astype(jnp.float32),
        "format_penalty": traj.turn_format_penalty.sum(axis=1).mean(),
        "reasoning_reward": traj.turn_reasoning_reward.sum(axis=1).mean(),
        "sampled_tokens": traj.response_length.sum().astype(jnp.float32),
        # Transcript tokens the widest per-turn row holds after the preamble (limited context: the
        # turn's window up to its last sampled token; what the update's rows must fit). 0 in full context.
        "window_length_max": _window_length_max(traj),
        # Episodes ended by rollout.max_seq_len before their last turn (the trainer warns).
        "truncated": (jnp.zeros(()) if traj.truncated is None else traj.truncated.astype(jnp.float32).mean()),
    }
    if traj.turn_describes_state is not None:
        metrics.update(describes_state_rates(traj.turn_describes_state, traj.turn_mask))
    if traj.turn_policy_version is not None:  # the asynchronous rollout: the oldest policy among the turns
        versions = jnp.where(traj.turn_mask, traj.turn_policy_version, jnp.iinfo(jnp.int32).max)
        metrics["oldest_turn_policy_version"] = versions.min().astype(jnp.float32)
    return metrics


def describes_state_rates(describes, turn_mask) -> dict:
    """The share of turns whose reasoning opens with the exact description of their state, over all
    turns that took place (``describes_state``) and over first turns (``first_turn_describes_state``).
    describes, turn_mask bool [B, T] (NumPy or jax arrays)."""
    xp = jnp if isinstance(describes, jax.Array) else np
    d, m = xp.asarray(describes) & xp.asarray(turn_mask), xp.asarray(turn_mask)
    return {"describes_state": d.sum() / xp.maximum(m.sum(), 1),
            "first_turn_describes_state": d[:, 0].sum() / xp.maximum(m[:, 0].sum(), 1)}


def _window_length_max(traj: Trajectory) -> jax.Array:
    if traj.context_start is None:
        return jnp.zeros((), jnp.float32)
    active = traj.turn_mask & (traj.turn_last_token >= 0)
    span = jnp.where(active, traj.turn_last_token + 1 - traj.context_start, 0)
    return jnp.max(span).astype(jnp.float32)


@dataclasses.dataclass
class EarlyStop:
    """Three early-stop signals, always computed and logged; stopping is optional (config.trainer).

    * empty filter: ``consecutive_empty`` batches left empty by the SNR filter, as
      the update step counts them (``TrainState.consecutive_empty``, its
      ``rollout/consecutive_empty_after_filter_steps`` metric): one counter, on the device;
    * reward-variance collapse: baseline = mean in-group reward std over the first
      ``baseline_steps`` non-empty steps; collapse when ``window`` consecutive later steps are all
      below ``ratio`` × baseline;
    * MI collapse: the MI proxy below ``mi_ratio`` × its baseline (mean of the first
      ``mi_baseline`` computations) for ``mi_window`` consecutive computations. With
      ``mi_needs_plateau`` the reward must also plateau over those computations' steps (mean return
      not above the mean over as many steps before). Off by default: in a measured template
      collapse the return falls and partly recovers while MI keeps falling, and the plateau test
      held the alert back until the recovery was over (docs/experiments.md, "Template collapse").
    """

    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1
    mi_ratio: float = 0.7
    mi_window: int = 3
    mi_baseline: int = 3
    mi_needs_plateau: bool = False
    consecutive_empty: int = 0
    rv_history: list = dataclasses.field(default_factory=list)
    rv_below: int = 0
    mi_history: list = dataclasses.field(default_factory=list)
    return_history: list = dataclasses.field(default_factory=list)
    mi_below: int = 0

    def update(self, *, consecutive_empty: int, reward_std: float, episode_return: float, mi: float | None) -> dict:
        """Feed one training step (``consecutive_empty``: the update's counter, 0 = this batch kept
        something); returns the ``early_stop/*`` metrics (flags as 0/1; the empty-filter signal's
        flag, ``early_stop/empty_filter``, and counter come from the update step)."""
        self.consecutive_empty = int(consecutive_empty)
        empty = self.consecutive_empty > 0
        self.return_history.append(float(episode_return))
        rv_collapse = False
        if not empty:
            self.rv_history.append(float(reward_std))
            if len(self.rv_history) > self.baseline_steps:
                base = float(np.mean(self.rv_history[: self.baseline_steps]))
                self.rv_below = self.rv_below + 1 if reward_std < self.ratio * base else 0
                rv_collapse = self.rv_below >= self.window
        mi_collapse = False
        if mi is not None and np.isfinite(mi):
            self.mi_history.append((len(self.return_history), float(mi)))
            if len(self.mi_history) > self.mi_baseline:
                base = float(np.mean([m for _, m in self.mi_history[: self.mi_baseline]]))
                low = mi < self.mi_ratio * base
                self.mi_below = self.mi_below + 1 if (low and (not self.mi_needs_plateau or self._plateau())) else 0
                mi_collapse = self.mi_below >= self.mi_window
        return {
            "early_stop/reward_variance_below_steps": float(self.rv_below),
            "early_stop/reward_variance_collapse": float(rv_collapse),
            "early_stop/mi_below_steps": float(self.mi_below),
            "early_stop/mi_collapse": float(mi_collapse),
        }

    def _plateau(self) -> bool:
        """Mean return over the last ``mi_window`` MI computations' steps not above the mean over as
        many steps before them."""
        n = len(self.return_history)
        span = max(1, n - self.mi_history[-self.mi_window][0]) if len(self.mi_history) >= self.mi_window else n
        before = np.mean(self.return_history[-2 * span: -span]) if n > span else -np.inf
        return bool(np.mean(self.return_history[-span:]) <= before)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, d: dict) -> "EarlyStop":
        d = dict(d)
        d["mi_history"] = [tuple(x) for x in d.get("mi_history", [])]
        return cls(**d)
