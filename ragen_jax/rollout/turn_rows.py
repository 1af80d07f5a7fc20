"""Per-turn rows of a limited-context rollout: each reply with exactly the context it was sampled in.

In ``context_mode="limited"`` turn ``t`` of an episode saw the system preamble and the transcript
from ``Trajectory.context_start[b, t]`` on (the last ``context_window`` turns), not the whole
conversation the transcript records. Recomputing its log-probs over the transcript would score the
reply under a context the policy never had, so the importance ratios of the update (and the
behaviour-cloning targets of the warm-up) are taken on one row per (episode, turn) instead:

    row (b, t) = tokens[b, :P0] ++ tokens[b, context_start[b, t] : turn_last_token[b, t] + 1]

re-positioned from 0, as the rollout's KV cache held it (RAGEN's ``limited_multi_turn`` samples).
Rows are episode-major (``b * T + t``) and ``width`` wide (``Rollout.cache_len`` bounds every
row). Per-token quantities move between the two layouts with ``gather`` (transcript → rows) and
``scatter`` (each row's own reply tokens → transcript): every sampled token belongs to exactly one
row, so episode-level computations (scores, the SNR filter, advantages) stay on the transcript.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ragen_jax.rollout.trajectory import Trajectory


@chex.dataclass(frozen=True)
class TurnRows:
    """The per-turn view of a ``Trajectory`` of B episodes and T turns.

    view: a ``Trajectory`` of ``B * T`` rows with one turn each (its ``loss_mask`` covers only that
      turn's sampled tokens; ``prompt_end`` / reasoning spans / ``turn_last_token`` in row
      coordinates; episode fields repeated).
    source: int32 [B*T, W] transcript index of each row slot, -1 past the row's end.
    episode: int32 [B*T] the row's episode b.
    turn: int32 [B*T] the row's turn t.
    """

    view: Trajectory
    source: chex.Array
    episode: chex.Array
    turn: chex.Array

    def gather(self, x: jax.Array) -> jax.Array:
        """Transcript array ``[B, L, ...]`` -> rows ``[B*T, W, ...]`` (zeros in slots past a row's end)."""
        return _gather(x, self.episode, self.source)

    def scatter(self, y: jax.Array, like: jax.Array) -> jax.Array:
        """Rows ``[B*T, W]`` -> transcript ``like.shape`` ``[B, L]``: each row's own sampled tokens
        written back to their transcript positions, zeros elsewhere."""
        dest = jnp.where(self.view.loss_mask, self.source, like.shape[1])  # out of range: dropped
        out = jnp.zeros(like.shape, y.dtype)
        return out.at[self.episode[:, None], dest].set(y, mode="drop")


def _gather(x: jax.Array, episode: jax.Array, source: jax.Array) -> jax.Array:
    out = x[episode[:, None], jnp.maximum(source, 0)]
    valid = (source >= 0).reshape(source.shape + (1,) * (x.ndim - 2))
    return jnp.where(valid, out, jnp.zeros((), x.dtype))


def _rows_of(x: jax.Array, turns: int) -> jax.Array:
    """Episode array [B, ...] -> one entry per row [B*T, ...]."""
    return jnp.repeat(x, turns, axis=0)


def turn_rows(traj: Trajectory, preamble_len: int, width: int) -> TurnRows:
    """One row per (episode, turn); see the module docstring.

    Args:
      traj: a rollout of B episodes, T turns (``context_start`` set: a limited-context rollout).
      preamble_len: P0, the system preamble every transcript starts with.
      width: W, the row length (``Rollout.cache_len``); a row longer than that is an error of the
        caller's bound and is cut.
    """
    if traj.context_start is None:
        raise ValueError("turn_rows needs Trajectory.context_start (a rollout from make_rollout)")
    B, L = traj.tokens.shape
    T = traj.max_turns
    P0 = preamble_len
    episode = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T)
    turn = jnp.tile(jnp.arange(T, dtype=jnp.int32), B)
    flat = lambda x: x.reshape((B * T,) + x.shape[2:])
    active = flat(traj.turn_mask) & (flat(traj.turn_last_token) >= 0)
    cs = flat(traj.context_start)
    end = jnp.where(active, flat(traj.turn_last_token) + 1, cs)  # inactive turn: the preamble only
    j = jnp.arange(width, dtype=jnp.int32)[None]
    source = jnp.where(j < P0, j, cs[:, None] + j - P0)
    source = jnp.where(source < jnp.maximum(end, P0)[:, None], source, -1)

    gather = lambda x: _gather(x, episode, source)
    valid = source >= 0
    own = gather(traj.loss_mask) & (gather(traj.turn_ids) == turn[:, None]) & valid
    shift = P0 - cs  # transcript index i sits at row slot i + shift
    to_row = lambda x: jnp.where(active, flat(x) + shift, 0)[:, None]
    view = Trajectory(
        tokens=gather(traj.tokens),
        valid_mask=valid,
        loss_mask=own,
        sampler_logprobs=jnp.where(own, gather(traj.sampler_logprobs), 0.0),
        turn_ids=jnp.where(valid, 0, -1).astype(jnp.int32),
        token_rewards=jnp.where(own, gather(traj.token_rewards), 0.0),
        turn_rewards=flat(traj.turn_rewards)[:, None],
        turn_format_penalty=flat(traj.turn_format_penalty)[:, None],
        turn_reasoning_reward=flat(traj.turn_reasoning_reward)[:, None],
        turn_mask=active[:, None],
        turn_last_token=jnp.where(active, flat(traj.turn_last_token) + shift, -1)[:, None],
        prompt_end=to_row(traj.prompt_end),
        reasoning_start=to_row(traj.reasoning_start),
        reasoning_end=to_row(traj.reasoning_end),
        group_ids=_rows_of(traj.group_ids, T),
        episode_return=_rows_of(traj.episode_return, T),
        success=_rows_of(traj.success, T),
        num_turns=_rows_of(traj.num_turns, T),
        num_actions=_rows_of(traj.num_actions, T),
        valid_action_rate=_rows_of(traj.valid_action_rate, T),
        effective_action_rate=_rows_of(traj.effective_action_rate, T),
        response_length=jnp.sum(own, axis=1).astype(jnp.int32),
        truncated=None if traj.truncated is None else _rows_of(traj.truncated, T),
        context_start=jnp.full((B * T, 1), P0, jnp.int32),
    )
    return TurnRows(view=view, source=source, episode=episode, turn=turn)
