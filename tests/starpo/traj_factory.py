"""Build small, valid ``Trajectory`` batches from token lists (test helper for the StarPO tests).

A conversation is a preamble followed by turns. Each turn is laid out as

    obs tokens (forced) | THINK (forced) | reasoning (sampled) | END_THINK answer... (sampled)

so ``prompt_end`` is the index just after THINK, the reasoning span is the sampled tokens before
END_THINK, and the turn reward sits on the turn's last sampled token — the conventions documented in
``ragen_jax/rollout/trajectory.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout.trajectory import Trajectory

PAD = 0
THINK = 1
END_THINK = 2


@dataclass
class Turn:
    obs: list[int]
    reasoning: list[int]
    answer: list[int] = field(default_factory=lambda: [3])
    reward: float = 0.0
    format_penalty: float = 0.0


@dataclass
class Conversation:
    preamble: list[int]
    turns: list[Turn]
    success: bool = False


def build_trajectory(
    conversations: list[Conversation],
    group_ids: list[int],
    *,
    seq_len: int | None = None,
    max_turns: int | None = None,
    sampler_logprobs: np.ndarray | None = None,
    context_window: int | None = None,
) -> Trajectory:
    """Lay the conversations out as a right-padded ``Trajectory`` (all arrays as documented there).

    ``context_window`` k: ``context_start`` as a limited-context rollout records it (turn t saw the
    preamble and turns ``max(0, t - k + 1) .. t``); None: the preamble length (full context)."""
    batch = len(conversations)
    if len(group_ids) != batch:
        raise ValueError(f"{len(group_ids)} group ids for {batch} conversations")
    rows, metas = [], []
    for conv in conversations:
        toks = list(conv.preamble)
        loss, turn_of = [False] * len(toks), [-1] * len(toks)
        meta, starts = [], []
        for t, turn in enumerate(conv.turns):
            starts.append(len(toks))
            toks += turn.obs + [THINK]
            loss += [False] * (len(turn.obs) + 1)
            turn_of += [t] * (len(turn.obs) + 1)
            p_end = len(toks)
            sampled = turn.reasoning + [END_THINK] + turn.answer
            toks += sampled
            loss += [True] * len(sampled)
            turn_of += [t] * len(sampled)
            first = t if context_window is None else max(0, t - context_window + 1)
            ctx = len(conv.preamble) if context_window is None or first == 0 else starts[first]
            meta.append((p_end, p_end, p_end + len(turn.reasoning), len(toks) - 1, turn, ctx))
        rows.append((toks, loss, turn_of))
        metas.append(meta)
    L = seq_len or max(len(r[0]) for r in rows)
    T = max_turns or max(len(m) for m in metas)
    if any(len(r[0]) > L for r in rows) or any(len(m) > T for m in metas):
        raise ValueError("seq_len / max_turns too small for the conversations")

    tokens = np.full((batch, L), PAD, np.int32)
    valid = np.zeros((batch, L), bool)
    loss_mask = np.zeros((batch, L), bool)
    turn_ids = np.full((batch, L), -1, np.int32)
    token_rewards = np.zeros((batch, L), np.float32)
    turn_rewards = np.zeros((batch, T), np.float32)
    turn_pen = np.zeros((batch, T), np.float32)
    turn_mask = np.zeros((batch, T), bool)
    turn_last = np.full((batch, T), -1, np.int32)
    p_end = np.zeros((batch, T), np.int32)
    r_start = np.zeros((batch, T), np.int32)
    r_end = np.zeros((batch, T), np.int32)
    context_start = np.zeros((batch, T), np.int32)
    for b, ((toks, loss, turn_of), meta) in enumerate(zip(rows, metas)):
        n = len(toks)
        tokens[b, :n] = toks
        valid[b, :n] = True
        loss_mask[b, :n] = loss
        turn_ids[b, :n] = turn_of
        for t, (pe, rs, re_, last, turn, ctx) in enumerate(meta):
            context_start[b, t] = ctx
            r = turn.reward + turn.format_penalty
            turn_rewards[b, t] = r
            turn_pen[b, t] = turn.format_penalty
            turn_mask[b, t] = True
            turn_last[b, t] = last
            token_rewards[b, last] = r
            p_end[b, t], r_start[b, t], r_end[b, t] = pe, rs, re_
    if sampler_logprobs is None:
        sampler_logprobs = np.zeros((batch, L), np.float32)
    num_turns = turn_mask.sum(1).astype(np.int32)
    return Trajectory(
        tokens=jnp.asarray(tokens),
        valid_mask=jnp.asarray(valid),
        loss_mask=jnp.asarray(loss_mask),
        sampler_logprobs=jnp.asarray(np.where(loss_mask, sampler_logprobs, 0.0), jnp.float32),
        turn_ids=jnp.asarray(turn_ids),
        token_rewards=jnp.asarray(token_rewards),
        turn_rewards=jnp.asarray(turn_rewards),
        turn_format_penalty=jnp.asarray(turn_pen),
        turn_reasoning_reward=jnp.zeros_like(jnp.asarray(turn_pen)),
        turn_mask=jnp.asarray(turn_mask),
        turn_last_token=jnp.asarray(turn_last),
        prompt_end=jnp.asarray(p_end),
        reasoning_start=jnp.asarray(r_start),
        reasoning_end=jnp.asarray(r_end),
        group_ids=jnp.asarray(np.asarray(group_ids, np.int32)),
        episode_return=jnp.asarray(turn_rewards.sum(1)),
        success=jnp.asarray(np.array([c.success for c in conversations])),
        num_turns=jnp.asarray(num_turns),
        num_actions=jnp.asarray(num_turns),
        valid_action_rate=jnp.ones((batch,), jnp.float32),
        effective_action_rate=jnp.ones((batch,), jnp.float32),
        response_length=jnp.asarray(loss_mask.sum(1).astype(np.int32)),
        context_start=jnp.asarray(context_start),
    )
