"""A Qwen2 / Llama-family decoder in Flax NNX, plus the PPO value head.

Blocks, top to bottom (shapes: B batch, T query tokens, S cache slots, D hidden, H heads, K kv heads,
Hd head dim, V vocab):

  Decoder      tokens [B, T] -> embed -> L x DecoderLayer -> RMSNorm -> logits float32 [B, T, V]
  DecoderLayer x + Attention(RMSNorm(x)); then x + MLP(RMSNorm(x))      (pre-norm residual)
  Attention    GQA with RoPE (HF rotate_half convention), optional q/k/v(/o) bias, KV cache
  MLP          SwiGLU: down(silu(gate(x)) * up(x))
  ValueHead    hidden [B, T, D] -> value float32 [B, T]      (a scalar per token, for the critic)
  Critic       Decoder trunk + ValueHead, when the critic does not share the policy's trunk

Parameter names follow the HF checkpoints (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...), so
the weight-loading table in `loading.py` reads as a rename of the leaf only. With
`cfg.scan_layers` the layers' weights are stacked on a leading [L] axis (`layers.self_attn...`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.cpu_kernels import PANEL, cache_attention, kernels_apply, pack_panels, packed_dense
from ragen_jax.models.config import ModelConfig
from ragen_jax.models.kv_cache import (KVCache, SharedPrefix, as_bits, from_bits, init_cache, stored_values,
                                       write_layer)
from ragen_jax.models.sharding import constrain_activations, constrain_embedding_table

__all__ = ["Attention", "MLP", "DecoderLayer", "Decoder", "ValueHead", "Critic", "rope_frequencies",
           "rope_tables", "apply_rope", "KVCache", "SharedPrefix", "init_cache"]


# ---------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------
def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies float32 [Hd // 2], including the 'linear' and 'llama3' rescalings."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    scaling = cfg.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(scaling["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band in
        # between interpolated smoothly, so the model sees its pre-training frequencies where it can.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, Hd] for positions [B, T]; computed once per forward and shared by all layers.

    Angles are float32 (as HF computes them) and cast to the compute dtype afterwards.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Hd]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, Hd] (rotate_half convention: dims i and i + Hd/2 form a pair)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class LoRALinear(nnx.LoRALinear):
    """A projection with a low-rank adapter: ``y = x W (+ b) + scale * (x A) B``.

    ``nnx.LoRALinear`` plus the ``alpha / rank`` scale of the LoRA paper. ``A`` [in, r] starts
    random, ``B`` [r, out] at zero, so the adapted model starts as the base; both are
    ``nnx.LoRAParam`` in float32 whatever the base's dtype.
    """

    def __init__(self, d_in: int, d_out: int, *, scale: float, **kwargs):
        super().__init__(d_in, d_out, **kwargs)
        self.scale = float(scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        base = _dense(self, x) if self.precision is None else nnx.Linear.__call__(self, x)
        x_lora, a, b = self.lora.promote_dtype((x, self.lora.lora_a[...], self.lora.lora_b[...]),
                                               dtype=self.lora.dtype)
        return base + self.scale * lora_delta(x_lora, a, b)


@jax.custom_vjp
def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """The adapter's branch ``(x A) B``: x [..., in], A [in, r], B [r, out] -> [..., out].

    Its own backward rule, the same gradients as autodiff's: XLA's CPU backend lays the transposed
    products autodiff writes for the adapter's weight gradients (contractions over every token) out
    so that they miss its fast matmul path, which made a LoRA layer's backward pass 3x its forward
    (a SmolLM2 projection over 12 x 320 tokens: 77 ms for dA, dB against 28 ms here). Here every
    gradient is a product of row-major [tokens, features] operands."""
    return (x @ a) @ b


def _lora_delta_fwd(x, a, b):
    xa = x @ a
    return xa @ b, (x, a, b, xa)


def _lora_delta_bwd(res, g):
    x, a, b, xa = res
    g2 = g.reshape(-1, g.shape[-1])          # [tokens, out]
    x2 = x.reshape(-1, x.shape[-1])          # [tokens, in]
    xa2 = xa.reshape(-1, xa.shape[-1])       # [tokens, r]
    gb = g2 @ b.T.astype(g2.dtype)           # [tokens, r]
    db = xa2.T @ g2                          # [r, out]
    da = x2.T @ gb                           # [in, r]
    dx = (gb @ a.T.astype(gb.dtype)).reshape(x.shape)
    return dx.astype(x.dtype), da.astype(a.dtype), db.astype(b.dtype)


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


def _dense(linear: nnx.Linear, x: jax.Array) -> jax.Array:
    """``nnx.Linear.__call__`` (operands promoted to its dtype, its preferred output type, the bias
    added after) with the product taken by ``projection``."""
    kernel = linear.kernel[...]
    bias = linear.bias[...] if linear.bias is not None else None
    x, kernel, bias = linear.promote_dtype((x, kernel, bias), dtype=linear.dtype)
    y = projection(x, kernel, linear.preferred_element_type)
    if bias is not None:
        y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def projection(x: jax.Array, kernel: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out] (in ``out_dtype`` when given), with its own backward rule.

    The gradients are autodiff's, computed as products of row-major [tokens, features] operands:
    XLA's CPU backend lays out the weight gradient autodiff writes (a contraction over every token)
    by first copying the [tokens, out] cotangent transposed and then multiplying off its fast matmul
    path — on a 4-layer model's GRPO update those copies alone were a quarter of the step."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=out_dtype)


def _projection_fwd(x, kernel, out_dtype):
    return projection(x, kernel, out_dtype), (x, kernel)


def _projection_bwd(out_dtype, res, g):
    x, kernel = res
    # Products in the wider of the cotangent's and the operands' types (float32 under bfloat16 operands).
    acc = jnp.promote_types(g.dtype, x.dtype)
    g2 = g.reshape(-1, g.shape[-1]).astype(acc)             # [tokens, out]
    x2 = x.reshape(-1, x.shape[-1]).astype(acc)             # [tokens, in]
    d_kernel = x2.T @ g2                                    # [in, out]
    dx = (g2 @ kernel.T.astype(acc)).reshape(x.shape)
    return dx.astype(x.dtype), d_kernel.astype(kernel.dtype)


projection.defvjp(_projection_fwd, _projection_bwd)


def folded_kernel(kernel: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale: float) -> jax.Array:
    """An adapted projection as one kernel: ``W + scale · A B`` ([..., in, out], any leading layer
    axes), summed in float32 and stored in W's dtype."""
    delta = jnp.einsum("...ir,...ro->...io", lora_a.astype(jnp.float32), lora_b.astype(jnp.float32)) * scale
    return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)


