"""The ``Trajectory`` batch: what a multi-turn rollout hands to the StarPO update step.

One row per episode (``B = num_groups * group_size`` rows, row ``i`` in group ``i // group_size``),
holding the whole conversation as one right-padded token sequence — the exact tokens the model
read and wrote, never re-assembled text.

Index conventions (``L`` = max sequence length, ``T`` = max turns):
  * ``tokens[b, t]`` is predicted by the logits at position ``t - 1``; the log-prob of token ``t``
    therefore needs ``t >= 1`` and ``loss_mask[:, 0]`` is always False.
  * ``loss_mask[b, t]`` is True exactly for the tokens the policy sampled (assistant content and the
    end-of-turn token it emitted); forced tokens (the ``<think>`` prefix, chat framing the loop
    appends to close a turn, observations) are False.
  * A turn's reward (sum of env step rewards plus its format penalty) sits at that turn's last
    sampled token in ``token_rewards``; every other entry is 0.
  * Spans are half-open ``[start, end)`` token indices; an empty span has ``start == end``.
"""
from __future__ import annotations

import chex
import jax.numpy as jnp
from flax import struct


# The per-position fields, [B, L]; every other field is per row or per turn.
POSITION_FIELDS = ("tokens", "valid_mask", "loss_mask", "sampler_logprobs", "turn_ids", "token_rewards")


@struct.dataclass
class Trajectory:
    tokens: chex.Array  # int32 [B, L] conversation, right-padded with the pad id
    valid_mask: chex.Array  # bool [B, L] token present (False on padding)
    loss_mask: chex.Array  # bool [B, L] token was sampled by the policy
    sampler_logprobs: chex.Array  # float32 [B, L] log-prob of tokens[:, t] at sampling time (0 elsewhere)
    turn_ids: chex.Array  # int32 [B, L] turn index of each token; -1 for the preamble and padding
    token_rewards: chex.Array  # float32 [B, L] turn reward at each turn's last sampled token

    turn_rewards: chex.Array  # float32 [B, T] env reward sum + format penalty + reasoning reward per turn
    turn_format_penalty: chex.Array  # float32 [B, T] the penalty part (<= 0)
    turn_reasoning_reward: chex.Array  # float32 [B, T] the env's reward for the reasoning (0 for most envs)
    turn_mask: chex.Array  # bool [B, T] turn took place
    turn_last_token: chex.Array  # int32 [B, T] index of the turn's last sampled token (-1 if none)

    # MI diagnostics. X_t = tokens[0:prompt_end[b, t]] (the whole context up to and including the
    # forced "<think>" of turn t); Z_t = tokens[reasoning_start:reasoning_end] (the reasoning
    # content without its tags; empty when the reply does not parse, so the MI proxy skips that
    # turn). First-turn pairs use t = 0.
    prompt_end: chex.Array  # int32 [B, T]
    reasoning_start: chex.Array  # int32 [B, T]
    reasoning_end: chex.Array  # int32 [B, T]

    group_ids: chex.Array  # int32 [B]
    episode_return: chex.Array  # float32 [B] sum of turn_rewards
    success: chex.Array  # bool [B] terminated by the env with info.success
    num_turns: chex.Array  # int32 [B]
    num_actions: chex.Array  # int32 [B] env actions executed
    valid_action_rate: chex.Array  # float32 [B] mean over turns of "all parsed actions valid"
    effective_action_rate: chex.Array  # float32 [B] mean over executed actions of action_is_effective
    response_length: chex.Array  # int32 [B] number of sampled tokens (sum of loss_mask)

    # Rollout bookkeeping (optional for hand-built batches).
    truncated: chex.Array | None = None  # bool [B] episode cut at a turn boundary by max_seq_len
    # int32 [B, T] first transcript token (after the system preamble) that turn t could see: the
    # preamble length in "full" context mode; the start of the oldest kept turn in "limited" mode.
    context_start: chex.Array | None = None
    # uint32 [B, T] hash of the observation each turn saw (the rendered state, without history or the
    # reward line): GiGPO's anchor state. Equal observations hash equal; distinct ones collide with
    # probability ~2^-32 per pair.
    turn_state_hash: chex.Array | None = None
    # int32 [B, T, P] / [B, T] the observation each turn saw, as its rendered pieces (board symbols,
    # or tokens of a text env's observation), and their count: GiGPO's similarity grouping compares them.
    turn_observation: chex.Array | None = None
    turn_observation_len: chex.Array | None = None
    # bool [B, T] the turn's reply ran out of ``max_new_tokens`` without a stop (DAPO's overlong filter).
    turn_reply_cut: chex.Array | None = None
    # float32 [B] ReMax's baseline: the return of a greedy episode from the row's start state
    # (``RolloutConfig.greedy_baseline``).
    reward_baseline: chex.Array | None = None
    # bool [B, T] the turn's reasoning opens with the exact description of the state it answered
    # (``AgentFacing.describes_state``); None for an environment without a description.
    turn_describes_state: chex.Array | None = None
    # int32 [B, T] the policy version that sampled each turn (-1: no turn), set by the asynchronous
    # rollout (``training.pipeline``); None in the synchronous loop, where the policy being trained did.
    turn_policy_version: chex.Array | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_turns(self) -> int:
        return self.turn_rewards.shape[1]

    @property
    def lengths(self) -> chex.Array:
        """int32 [B] number of tokens in each row."""
        return jnp.sum(self.valid_mask, axis=-1).astype(jnp.int32)


def trimmed_width(longest: int, seq_len: int, multiple: int) -> int:
    """The width that keeps a batch whose longest row has ``longest`` tokens: ``longest`` rounded up
    to a multiple of ``multiple``, at most ``seq_len`` (``multiple`` 0: ``seq_len``, no trimming)."""
    if multiple <= 0:
        return seq_len
    return int(min(seq_len, max(multiple, -(-int(longest) // multiple) * multiple)))


def trim(traj: Trajectory, width: int) -> Trajectory:
    """The first ``width`` positions of every ``[B, L]`` field: only padding may be cut, so every row
    must have at most ``width`` tokens (``trimmed_width`` of the longest). Spans and turn indices
    point inside rows and are unchanged."""
    return traj.replace(**{name: getattr(traj, name)[:, :width] for name in POSITION_FIELDS})
