"""Asynchronous rollout: the batches of the next steps are sampled while the update trains on this one.

With ``trainer.max_staleness = η > 0`` the loop keeps the rollouts of the next η steps in flight. At
the start of step ``s`` the policy is version ``s - 1`` (``s - 1`` updates since the warm-up); the
rollouts of steps up to ``s + η`` not launched yet start from it, and the update trains on the batch
of step ``s``, launched η steps earlier. A batch is therefore trained exactly η versions after the
policy that sampled it (fewer in the first η steps), never more: admission is paced, nothing is
dropped (dropping stale batches would bias training toward fast episodes), and the schedule — which
version samples which step, with which key — does not depend on timing, so a run is reproducible.

Where the two run: with ``mesh.rollout_devices = k`` the last k devices hold a copy of the policy and
run only the rollout, the others the update, so rollout and update overlap; JAX dispatches both
programs without waiting. In a multi-process run the k devices are the last processes' (half the
devices): every process runs the same loop, each program runs where its devices are, and weights and
batches cross between the two halves by cross-host transfers (``placement.send``). Colocated (``k = 0``) they queue on the same devices: the schedule and the
numbers are the same, without the overlap. Weight sync: after each update the trained parameters
are copied to the rollout's devices (a LoRA run copies its adapters; the frozen base once), into
buffers the pipeline owns, since the update donates the train state's.

The off-policy correction is the loss's business: ``starpo.policy_loss='decoupled_ppo'`` (AReaL's
decoupled objective, the rollout's own log-probs as the behaviour policy's) or
``'rollout_correction'``; plain PPO clips around the proximal policy the update re-scores.

Every turn of a batch records the version that sampled it (``Trajectory.turn_policy_version``).
Metrics (``async/*``): ``staleness`` (versions between sampling and training), ``policy_version``
(the version that sampled the batch), ``trainer_wait_s`` (the time the update waited for its batch),
``launch_s`` (host time to copy weights and dispatch rollouts), ``rollout_idle`` (1 when the rollout
devices had finished every launched rollout before the next was launched: they idled in between),
``in_flight``.

Exact resume: with every checkpoint the pipeline saves what it has in flight — the steps, the policy
version that samples each, and those versions' trained parameters (``state_dict``; a LoRA run's
adapters) — in ``checkpoints_pipeline/<step>``. A resumed run launches the same rollouts again from
the same parameters and keys (``resume``), so it logs what the uninterrupted run logs. A checkpoint
without its pipeline part (written by the synchronous loop, or damaged) starts the pipeline afresh,
with a note: its first η steps then train on fresher batches than the interrupted run would have.
"""
from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.starpo.train_state import is_lora


