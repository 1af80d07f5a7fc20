"""The KV cache: one key/value slot per position, per layer, per row.

Slot semantics (the contract every caller relies on): token `[b, t]` at position `p = positions[b, t]`
is written to slot `p` of row `b`, and it attends to every slot `<= p` of that row. Writes at
positions outside `[0, max_len)` are dropped. Each row therefore has its own write position and a
ragged batch needs no extra mask: padding written beyond a row's valid length sits in slots that the
row's next real token overwrites before any query can see them. Positions within one row of one
call must be distinct (a chunk is `start + arange(C)`); two tokens sent to the same slot leave one
of them, unspecified which.

The cache is stacked over layers and laid out head-major, [L, B, K, S, Hd]: each (row, kv head)
is one contiguous [S, Hd] matrix, the operand attention's two matmuls take (scores ``q @ k^T`` and
``probs @ v``, batched over rows and kv heads). With a slot-major [L, B, S, K, Hd] cache every block
that attention read was transposed into that form first (11% of a SmolLM2 batch-64 decode step on
a 2-core CPU); now a block is a contiguous slice (``benchmarks/results_vs_tunix.md``). Each layer
scatters its new keys/values into its slice and then reads the slice back for attention; because
the next layer's keys depend on that read, XLA orders every read before the next write and updates
the buffer in place (checked on the compiled decode loop: no per-step copy of the cache).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ragen_jax.models.config import ModelConfig


class KVCache(NamedTuple):
    """Keys and values after RoPE, as a pytree.

    k, v: [layers, batch, kv_heads, max_len, head_dim]
    """

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


class SharedPrefix(NamedTuple):
    """Keys and values (after RoPE) of a prompt that every row of a teacher-forced pass continues.

    k, v: [layers, 1 or batch, kv_heads, prefix_len, head_dim] (the cache's layout). Passed as the ``cache`` of
    ``Decoder.hidden``, it is read-only: the new tokens (at positions ``prefix_len, ...``) attend to
    all of it and causally among themselves, and it comes back unchanged. Built by
    ``Decoder.encode_prefix``; one row of it serves any batch (the prompt is run once).
    """

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An all-zero cache; `dtype` defaults to ``cfg.kv_cache_dtype``, else the model's compute dtype.

    Returns KVCache with k, v: [cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim].
    """
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs batch > 0 and max_len > 0, got batch={batch}, max_len={max_len}.")
    dtype = jnp.dtype((cfg.kv_cache_dtype or cfg.dtype) if dtype is None else dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def broadcast_cache(cache: KVCache, batch: int) -> KVCache:
    """A one-row cache (a prompt prefilled once) shared by ``batch`` rows: [L, 1, K, S, Hd] ->
    [L, batch, K, S, Hd]. A broadcast, not a copy; the rows' own writes then land per row."""
    if cache.batch != 1:
        raise ValueError(f"broadcast_cache needs a one-row cache, got batch={cache.batch}.")
    return jax.tree.map(lambda x: jnp.broadcast_to(x, x.shape[:1] + (batch,) + x.shape[2:]), cache)


def write_layer(cache: KVCache, layer: int | jax.Array, positions: jax.Array,
                k_new: jax.Array, v_new: jax.Array) -> KVCache:
    """Scatter one layer's new keys/values into their slots.

    positions: int32 [B, T]; k_new, v_new: [B, T, kv_heads, head_dim]. Slots outside
    [0, max_len) are dropped (negative positions too: they are sent past the end first, because a
    plain negative index would wrap around to the last slot).
    """
    batch, _ = positions.shape
    slots = jnp.where(positions < 0, cache.max_len, positions)
    rows = jnp.arange(batch)[:, None]
    return KVCache(_scatter_slots(cache.k, layer, rows, slots, k_new),
                   _scatter_slots(cache.v, layer, rows, slots, v_new))


def as_bits(cache: KVCache) -> KVCache:
    """A bfloat16 cache as its uint16 bits (any other dtype unchanged), for a loop of many writes.

    XLA's CPU backend cannot scatter into a bfloat16 buffer in place (``_scatter_slots``), and
    bitcasting the whole buffer around each write copies it. ``Decoder.hidden`` therefore bitcasts
    once before its layers and once after, and ``prefill``'s and ``generate``'s loops once around the
    whole loop (``from_bits``); inside, ``write_layer`` scatters bits and attention bitcasts only the
    blocks it reads (``stored_values``). The values are the same.
    """
    if cache.k.dtype != jnp.bfloat16:
        return cache
    return KVCache(*(jax.lax.bitcast_convert_type(x, jnp.uint16) for x in cache))


def from_bits(cache: KVCache) -> KVCache:
    """``as_bits`` undone: a uint16 cache back as bfloat16 (any other dtype unchanged)."""
    return KVCache(*(stored_values(x) for x in cache))


def stored_values(x: jax.Array) -> jax.Array:
    """A slice of a cache buffer as values: uint16 bits (``as_bits``) read as bfloat16."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def _scatter_slots(buffer: jax.Array, layer, rows: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """``buffer[layer, rows, :, slots] = new`` (advanced indices split by the kv-head slice: the indexed
    view is [B, T, K, Hd], like ``new``), slots past the end dropped.

    A bfloat16 buffer is written as its uint16 bits: XLA's CPU backend widens a bfloat16 scatter to
    float32, converting the whole buffer there and back on every write. Through the bits, 30 layer
    writes of a [30, 64, 3, 96, 64] cache take 27 ms instead of 849 ms (a float32 cache: 7 ms; the
    CPU still copies the buffer for each bitcast, which an accelerator does not). A buffer already
    held as bits (``as_bits``, as ``Decoder.hidden`` and the sampler's loops hold it) is written
    directly: no copy.
    """
    if buffer.dtype == jnp.bfloat16:
        bits = _scatter_slots(jax.lax.bitcast_convert_type(buffer, jnp.uint16), layer, rows, slots, new)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    if buffer.dtype == jnp.uint16:  # a cache held as bits (``as_bits``)
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), jnp.uint16)
    return buffer.at[layer, rows, :, slots].set(new.astype(buffer.dtype), mode="drop")