class Linear(nnx.Linear):
    """``nnx.Linear``, whose kernel may also be held in panels (``pack_for_decode``, [N / 32, K, 32]):
    then the product is the CPU kernel ``packed_dense``."""

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if kernel.ndim == 2:
            return _dense(self, x) if self.precision is None else super().__call__(x)
        y = packed_dense(x, kernel).astype(x.dtype)
        # The bias as nnx.Linear adds it: in the matmul's operand dtype (bfloat16 panels: rounded).
        return y if self.bias is None else y + self.bias[...].astype(kernel.dtype).astype(y.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs, name: str = "") -> nnx.Linear:
    # Operands in cfg.matmul_operand_dtype; with a matmul_dtype the product comes out in the compute
    # dtype (accumulated there), so the residual stream never sees the narrower type.
    mixed = cfg.matmul_operand_dtype != cfg.compute_dtype
    kwargs = dict(use_bias=bias, dtype=cfg.matmul_operand_dtype, param_dtype=cfg.weight_dtype,
                  preferred_element_type=cfg.compute_dtype if mixed else None,
                  kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)
    if cfg.lora_rank and name in cfg.lora_targets:
        return LoRALinear(d_in, d_out, lora_rank=cfg.lora_rank, scale=cfg.lora_alpha / cfg.lora_rank,
                          lora_dtype=cfg.compute_dtype, lora_param_dtype=jnp.float32, **kwargs)
    return Linear(d_in, d_out, **kwargs)


def _rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # flax reduces in float32 even for bf16 inputs, like HF's Qwen2RMSNorm / LlamaRMSNorm.
    return nnx.RMSNorm(cfg.hidden_size, epsilon=cfg.rms_norm_eps, dtype=cfg.compute_dtype,
                       param_dtype=cfg.weight_dtype, rngs=rngs)