class RolloutPipeline:
    """The rollouts in flight of an asynchronous run (see the module docstring)."""

    def __init__(self, run, max_staleness: int, base_key: jax.Array, last_step: int, checkpointer=None):
        if max_staleness < 1:
            raise ValueError(f"RolloutPipeline needs max_staleness >= 1, got {max_staleness}")
        self.rollout = run.rollout_on_own_devices or run.rollout
        self.placement = self.rollout.placement  # where the rollout runs
        self.trainer_placement = run.placement
        self.own_devices = run.rollout_on_own_devices is not None
        self.max_staleness, self.base_key, self.last_step = int(max_staleness), base_key, int(last_step)
        self.in_flight: collections.deque = collections.deque()  # (step, version, trajectory)
        self.next_step: int | None = None
        self._weights: tuple[int, object] | None = None  # (version, the policy on the rollout's devices)
        self._trained: dict[int, object] = {}  # version -> its trained parameters, while a rollout of it is in flight
        self._base = None  # a LoRA run's frozen base, copied once
        self._copies: dict = {}  # tree structure -> its jitted copy (colocated)
        self.checkpointer = checkpointer  # where ``state_dict`` is saved (the trainer's ``checkpoints_pipeline/``)

    # --- weight sync --------------------------------------------------------------------------------
    def _own_copy(self, tree):
        """``tree`` in fresh buffers laid out for the rollout (the update donates the train state's)."""
        shardings = self.placement.state_shardings(tree)
        if self.own_devices:  # another device set: the transfer is the copy
            if self.placement.peer is not None:  # on other processes: a cross-host transfer
                return self.placement.take_from_peer(tree, shardings)
            return jax.device_put(tree, shardings)
        structure = jax.tree.structure(tree)  # the base and the trained part are different trees
        if structure not in self._copies:
            self._copies[structure] = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)
        return self._copies[structure](tree)

    def _policy(self, train_state, version: int, trained=None):
        """The policy of ``version`` on the rollout's devices (copied once per version); ``trained``: that
        version's trained parameters when they are not ``train_state``'s (a resume's)."""
        if self._weights is None or self._weights[0] != version:
            lora = is_lora(train_state)
            if lora and self._base is None:
                self._base = self._own_copy(train_state.policy_rest)
            params = self._own_copy(train_state.params if trained is None else trained)
            self._trained[version] = params
            self._weights = (version, nnx.merge_state(params, self._base) if lora else params)
        return self._weights[1]

    def _launch(self, policy, step: int, version: int) -> None:
        self.in_flight.append((step, version, self.rollout(policy, jax.random.fold_in(self.base_key, step))))

    # --- the schedule -----------------------------------------------------------------------------
    def take(self, step: int, train_state) -> tuple[object, dict]:
        """Launch the rollouts of steps up to ``step + max_staleness`` from the current policy (version
        ``step - 1``), then return step ``step``'s batch on the update's devices and its ``async/*``
        metrics. Steps must come in order (the first one may be any: a resumed run's)."""
        version = step - 1
        if self.next_step is None:
            self.next_step = step
        t0 = time.time()
        rollout_idle = bool(self.in_flight) and all(_ready(traj) for _, _, traj in self.in_flight)
        while self.next_step <= min(step + self.max_staleness, self.last_step):
            self._launch(self._policy(train_state, version), self.next_step, version)
            self.next_step += 1
        t1 = time.time()
        launched_step, sampled_by, traj = self.in_flight.popleft()
        if launched_step != step:
            raise RuntimeError(f"asynchronous rollout: step {step} asked for, but the next batch in flight is step "
                               f"{launched_step}'s; steps must be taken in order")
        traj = jax.block_until_ready(traj)
        t2 = time.time()
        needed = {v for _, v, _ in self.in_flight} | {version}
        self._trained = {v: p for v, p in self._trained.items() if v in needed}
        if self.trainer_placement.peer is not None:  # the rollout ran on other processes
            traj = self.trainer_placement.take_from_peer(traj, self.trainer_placement.batch_shardings(traj))
        elif self.own_devices:
            traj = self.trainer_placement.put_batch(traj)
        # One version samples a whole batch (weights change only between rollouts): every turn records it.
        traj = traj.replace(turn_policy_version=jnp.where(traj.turn_mask, sampled_by, -1).astype(jnp.int32))
        return traj, {"async/staleness": float(version - sampled_by), "async/policy_version": float(sampled_by),
                      "async/trainer_wait_s": t2 - t1, "async/launch_s": t1 - t0,
                      "async/rollout_idle": float(rollout_idle), "async/in_flight": float(len(self.in_flight))}

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict] | None:
        """``(arrays, meta)`` to save with the checkpoint of the step just taken: the trained parameters
        of every version a rollout in flight samples with (``{"v<version>": params}``) and
        ``{"in_flight": [[step, version], ...], "next_step": ..., "max_staleness": ...}``; None when
        nothing is in flight."""
        if not self.in_flight:
            return None
        flight = [[step, version] for step, version, _ in self.in_flight]
        arrays = {f"v{v}": self._trained[v] for v in sorted({v for _, v in flight})}
        return arrays, {"in_flight": flight, "next_step": self.next_step, "max_staleness": self.max_staleness}

    def like(self, train_state, meta: dict) -> dict:
        """The structure ``state_dict``'s arrays restore into (``meta``: the saved one)."""
        return {f"v{v}": train_state.params for v in sorted({v for _, v in meta["in_flight"]})}

    def resume(self, arrays: dict, meta: dict, train_state) -> None:
        """Launch again the rollouts a checkpoint had in flight, from the same parameters and keys."""
        if int(meta["max_staleness"]) != self.max_staleness:
            raise ValueError(f"the checkpoint's pipeline ran with max_staleness={meta['max_staleness']}, this run "
                             f"with {self.max_staleness}")
        for step, version in meta["in_flight"]:
            if step <= self.last_step:
                self._launch(self._policy(train_state, version, arrays[f"v{version}"]), step, version)
        self.next_step = int(meta["next_step"])


def _ready(tree) -> bool:
    """Whether every array of ``tree`` is computed (a dispatched program has finished)."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
