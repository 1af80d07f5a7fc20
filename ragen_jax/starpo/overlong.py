"""DAPO's handling of over-long replies (Yu et al., 2025): a soft length penalty added to the
reward, and a filter that keeps cut-off episodes out of the update.

In a multi-turn episode each turn's reply is one DAPO "response": its length is the number of tokens
the policy sampled in that turn, its limit ``rollout.max_new_tokens``. Pure ``jnp`` on ``Trajectory``
fields, static shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ragen_jax.rollout.trajectory import Trajectory

Array = jax.Array


def turn_reply_lengths(loss_mask: Array, turn_ids: Array, max_turns: int) -> Array:
    """int32 ``[B, T]``: tokens the policy sampled in each turn (``loss_mask`` tokens of turn ``t``)."""
    turns = jnp.arange(max_turns)
    hit = (turn_ids[:, :, None] == turns[None, None]) & loss_mask.astype(bool)[:, :, None]
    return jnp.sum(hit, axis=1).astype(jnp.int32)


def overlong_penalty(lengths: Array, *, max_len: int, buffer_len: int, factor: float = 1.0) -> Array:
    """DAPO's soft overlong punishment of a reply of ``lengths`` tokens (any shape), ``<= 0``:

        0                                     if |y| <= L_max - L_cache
        factor * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
        -factor                               if |y| > L_max

    with ``L_max = max_len`` and ``L_cache = buffer_len`` (> 0).
    """
    if buffer_len <= 0:
        raise ValueError(f"overlong_penalty needs a buffer of at least one token, got buffer_len={buffer_len}.")
    n = lengths.astype(jnp.float32)
    expected = float(max_len - buffer_len)
    inside = jnp.minimum(0.0, (expected - n) / buffer_len)
    return factor * jnp.where(n > max_len, -1.0, inside)


def shape_overlong(traj: Trajectory, *, max_len: int, buffer_len: int, factor: float) -> tuple[Trajectory, Array]:
    """Adds each turn's ``overlong_penalty`` to its reward (``turn_rewards`` and the token reward at the
    turn's last sampled token), so every later stage — the SNR filter, scores, estimators — sees the
    shaped reward. -> ``(trajectory, penalty [B, T])``."""
    lengths = turn_reply_lengths(traj.loss_mask, traj.turn_ids, traj.max_turns)
    penalty = jnp.where(traj.turn_mask, overlong_penalty(lengths, max_len=max_len, buffer_len=buffer_len,
                                                         factor=factor), 0.0)
    B, L = traj.token_rewards.shape
    rows = jnp.arange(B)[:, None]
    where = jnp.where(traj.turn_last_token >= 0, traj.turn_last_token, L)
    token_rewards = traj.token_rewards.at[rows, where].add(penalty, mode="drop")
    return traj.replace(token_rewards=token_rewards, turn_rewards=traj.turn_rewards + penalty,
                        episode_return=traj.episode_return + jnp.sum(penalty, axis=1)), penalty


def cut_episodes(traj: Trajectory) -> Array:
    """bool ``[B]``: episodes DAPO's overlong filter leaves out — a reply that ran out of
    ``max_new_tokens`` without a stop (``turn_reply_cut``), or a transcript that ended because the
    next turn no longer fit ``max_seq_len`` (``truncated``)."""
    cut = jnp.zeros(traj.batch_size, bool)
    if traj.turn_reply_cut is not None:
        cut = cut | jnp.any(traj.turn_reply_cut & traj.turn_mask, axis=1)
    if traj.truncated is not None:
        cut = cut | traj.truncated
    return cut