# ---------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------
class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and an optional KV cache.

    q_proj [D, H*Hd], k_proj / v_proj [D, K*Hd], o_proj [H*Hd, D]. Each kv head serves H/K query heads.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H, K, Hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, D, H * Hd, cfg.qkv_bias, rngs, "q_proj")
        self.k_proj = _linear(cfg, D, K * Hd, cfg.qkv_bias, rngs, "k_proj")
        self.v_proj = _linear(cfg, D, K * Hd, cfg.qkv_bias, rngs, "v_proj")
        self.o_proj = _linear(cfg, H * Hd, D, cfg.o_bias, rngs, "o_proj")

    def __call__(self, x: jax.Array, positions: jax.Array, rope: tuple[jax.Array, jax.Array],
                 cache: KVCache | SharedPrefix | None,
                 layer: int | jax.Array) -> tuple[jax.Array, KVCache | SharedPrefix | None]:
        """x [B, T, D], positions int32 [B, T], rope = rope_tables(positions) ->
        ([B, T, D], cache with this layer's slots written).

        Without a cache, attention is causal over the T axis (positions only drive RoPE). With a
        SharedPrefix, every query also sees all of the prefix's keys (returned unchanged). With a
        KVCache, the new keys/values go to slots `positions` of layer `layer` and query [b, t] sees
        the slots `<= positions[b, t]` of row b.
        """
        cfg = self.cfg
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim), *rope)
        k = apply_rope(self.k_proj(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim), *rope)
        v = self.v_proj(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cache is None:
            out = _causal_attend(q, k, v, cfg.attention_block_size)
        elif isinstance(cache, SharedPrefix):
            out = _causal_attend(q, k, v, cfg.attention_block_size, cache.k[layer], cache.v[layer])
        else:
            cache = write_layer(cache, layer, positions, k, v)
            out = _cached_attend(q, cache, layer, positions, cfg.attention_block_size, cfg.cache_block_size,
                                 cfg.cpu_kernels)
        return self.o_proj(out.reshape(B, T, cfg.num_heads * cfg.head_dim)), cache


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, head_major: bool = False) -> jax.Array:
    """Softmax attention with kv-head groups.

    q [B, T, H, Hd]; k, v [B, S, K, Hd], or [B, K, S, Hd] with ``head_major`` (the KV cache's layout,
    whose [S, Hd] matrices the two matmuls then take as they lie); mask bool [B or 1, T, S] (True = may
    attend) -> [B, T, H, Hd]. Scores and softmax are float32 whatever the compute dtype.
    """
    B, T, H, Hd = q.shape
    kv = "bksd" if head_major else "bskd"
    K = k.shape[1 if head_major else 2]
    q = q.reshape(B, T, K, H // K, Hd)
    scores = jnp.einsum(f"btkgd,{kv}->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(Hd)
    # A finite fill keeps a fully-masked row (a query at a negative position) NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{kv}->btkgd", probs, v)
    return out.reshape(B, T, H, Hd)


def _cached_attend(q: jax.Array, cache: KVCache, layer: int | jax.Array, positions: jax.Array,
                   block_size: int, cache_block: int = 0, mode: str = "off") -> jax.Array:
    """Attention of new queries over layer ``layer`` of a KV cache.

    ``mode`` is ``ModelConfig.cpu_kernels``: where it picks the CPU kernel (``models/cpu_kernels.py``),
    the kernel reads the cache in place and this XLA form only gives its gradient.

    q [B, T, H, Hd], positions int32 [B, T]; cache.k, cache.v [L, B, K, S, Hd] -> [B, T, H, Hd];
    query [b, t] sees the slots ``<= positions[b, t]``. A cache longer than one cache block
    (``cache_block``) is read block by block, and only up to the furthest position
    (``_attend_filled``), which also bounds the scores to [B, H, T, cache block]. A shorter one is
    read whole, ``block_size`` queries at a time: a prefill chunk of T tokens would otherwise hold
    [B, H, T, S] float32 scores at once. Decoding (T = 1) is one block.
    """
    if kernels_apply(mode, q.dtype):
        def reference(q, k, v, layer, positions):
            return _cached_attend(q, KVCache(k, v), layer, positions, block_size, cache_block)
        return cache_attention(q, cache.k, cache.v, layer, positions, reference).astype(q.dtype)
    T, S = q.shape[1], cache.max_len
    if S > cache_block_slots(cache_block):
        return _attend_filled(q, cache, layer, positions, cache_block)
    k, v = stored_values(cache.k[layer]).astype(q.dtype), stored_values(cache.v[layer]).astype(q.dtype)
    block = T if block_size <= 0 else block_size
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        mask = jnp.arange(S)[None, None, :] <= positions[:, start:end, None]
        outs.append(_attend(q[:, start:end], k, v, mask, head_major=True))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def cache_block_slots(cache_block: int) -> int:
    """``ModelConfig.cache_block_size`` resolved for the backend (0 = auto, see there)."""
    if cache_block > 0:
        return cache_block
    return 64 if jax.default_backend() == "cpu" else 1024


def _attend_filled(q: jax.Array, cache: KVCache, layer: int | jax.Array, positions: jax.Array,
                   cache_block: int = 0) -> jax.Array:
    """``_attend`` over the cache slots ``0 .. max(positions)`` only, in blocks of ``cache_block`` slots
    (a cache of more than one block).

    A rollout's cache is sized for the whole conversation, but a turn's queries see only what has been
    written so far: decoding the first reply of a 5-turn episode would otherwise read (and lay out for
    the matmul) every empty slot, on every step, in every layer — most of a decode step's time on CPU.
    The blocks are combined with a running max and sum (the online softmax), so the result equals one
    softmax over the filled slots up to float rounding. Blocks are sliced straight out of the stacked
    cache (a per-layer slice of it would be a copy of the whole layer). q [B, T, H, Hd], positions
    int32 [B, T]; cache.k, cache.v [L, B, K, S, Hd] -> [B, T, H, Hd].
    """
    B, T, H, Hd = q.shape
    K, S = cache.k.shape[2], cache.k.shape[3]
    # The fewest blocks of at most ``cache_block`` slots, split evenly (a 96-slot cache is read as 2 x 48,
    # not as 64 + an overlapping 64): each block is copied out of the cache before its matmuls.
    block = cache_block_slots(cache_block)
    block = -(-S // -(-S // block))
    qg = q.reshape(B, T, K, H // K, Hd)
    # The last block starts at S - block when S is not a whole number of blocks: it then overlaps the
    # one before, and the slots that block already counted are masked out of it below.
    num_blocks = jnp.clip(jnp.max(positions) // block + 1, 1, -(-S // block))
    low = jnp.finfo(jnp.float32).min

    def attend_block(i, carry):
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, Hd] float32
        first = jnp.minimum(i * block, S - block)
        ks, vs = (stored_values(jax.lax.dynamic_slice(x, (layer, 0, 0, first, 0), (1, B, K, block, Hd))[0])
                  .astype(q.dtype) for x in (cache.k, cache.v))
        slots = first + jnp.arange(block)
        # Slots of this block only (an overlapping last block skips what the previous block covered).
        visible = (slots[None, None, :] <= positions[:, :, None]) & (slots >= i * block)[None, None, :]
        scores = jnp.einsum("btkgd,bksd->bkgts", qg, ks, preferred_element_type=jnp.float32) / math.sqrt(Hd)
        scores = jnp.where(visible[:, None, None], scores, low)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        l = l * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p.astype(vs.dtype), vs,
                                                    preferred_element_type=jnp.float32)
        return m_new, l, acc

    def body(carry, i):
        # A scan with a skip rather than a loop to num_blocks: reverse-mode differentiation (scoring a
        # continuation of a cached prompt) needs a static trip count.
        return jax.lax.cond(i < num_blocks, attend_block, lambda i, c: c, i, carry), None

    G = H // K
    init = (jnp.full((B, K, G, T), low, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, Hd), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(body, init, jnp.arange(-(-S // block)))
    out = (acc / l[..., None]).astype(q.dtype)  # [B, K, G, T, Hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, Hd)


def _causal_attend(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int,
                   prefix_k: jax.Array | None = None, prefix_v: jax.Array | None = None) -> jax.Array:
    """Causal attention over the T axis, one block of queries at a time.

    q [B, T, H, Hd]; k, v [B, T, K, Hd]; optional prefix_k, prefix_v [B or 1, K, P, Hd] (the cache's
    head-major layout) that every query also sees (a shared prompt) -> [B, T, H, Hd]. The block of
    queries [s, e) attends to the prefix and keys [0, e) only: the score blocks above the diagonal,
    which the causal mask would zero anyway, are never computed. Same result as one masked softmax
    over [T, P + T] (masked scores contribute exactly 0); on long teacher-forced rows it does
    ~(1 + 1/n)/2 of the work with n = T / block_size blocks, and the StarPO update and the BC warm-up
    spend most of their time here.
    """
    B, T = q.shape[:2]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    P = 0
    if prefix_k is not None:
        # To the new keys' slot-major [B, P, K, Hd]: one copy of the prefix per call.
        prefix_k, prefix_v = (jnp.swapaxes(x, 1, 2) for x in (prefix_k, prefix_v))
        P = prefix_k.shape[1]
        shape = (B,) + prefix_k.shape[1:]
        prefix_k = jnp.broadcast_to(prefix_k.astype(q.dtype), shape)
        prefix_v = jnp.broadcast_to(prefix_v.astype(q.dtype), shape)
    block = T if block_size <= 0 else block_size
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        # Query start + i sees the whole prefix and new keys 0 .. start + i.
        mask = jnp.arange(P + end)[None, :] <= (P + start + jnp.arange(end - start))[:, None]
        ks, vs = k[:, :end], v[:, :end]
        if P:
            ks, vs = jnp.concatenate([prefix_k, ks], axis=1), jnp.concatenate([prefix_v, vs], axis=1)
        outs.append(_attend(q[:, start:end], ks, vs, mask[None]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


class MLP(nnx.Module):
    """SwiGLU feed-forward: gate_proj, up_proj [D, F]; down_proj [F, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(cfg, D, F, cfg.mlp_bias, rngs, "gate_proj")
        self.up_proj = _linear(cfg, D, F, cfg.mlp_bias, rngs, "up_proj")
        self.down_proj = _linear(cfg, F, D, cfg.mlp_bias, rngs, "down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(cfg, rngs)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, rope: tuple[jax.Array, jax.Array],
                 cache: KVCache | None, layer: int | jax.Array) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, D] -> ([B, T, D], cache)."""
        attn, cache = self.self_attn(self.input_layernorm(x), positions, rope, cache, layer)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


def _run_layer(graphdef, state, x, positions, rope, cache, layer):
    """A layer as a pure function of its weights (what `lax.scan` and `jax.checkpoint` need)."""
    return nnx.merge(graphdef, state)(x, positions, rope, cache, layer)


class Decoder(nnx.Module):
    """The causal LM: `logits, cache = model(tokens, positions, cache=None)`.

    embed_tokens [V, D]; layers (a list of DecoderLayer, or one DecoderLayer whose weights carry a
    leading [L] axis when cfg.scan_layers); norm; lm_head [D, V] unless tie_word_embeddings (then
    the logits use embed_tokens transposed) or ``lm_head=False`` (a trunk that only gives hidden states).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lm_head: bool = True):
        self.cfg = cfg
        self.has_lm_head = lm_head or cfg.tie_word_embeddings
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                                      param_dtype=cfg.weight_dtype,
                                      embedding_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)
        layers = [DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
        if cfg.scan_layers:
            # Built layer by layer from the same rng stream, then stacked: a scanned model and a
            # looped one made from equal Rngs hold equal weights.
            graphdef, _ = nnx.split(layers[0])
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(l) for l in layers])
            self.layers = nnx.merge(graphdef, stacked)
        else:
            self.layers = nnx.List(layers)
        self.norm = _rms_norm(cfg, rngs)
        if lm_head and not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array,
               cache: KVCache | SharedPrefix | None = None, *,
               lower: jax.Array | None = None) -> tuple[jax.Array, KVCache | SharedPrefix | None]:
        """tokens, positions int32 [B, T] -> (final-normed hidden [B, T, D] in cfg.dtype, cache).

        ``cache``: None (the tokens are a whole sequence, causal), a KVCache (decode / prefill into
        slots ``positions``), or a SharedPrefix (the tokens continue that prompt; positions should
        then start at its length).
        ``lower``: these tokens' residual stream after the frozen layers (``frozen_residual``, [B, T, D]);
        the pass then starts there and runs the layers above ``cfg.frozen_layers`` only — the same
        output, without the frozen layers' forward (cache None or a SharedPrefix).
        """
        cfg = self.cfg
        self._check_inputs(tokens, positions, cache)
        positions = positions.astype(jnp.int32)
        rope = rope_tables(positions, rope_frequencies(cfg), cfg.compute_dtype)
        if lower is None:
            x, cache = self._layers(self._embed(tokens), positions, rope, cache, 0, cfg.num_layers)
        else:
            if isinstance(cache, KVCache):
                raise ValueError("hidden(lower=...) continues a whole sequence or a SharedPrefix; a KVCache "
                                 "would miss the frozen layers' keys and values")
            if lower.shape != tokens.shape + (cfg.hidden_size,):
                raise ValueError(f"lower must be [batch, seq, {cfg.hidden_size}] for tokens {tokens.shape}; got "
                                 f"{lower.shape}")
            x, cache = self._layers(lower.astype(cfg.compute_dtype), positions, rope, cache, cfg.frozen_layers,
                                    cfg.num_layers)
        return self.norm(x), cache

    def frozen_residual(self, tokens: jax.Array, positions: jax.Array,
                        cache: SharedPrefix | None = None) -> jax.Array:
        """tokens, positions int32 [B, T] -> the residual stream after the frozen layers [B, T, D]
        (``cfg.frozen_layers``; the embeddings when none), under stop_gradient: what
        ``hidden(..., lower=)`` starts from. The frozen weights do not change during an update, so a
        scoring pass can compute it once for the loss pass too."""
        cfg = self.cfg
        if isinstance(cache, KVCache):
            raise ValueError("frozen_residual runs a whole sequence or continues a SharedPrefix, not a KVCache")
        self._check_inputs(tokens, positions, cache)
        positions = positions.astype(jnp.int32)
        rope = rope_tables(positions, rope_frequencies(cfg), cfg.compute_dtype)
        x, _ = self._layers(self._embed(tokens), positions, rope, cache, 0, cfg.frozen_layers)
        return jax.lax.stop_gradient(x)

    def _check_inputs(self, tokens, positions, cache) -> None:
        cfg = self.cfg
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(f"tokens and positions must both be [batch, seq]; got {tokens.shape} "
                             f"and {positions.shape}.")
        if not (jnp.issubdtype(tokens.dtype, jnp.integer) and jnp.issubdtype(positions.dtype, jnp.integer)):
            raise ValueError(f"tokens and positions must be integer arrays; got {tokens.dtype} and "
                             f"{positions.dtype}.")
        if isinstance(cache, SharedPrefix) and cache.k.shape[1] not in (1, tokens.shape[0]):
            raise ValueError(f"a SharedPrefix of {cache.k.shape[1]} rows cannot serve {tokens.shape[0]} rows; "
                             "encode it from one row (encode_prefix(tokens[:1, :P])).")
        if cache is not None and cache.k.shape[0] != cfg.num_layers:
            raise ValueError(f"cache has {cache.k.shape[0]} layers, the model {cfg.num_layers}; "
                             "build it with init_cache(cfg, batch, max_len).")

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, T] -> the residual stream's start [B, T, D] in cfg.compute_dtype."""
        # Under a mesh (jax.set_mesh) the residual stream is pinned batch-sharded at every block
        # boundary; without one constrain_activations is the identity.
        table = self.embed_tokens.embedding[...]
        if table.ndim == 3:  # the tied embedding in panels (pack_for_decode): row v is column v % 32 of panel v // 32
            x = table[tokens // PANEL, :, tokens % PANEL].astype(self.cfg.compute_dtype)
        else:
            x = jnp.take(constrain_embedding_table(table), tokens, axis=0).astype(self.cfg.compute_dtype)
        return constrain_activations(x)

    def _layers(self, x: jax.Array, positions: jax.Array, rope, cache, first: int, last: int):
        """Layers ``first .. last - 1`` over the residual stream x [B, T, D] -> (x, cache)."""
        cfg = self.cfg
        # A bfloat16 cache goes through the layers as its uint16 bits: one bitcast each way per forward
        # instead of a whole-buffer copy at every layer's write (kv_cache.as_bits). A cache already held
        # as bits (generate's loop) stays so.
        to_bits = isinstance(cache, KVCache) and cache.k.dtype == jnp.bfloat16
        if to_bits:
            cache = as_bits(cache)
        # With lora_top_layers the layers below the top ones are frozen: their weights (adapters
        # included) enter under stop_gradient, so a backward pass never reaches them and they need no
        # rematerialisation (cfg.frozen_layers; 0 otherwise).
        frozen = min(max(cfg.frozen_layers, first), last)
        # A SharedPrefix is read, never written: each layer gets its own slice of it (a scan input,
        # not part of the carry, so a backward pass does not move the whole [L, ...] buffer's
        # cotangent through every layer), and the frozen layers' slices enter under stop_gradient —
        # they come from frozen layers, but the buffer also holds the trained layers' keys, and
        # without it autodiff would run the frozen layers' backward for nothing.
        prefix = cache if isinstance(cache, SharedPrefix) else None

        def layer_prefix(k, v, stop_gradient):  # [1, ...] slices of one layer
            return jax.lax.stop_gradient(SharedPrefix(k, v)) if stop_gradient else SharedPrefix(k, v)

        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.layers)
            remat_step = jax.checkpoint(_run_layer, static_argnums=(0,)) if cfg.remat else _run_layer

            def run(x, cache, start, stop, step, stop_gradient):
                if stop <= start:
                    return x, cache
                weights = jax.tree.map(lambda w: w[start:stop], stacked)
                if stop_gradient:
                    weights = jax.lax.stop_gradient(weights)
                layers = start + jnp.arange(stop - start)
                if prefix is not None:
                    def body(x, xs):
                        state, k, v = xs
                        x, _ = step(graphdef, state, x, positions, rope, layer_prefix(k[None], v[None], stop_gradient), 0)
                        return constrain_activations(x), None

                    x, _ = jax.lax.scan(body, x, (weights, prefix.k[start:stop], prefix.v[start:stop]))
                    return x, cache

                def body(carry, xs):
                    x, cache = carry
                    state, layer = xs
                    x, cache = step(graphdef, state, x, positions, rope, cache, layer)
                    return (constrain_activations(x), cache), None

                (x, cache), _ = jax.lax.scan(body, (x, cache), (weights, layers))
                return x, cache

            x, cache = run(x, cache, first, frozen, _run_layer, True)
            x, cache = run(x, cache, frozen, last, remat_step, False)
        else:
            for i in range(first, last):
                layer = self.layers[i]
                own, index = cache, i
                if prefix is not None:
                    own, index = layer_prefix(prefix.k[i:i + 1], prefix.v[i:i + 1], i < frozen), 0
                if i < frozen:
                    graphdef, state = nnx.split(layer)
                    x, own = _run_layer(graphdef, jax.lax.stop_gradient(state), x, positions, rope, own, index)
                elif cfg.remat:
                    graphdef, state = nnx.split(layer)
                    x, own = jax.checkpoint(_run_layer, static_argnums=(0, 6))(
                        graphdef, state, x, positions, rope, own, index)
                else:
                    x, own = layer(x, positions, rope, own, index)
                if prefix is None:
                    cache = own
                x = constrain_activations(x)
        return x, from_bits(cache) if to_bits else cache

    def encode_prefix(self, tokens: jax.Array) -> tuple[jax.Array, SharedPrefix]:
        """tokens int32 [b, P] (positions 0..P-1) -> (hidden [b, P, D], SharedPrefix of them).

        Run a prompt every row shares once (b = 1), then continue each row from it with
        ``hidden(rest, P + arange, prefix)``: the same hidden states as one pass over the whole rows.
        """
        b, P = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (b, P))
        hidden, cache = self.hidden(tokens, positions, init_cache(self.cfg, b, P))
        return hidden, SharedPrefix(cache.k, cache.v)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, D] -> logits float32 [B, T, V] (operands in cfg.matmul_operand_dtype,
        accumulated in float32)."""
        dtype = self.cfg.matmul_operand_dtype
        if not self.has_lm_head:
            raise ValueError("this Decoder was built with lm_head=False (a critic's trunk): it has hidden states, "
                             "no logits")
        tied = self.cfg.tie_word_embeddings
        weight = (self.embed_tokens.embedding if tied else self.lm_head.kernel)[...]  # [V, D] tied, else [D, V]
        if weight.ndim == 3:  # in panels (pack_for_decode)
            return packed_dense(hidden, weight)
        spec = "btd,vd->btv" if tied else "btd,dv->btv"
        return jnp.einsum(spec, hidden.astype(dtype), weight.astype(dtype), preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions int32 [B, T] -> (logits float32 [B, T, V], cache)."""
        hidden, cache = self.hidden(tokens, positions, cache)
        return self.logits(hidden), cache


def decode_form(graphdef: nnx.GraphDef, state: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """The model as sampling runs it: LoRA adapters folded into their projections
    (``W + (alpha / r) A B``), stacked layers unstacked into a list, no rematerialisation, projection
    weights stored in the matmuls' operand dtype (``matmul_dtype``), then ``pack_for_decode``.
    -> ``(graphdef, state)`` of a plain Decoder computing the same function up to float rounding.

    Why: the CPU kernels (``packed_dense``) run only on plain, unstacked float32 projections, and a
    scanned decode slices every layer's weights out of the stack at each token; a LoRA model trained
    with scanned, rematerialised layers (``configs/base.use_smollm2_with_lora``) would otherwise decode
    on XLA's slowest forms. Folding costs one [in, r] x [r, out] product per projection per call (a
    rollout, a validation), far below one decode step. Where nothing applies (no adapters, layers not
    stacked, weights stored as multiplied) it is ``(graphdef, pack_for_decode(graphdef, state))``.
    Pure: runs under any trace.
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    if not (cfg.lora_rank or cfg.scan_layers or cfg.remat or cfg.matmul_operand_dtype != cfg.weight_dtype):
        return graphdef, pack_for_decode(graphdef, state)
    plain_cfg = cfg.replace(lora_rank=0, scan_layers=False, remat=False)
    plain_graphdef, plain = nnx.split(nnx.eval_shape(lambda: Decoder(plain_cfg, rngs=nnx.Rngs(0),
                                                                     lm_head=model.has_lm_head)))
    source = {tuple(path): var[...] for path, var in nnx.to_flat_state(state)}
    scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
    operand = cfg.matmul_operand_dtype

    def weight(path: tuple):
        layer = None
        if cfg.scan_layers and path[0] == "layers":  # ("layers", i, ...) <- ("layers", ...)[i]
            layer, path = path[1], ("layers",) + path[2:]
        value = source[path]
        lora = path[:-1] + ("lora", "lora_a")
        if path[-1] == "kernel" and lora in source:
            a, b = source[lora], source[path[:-1] + ("lora", "lora_b")]
            if layer is not None:
                value, a, b = value[layer], a[layer], b[layer]
            value = folded_kernel(value, a, b, scale)
        elif layer is not None:
            value = value[layer]
        if path[-1] == "kernel" and value.dtype != operand:
            # Stored as the matmul reads it (bfloat16 operands of float32 weights): the same numbers,
            # half the bytes each decode step streams, no rounding at every call.
            value = value.astype(operand)
        return value

    plain = nnx.from_flat_state([(path, var.replace(value=weight(tuple(path))))
                                 for path, var in nnx.to_flat_state(plain)])
    return plain_graphdef, pack_for_decode(plain_graphdef, plain)


def pack_for_decode(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.State:
    """The model's weights with every float32 projection (and the logits' weight) in panels, for the
    ``packed_dense`` CPU kernel: what ``generate`` multiplies by, repacked once per call.

    Unchanged (returned as is) unless ``cfg.cpu_kernels`` picks the kernels here; projections with
    LoRA adapters, widths that are not a multiple of 32, weights not held in the matmul's operand
    dtype (float32, or bfloat16 with ``matmul_dtype="bfloat16"``) and scanned (stacked) layers keep
    XLA's matmul. Packing reads and writes every weight once; weights already in
    panels are left as they are, so a caller that decodes many times with the same weights (a server,
    a benchmark) packs once, at load, and every ``prefill`` and ``generate`` then runs on the panels.
    The packed copy lives beside the weights it was made from while it is in use (one more copy of
    the float32 projections in memory during a rollout).
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    operand = cfg.matmul_operand_dtype
    if (cfg.scan_layers or operand not in (jnp.float32, jnp.bfloat16)
            or not kernels_apply(cfg.cpu_kernels, cfg.compute_dtype)):
        return state
    # Which weights to pack (path -> given transposed), then a new state: nothing is mutated, so this runs
    # under any trace (generate inside a rollout's scan). A projection is packed when its weight is held
    # in the matmul's operand dtype (float32, or bfloat16 operands stored so: decode_form).
    targets = {tuple(path) + ("kernel",): False for path, module in nnx.iter_graph(model)
               if type(module) is Linear and module.kernel[...].ndim == 2 and module.kernel[...].shape[1] % PANEL == 0
               and module.kernel[...].dtype == operand}
    # The tied embedding is also the input lookup, which reads it in float32: packed only where the
    # logits' matmul takes float32 operands too.
    if (model.has_lm_head and cfg.tie_word_embeddings and cfg.vocab_size % PANEL == 0 and operand == jnp.float32
            and model.embed_tokens.embedding[...].ndim == 2 and model.embed_tokens.embedding[...].dtype == operand):
        targets[("embed_tokens", "embedding")] = True
    return nnx.from_flat_state([(path, value.replace(value=pack_panels(value[...], targets[tuple(path)]))
                                 if tuple(path) in targets else value) for path, value in nnx.to_flat_state(state)])


class ValueHead(nnx.Module):
    """Scalar value per token: hidden [B, T, D] -> float32 [B, T].

    Used on its own when the critic shares the policy's trunk (`head(policy.hidden(...)[0])`), and
    inside `Critic` when it has its own. Initialised like HF's token-classification `score` layer
    (normal(initializer_range) kernel, zero bias), as verl's value-head model is.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.score = nnx.Linear(cfg.hidden_size, 1, use_bias=True, param_dtype=cfg.weight_dtype,
                                kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        w = self.score.kernel[...].astype(jnp.float32)
        return (hidden.astype(jnp.float32) @ w)[..., 0] + self.score.bias[...].astype(jnp.float32)[0]


class Critic(nnx.Module):
    """A separate critic: its own Decoder trunk + ValueHead. `values, cache = critic(tokens, positions)`.

    The trunk is a Decoder without an LM head (with untied embeddings that is a [D, V] matrix, e.g.
    545M of Qwen2.5-7B's parameters, plus its two AdamW moments, that a critic never uses);
    ``init_trunk_from(policy)`` starts it from a policy's weights. values: float32
    [B, T], value of the state ending at token t.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.trunk = Decoder(cfg, rngs=rngs, lm_head=False)
        self.value_head = ValueHead(cfg, rngs=rngs)

    def init_trunk_from(self, policy: Decoder) -> None:
        """Copy ``policy``'s trunk weights (everything but its LM head) into this critic's trunk."""
        params = nnx.state(policy, nnx.Param)
        nnx.update(self.trunk, nnx.State({k: v for k, v in params.items() if k != "lm_head"}))

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        hidden, cache = self.trunk.hidden(tokens, positions, cache)
        return self.value_head(hidden), cache
