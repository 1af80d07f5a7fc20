"""What a turn sees: one small strategy per ``rollout.context_mode`` (``full``, ``limited``, ``reprefill``).

Each strategy's ``prepare`` returns the KV cache the turn's user block is prefilled into, the tokens
and where they go; ``context_start`` says where a turn's visible history begins in the transcript
(``Trajectory.context_start``), so the update recomputes log-probs under the same context.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.kv_cache import init_cache
from ragen_jax.models.sampler import prefill
from ragen_jax.rollout.carry import TurnCarry, UserBlock

# One strategy each (``FullContext``, ``LimitedContext``, ``ReprefillContext`` below). "reprefill"
# is a benchmark baseline, not a training mode: every turn rebuilds the KV cache by prefilling the
# whole conversation from position 0 (what the original and Tunix do) — the same trajectories as
# "full", at a higher cost (``benchmarks/rollout.py``).
CONTEXT_MODES = ("full", "limited", "reprefill")


class FullContext:
    """``full``: the whole conversation; the user block is appended at the row's own position."""

    def __init__(self, rollout):
        """``rollout``: the ``loop.Rollout`` whose config, codec and cache length the strategy reads."""
        self.rollout = rollout

    def prepare(self, model, carry: TurnCarry, block: UserBlock, t):
        """-> ``(cache, tokens to prefill [B, C], their lengths [B], cache write positions [B])``."""
        return carry.cache, block.chunk, block.length, carry.pos

    def context_start(self, turn_starts, t, P0, active):
        """Transcript index where turn ``t``'s visible history (after the preamble) begins."""
        return jnp.where(active, P0, 0)


class ReprefillContext(FullContext):
    """``reprefill`` — a benchmark baseline, not a training mode: the same context as ``full``, but
    every turn rebuilds the KV cache by prefilling the whole conversation from position 0 (what the
    original and Tunix do), so ``benchmarks/rollout.py`` can measure what appending saves."""

    def prepare(self, model, carry: TurnCarry, block: UserBlock, t):
        B, L = carry.buf.shape
        fresh = init_cache(nnx.merge(*model).cfg, B, L, carry.cache.k.dtype)
        cache = prefill(model, fresh, carry.buf, jnp.zeros((B,), jnp.int32), jnp.where(block.active, carry.pos, 0))[1]
        return cache, block.chunk, block.length, carry.pos


class LimitedContext(FullContext):
    """``limited``: the system prompt and the last ``context_window`` turns (RAGEN's
    ``limited_multi_turn``). The cache holds only that (``Rollout.cache_len``) and is rebuilt at
    every turn boundary once the window slides."""

    def prepare(self, model, carry: TurnCarry, block: UserBlock, t):
        c, cd = self.rollout.config, self.rollout.codec
        P0 = len(cd.preamble_ids)
        cache = self._rebuild_window(model, carry.cache, carry.buf, block.turn_starts, carry.pos, t, block.active, P0)
        chunk, clen = block.chunk, block.length
        if c.context_window == 1:
            # The previous assistant's close belongs to a turn outside the window.
            chunk = jnp.take_along_axis(chunk, jnp.clip(block.close_len[:, None] + jnp.arange(cd.chunk_len)[None],
                                                        0, cd.chunk_len - 1), 1)
            clen = clen - block.close_len
        # The cache holds a shorter context than the transcript: its own write position.
        return cache, chunk, clen, self._cache_pos(block.turn_starts, carry.pos, t, P0)

    def _window(self, turn_starts, t):
        """(first turn kept in turn ``t``'s window, int32 [B] transcript index where it starts)."""
        first = jnp.maximum(t - self.rollout.config.context_window + 1, 0)
        start = jnp.take_along_axis(turn_starts, jnp.broadcast_to(first, (turn_starts.shape[0], 1)), 1)[:, 0]
        return first, start

    def context_start(self, turn_starts, t, P0, active):
        first, start = self._window(turn_starts, t)
        return jnp.where(active, jnp.where(first > 0, start, P0), 0)

    def _cache_pos(self, turn_starts, pos, t, P0):
        """Cache write position: preamble + the kept turns."""
        first, start = self._window(turn_starts, t)
        # With a one-turn window ``start`` lies after the previous close, which is not prefilled.
        return jnp.where(first > 0, P0 + jnp.maximum(pos - start, 0), pos)

    def _rebuild_window(self, model, cache, buf, turn_starts, pos, t, active, P0):
        """Re-prefill the last ``context_window - 1`` turns right after the preamble (slots ``P0..``).

        Before the window first slides (``t < context_window``) the cache already holds exactly
        that context and is kept as is. A one-turn window keeps nothing but the preamble: the new
        user block is written from slot ``P0`` and every slot past it is masked by position.
        """
        if self.rollout.config.context_window == 1:
            return cache
        first, start = self._window(turn_starts, t)
        B, L = buf.shape
        kept = jnp.where(active, pos - start, 0)
        j = jnp.arange(self.rollout.cache_len - P0)
        hist = jnp.take_along_axis(buf, jnp.clip(start[:, None] + j[None], 0, L - 1), 1)

        def rebuild(cache):
            return prefill(model, cache, hist, jnp.full((B,), P0, jnp.int32), kept)[1]

        return jax.lax.cond(first > 0, rebuild, lambda cache: cache, cache)


CONTEXT_STRATEGIES = {"full": FullContext, "limited": LimitedContext, "reprefill": ReprefillContext}
