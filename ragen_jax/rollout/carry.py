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
