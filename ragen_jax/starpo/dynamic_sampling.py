"""DAPO's dynamic sampling (Yu et al., 2025): over-sample, keep the groups whose rewards differ.

A group whose episodes all scored the same gives every group-relative estimator a zero advantage,
so an update that rests on a handful of informative groups is mostly noise from the regularisers.
After the step's rollout, up to ``filter.dynamic_sampling_rounds`` more rollouts (fresh start states,
the same policy) are played until the batch can hold ``rollout.num_groups`` groups with a reward
spread; the batch is then those groups (first found first) and, if the rounds ran out, uninformative
groups of the first rollout fill the rest, so the update's shapes never change.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.starpo.advantages import SCORE_STD_EPS, episode_scores
from ragen_jax.starpo.reductions import group_std, group_view

# Where the extra rounds' keys come from: far from any step's fold_in (steps count from 0).
ROUND_KEY_OFFSET = 1 << 30


def informative_groups(traj: Trajectory, group_size: int) -> jax.Array:
    """bool ``[G]``: the group's episode scores are not all equal (unbiased std above 1e-6)."""
    if group_size < 2:
        return jnp.zeros(traj.batch_size, bool)
    scores = group_view(episode_scores(traj.token_rewards), group_size)
    return group_std(scores) > SCORE_STD_EPS


def gather_groups(trajs: tuple[Trajectory, ...], rows: jax.Array, group_size: int) -> Trajectory:
    """The rows ``rows [B]`` of the rollouts ``trajs`` stacked end to end, group ids renumbered."""
    stacked = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trajs)
    out = jax.tree.map(lambda x: x[rows], stacked)
    return out.replace(group_ids=(jnp.arange(rows.shape[0]) // group_size).astype(jnp.int32))


def choose_groups(informative: list[np.ndarray], num_groups: int) -> list[tuple[int, int]]:
    """``(round, group)`` pairs for the batch: informative groups in the order they were found, then
    the first round's uninformative groups (and later rounds', if needed) until ``num_groups``."""
    chosen = [(r, int(g)) for r, mask in enumerate(informative) for g in np.flatnonzero(mask)][:num_groups]
    rest = [(r, int(g)) for r, mask in enumerate(informative) for g in np.flatnonzero(~mask)]
    return chosen + rest[:num_groups - len(chosen)]


@functools.lru_cache(maxsize=None)
def _programs(placement, group_size: int):
    jit = jax.jit if placement is None else placement.jit
    return (jit(functools.partial(informative_groups, group_size=group_size)),
            jit(functools.partial(gather_groups, group_size=group_size)))


def refill(rollout, params, key: jax.Array, first: Trajectory, *, group_size: int, max_rounds: int,
           placement=None) -> tuple[Trajectory, dict]:
    """The batch DAPO's dynamic sampling trains on, from the step's rollout ``first``.

    ``rollout(params, key) -> Trajectory`` plays one more round per call (keys folded from ``key``).
    Returns ``(trajectory, metrics)``: ``rollout/dynamic_sampling_rounds`` (extra rounds played),
    ``rollout/informative_groups_first`` and ``rollout/informative_groups`` (before / after).
    """
    informative_fn, gather_fn = _programs(placement, group_size)
    fetch = (lambda x: np.asarray(x)) if placement is None else placement.fetch
    num_groups = first.batch_size // group_size
    trajs, masks = [first], [fetch(informative_fn(first))]
    while sum(int(m.sum()) for m in masks) < num_groups and len(trajs) <= max_rounds:
        traj = rollout(params, jax.random.fold_in(key, ROUND_KEY_OFFSET + len(trajs)))
        trajs.append(traj)
        masks.append(fetch(informative_fn(traj)))
    picked = choose_groups(masks, num_groups)
    metrics = {"rollout/dynamic_sampling_rounds": float(len(trajs) - 1),
               "rollout/informative_groups_first": float(masks[0].sum()),
               "rollout/informative_groups": float(sum(masks[r][g] for r, g in picked))}
    if len(trajs) == 1:
        return first, metrics
    batch = first.batch_size
    rows = np.asarray([r * batch + g * group_size + j for r, g in picked for j in range(group_size)], np.int32)
    rows = jnp.asarray(rows) if placement is None else placement.put_replicated(rows)
    return gather_fn(tuple(trajs), rows), metrics
