"""What the rollout loop carries from turn to turn (``lax.scan`` state) and scripted replies."""
from __future__ import annotations

import chex

from ragen_jax.models.kv_cache import KVCache


@chex.dataclass(frozen=True)
class ForcedReplies:
    """Scripted replies instead of sampling (tests, demonstrations, behaviour cloning).

    tokens int32 [B, T, N] (N <= max_new_tokens), lengths int32 [B, T]. Turn t of row b "samples"
    ``tokens[b, t, :lengths[b, t]]``; log-probs are recorded as 0.
    """

    tokens: chex.Array
    lengths: chex.Array


@chex.dataclass(frozen=True)
class TurnCarry:
    """What one turn hands the next (``lax.scan`` carry); ``[B]`` / ``[B, L]`` per row."""

    cache: KVCache  # each row's KV cache (``Rollout.cache_len`` slots)
    state: chex.ArrayTree  # the env states
    pos: chex.Array  # int32 [B] transcript length so far (= next write position)
    buf: chex.Array  # int32 [B, L] the transcript
    loss: chex.Array  # bool [B, L] sampled tokens
    logp: chex.Array  # float32 [B, L] the sampler's log-probs of them
    turn_ids: chex.Array  # int32 [B, L] turn of each token (-1 = preamble)
    keys: chex.Array  # [B] per-row sampling keys
    done: chex.Array  # bool [B] episode over (env end, action budget, or truncated)
    truncated: chex.Array  # bool [B] ended because the next turn would not fit
    success: chex.Array  # bool [B]
    num_actions: chex.Array  # int32 [B] env actions taken
    eot: chex.Array  # bool [B] the last reply ended with the end-of-turn token
    reward_id: chex.Array  # int32 [B] piece id of the last turn's reward text
    warn: chex.Array  # bool [B] the last reply had no valid action (warning next turn)
    turn_starts: chex.Array  # int32 [B, T] transcript index where each turn's user content starts


@chex.dataclass(frozen=True)
class UserBlock:
    """Turn ``t``'s user block, tokenised, and who takes the turn (``Rollout._user_block``)."""

    chunk: chex.Array  # int32 [B, C] tokens: previous close, reward, warning, board, instructions
    length: chex.Array  # int32 [B] valid tokens (0 for rows not taking the turn)
    source: chex.Array  # int32 [B, C] piece each token came from (0 = the previous close)
    close_len: chex.Array  # int32 [B] tokens of the previous close at the start of the chunk
    active: chex.Array  # bool [B] the row takes this turn
    done: chex.Array  # bool [B] episode over after this check (truncation included)
    truncated: chex.Array  # bool [B]
    turn_starts: chex.Array  # int32 [B, T] with this turn's start recorded
    anchor: chex.Array  # uint32 [B] hash of the observation (``observation_hash``): GiGPO's anchor state
    observation: chex.Array  # int32 [B, P] the observation's pieces (GiGPO's similarity grouping)
    observation_len: chex.Array  # int32 [B] how many of them


@chex.dataclass(frozen=True)
class Reply:
    """Turn ``t``'s reply for every row (``Rollout._generate``): sampled, scripted or a hosted model's."""

    tokens: chex.Array  # int32 [B, N] reply tokens (pad after ``length``)
    length: chex.Array  # int32 [B] tokens in the reply (0 for rows not taking the turn)
    logp: chex.Array  # float32 [B, N] the sampler's log-probs (0 for scripted or hosted replies)
    stopped: chex.Array  # bool [B] ended on a stop (not cut at max_new_tokens)
    failed: chex.Array  # bool [B] a hosted model gave no reply after its retries (the episode ends)
    cache: KVCache  # the KV cache with the reply written
    keys: chex.Array  # [B] per-row sampling keys, advanced


@chex.dataclass(frozen=True)
class TurnRecord:
    """What one turn leaves in the episode's record: ``[B]`` per turn (the ``lax.scan`` output),
    ``[B, T]`` once stacked; ``Rollout._assemble`` turns it into the ``Trajectory``'s per-turn fields."""

    reward: chex.Array  # float32 the turn's reward: env rewards + format penalty + reasoning reward (0 off-turn)
    format_penalty: chex.Array  # float32 the format penalty applied
    reasoning_reward: chex.Array  # float32 the environment's reward for the reasoning
    took_turn: chex.Array  # bool the row took this turn
    last_token: chex.Array  # int32 transcript index of the turn's last sampled token (-1: none)
    prompt_end: chex.Array  # int32 transcript index where the reply starts (0 off-turn)
    reasoning_start: chex.Array  # int32 where the reasoning starts (= prompt_end)
    reasoning_end: chex.Array  # int32 where it ends (an empty span when the reply does not parse)
    parsed: chex.Array  # bool the reply parsed (no format penalty)
    actions_executed: chex.Array  # int32 env actions this turn executed
    actions_effective: chex.Array  # int32 of them, the ones that changed the state
    context_start: chex.Array  # int32 first transcript index of the turn's context (limited context)
    anchor: chex.Array  # uint32 hash of the observation (GiGPO's anchor state; 0 off-turn)
    reply_cut: chex.Array  # bool the reply hit max_new_tokens without a stop
    observation: chex.Array  # int32 [.., P] the observation's pieces (0 off-turn)
    observation_len: chex.Array  # int32 how many of them
    describes_state: chex.Array | None = None  # bool the reasoning opens with the state's exact description
