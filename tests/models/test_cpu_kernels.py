"""The CPU kernels (models/cpu_kernels.py): cache attention against a NumPy re-derivation of attention
over a KV cache and its gradient against a plain masked softmax; the packed matmul against NumPy; and
the decode they serve against XLA's forms."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import cpu_kernels as ca
from ragen_jax.models.config import ModelConfig
from ragen_jax.models.decoder import Decoder, _cached_attend
from ragen_jax.models.kv_cache import KVCache, as_bits, init_cache
from ragen_jax.models.sampler import SamplingConfig, generate, prefill


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not ca.available():
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"a C++ compiler is installed but the kernel did not build: {ca.why_unavailable()}")
        pytest.skip(ca.why_unavailable())


def numpy_attention(q, k, v, layer, positions):
    """Query [b, t] (head h, kv head h // G) attends to slots 0 .. positions[b, t] of its row."""
    B, T, H, Hd = q.shape
    K, S = k.shape[2], k.shape[3]
    out = np.zeros((B, T, H, Hd), np.float64)
    for b in range(B):
        for t in range(T):
            n = min(positions[b, t], S - 1) + 1
            for h in range(H):
                if n <= 0:
                    continue
                keys, values = k[layer, b, h // (H // K), :n], v[layer, b, h // (H // K), :n]
                s = keys.astype(np.float64) @ q[b, t, h].astype(np.float64) / np.sqrt(Hd)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ values
    return out


def _problem(seed, L=3, B=4, K=2, G=3, S=40, Hd=16, T=5):
    rng = np.random.RandomState(seed)
    k = rng.randn(L, B, K, S, Hd).astype(np.float32)
    v = rng.randn(L, B, K, S, Hd).astype(np.float32)
    q = rng.randn(B, T, K * G, Hd).astype(np.float32)
    positions = rng.randint(0, S, (B, T)).astype(np.int32)
    positions[0] = [-1, 0, 1, S - 1, S + 3][:T]  # nothing visible, one slot, two, all, past the end
    return q, k, v, positions


def _kernel(q, k, v, layer, positions):
    return _cached_attend(jnp.asarray(q), KVCache(jnp.asarray(k), jnp.asarray(v)), layer, jnp.asarray(positions),
                          64, 16, "on")


@pytest.mark.parametrize("layer", [0, 2])
def test_matches_numpy_attention(layer):
    q, k, v, positions = _problem(0)
    got = np.asarray(jax.jit(_kernel, static_argnums=3)(q, k, v, layer, positions))
    want = numpy_attention(q, k, v, layer, positions)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    assert np.all(got[0, 0] == 0)  # a query at a negative position sees nothing


def test_traced_layer_and_one_query_per_row():
    """Decoding: T = 1, the layer index traced (a scan over layers), kv heads of 1 (multi-query)."""
    q, k, v, positions = _problem(1, K=1, G=4, T=1, Hd=64, S=70)
    positions[0] = 5

    def run(q, k, v, positions):
        def body(total, layer):
            return total + _kernel(q, k, v, layer, positions), None
        return jax.lax.scan(body, jnp.zeros(q.shape, jnp.float32), jnp.arange(k.shape[0]))[0]

    want = sum(numpy_attention(q, k, v, layer, positions) for layer in range(k.shape[0]))
    np.testing.assert_allclose(np.asarray(jax.jit(run)(q, k, v, positions)), want, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_held_as_bits():
    q, k, v, positions = _problem(2)
    bits = as_bits(KVCache(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)))
    got = np.asarray(_cached_attend(jnp.asarray(q), bits, 1, jnp.asarray(positions), 64, 16, "on"))
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v)]
    np.testing.assert_allclose(got, numpy_attention(q, *rounded, 1, positions), atol=2e-6, rtol=1e-5)


def test_gradient_matches_a_masked_softmax():
    """The backward pass (the XLA form, recomputed) against jax.grad of a plain [T, S] masked softmax."""
    q, k, v, positions = _problem(3)
    positions = np.maximum(positions, 0)  # every query sees a slot
    G = q.shape[2] // k.shape[2]

    def plain(q, k, v):
        keys, values = (jnp.repeat(x[1], G, axis=1) for x in (k, v))  # [B, H, S, Hd]
        scores = jnp.einsum("bthd,bhsd->bhts", q, keys) / np.sqrt(q.shape[-1])
        mask = jnp.arange(k.shape[3])[None, None, :] <= positions[:, :, None]
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
        return jnp.einsum("bhts,bhsd->bthd", probs, values)

    weights = jnp.asarray(np.random.RandomState(4).randn(*q.shape), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * weights)
    got = jax.grad(loss(lambda q, k, v: _kernel(q, k, v, 1, positions)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def _tiny(mode, tied, vocab=96, seed=0):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, initializer_range=0.2, cpu_kernels=mode, cache_block_size=16,
                      tie_word_embeddings=tied)
    return cfg, Decoder(cfg, rngs=nnx.Rngs(seed))


def test_packed_dense_matches_numpy():
    rng = np.random.RandomState(6)
    # A partial register block, several panels, several chunks of 64 rows (a prefill).
    for rows, k, n in [(1, 24, 32), (13, 40, 96), (64, 576, 192), (150, 48, 64)]:
        x, w = rng.randn(rows, k).astype(np.float32), rng.randn(k, n).astype(np.float32)
        want = x.astype(np.float64) @ w
        got = ca.packed_dense(jnp.asarray(x), ca.pack_panels(jnp.asarray(w)))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)
        # A tied embedding [V, D] used as the logits' weight: panels of its transpose.
        got = ca.packed_dense(jnp.asarray(x), ca.pack_panels(jnp.asarray(w.T.copy()), transposed=True))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)


def _bf16(a):
    """float32 -> the nearest bfloat16 (round to nearest even), as float64: NumPy has no bfloat16."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def test_packed_dense_of_bfloat16_weights_matches_numpy():
    """bfloat16 panels: both operands rounded to bfloat16 (by hand here), products summed exactly enough
    in float64 — the kernel's float32 sums stay within float32 rounding of that."""
    rng = np.random.RandomState(7)
    for rows, k, n in [(1, 24, 32), (13, 40, 96), (64, 576, 192), (150, 48, 64)]:
        x, w = rng.randn(rows, k).astype(np.float32), rng.randn(k, n).astype(np.float32)
        want = _bf16(x) @ _bf16(w)
        panels = ca.pack_panels(jnp.asarray(w, jnp.bfloat16))
        assert panels.dtype == jnp.bfloat16
        got = ca.packed_dense(jnp.asarray(x), panels)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)
        assert np.abs(np.asarray(got) - x.astype(np.float64) @ w).max() > 1e-3  # it did round


def test_bfloat16_decode_on_panels_equals_xlas_bfloat16_matmuls():
    """matmul_dtype=bfloat16: the decode form (weights stored and packed as bfloat16) gives the greedy
    tokens and log-probs of XLA's bfloat16 matmuls on the same weights."""
    from ragen_jax.models.decoder import decode_form

    prompt = jnp.asarray(np.random.RandomState(5).randint(0, 96, (3, 9)), jnp.int32)
    outs = {}
    for mode in ("on", "off"):
        cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, initializer_range=0.2, cpu_kernels=mode,
                          matmul_dtype="bfloat16", tie_word_embeddings=True)
        graphdef, state = decode_form(*nnx.split(Decoder(cfg, rngs=nnx.Rngs(0))))
        packed = [v[...] for p, v in nnx.to_flat_state(state) if p[-1] == "kernel"]
        assert all(w.dtype == jnp.bfloat16 for w in packed)
        assert all(w.ndim == (3 if mode == "on" else 2) for w in packed)
        cache = init_cache(cfg, 3, 40)
        logits, cache = prefill((graphdef, state), cache, prompt, jnp.zeros(3, jnp.int32), jnp.full(3, 9, jnp.int32))
        out = generate((graphdef, state), cache, logits, jnp.full(3, 9, jnp.int32), jnp.ones(3, bool),
                       jax.random.split(jax.random.key(0), 3), SamplingConfig.greedy(), jnp.asarray([-1], jnp.int32),
                       jnp.zeros((0, 0), jnp.int32), 12)
        outs[mode] = (np.asarray(logits), np.asarray(out.tokens), np.asarray(out.logprobs))
    np.testing.assert_allclose(outs["on"][0], outs["off"][0], atol=1e-4)
    np.testing.assert_array_equal(outs["on"][1], outs["off"][1])
    # Summation order differs (float32 both ways); where an activation then lies on a bfloat16
    # rounding boundary the next matmul sees it one bfloat16 step apart: log-probs within 2e-2.
    np.testing.assert_allclose(outs["on"][2], outs["off"][2], atol=2e-2)
    np.testing.assert_allclose(np.median(np.abs(outs["on"][2] - outs["off"][2])), 0.0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_greedy_decode_and_logits_agree_with_the_xla_forms(tied):
    """Same seeded weights, prompts and cache: with the kernels (cache attention; packed weights for the
    projections and, tied or not, the logits) decode gives XLA's tokens, log-probs and cache."""
    prompt = jnp.asarray(np.random.RandomState(5).randint(0, 96, (3, 9)), jnp.int32)
    outs = {}
    for mode in ("on", "off"):
        cfg, model = _tiny(mode, tied)
        cache = init_cache(cfg, 3, 40)
        start = jnp.zeros(3, jnp.int32)
        logits, cache = prefill(model, cache, prompt, start, jnp.array([9, 5, 7], jnp.int32))
        out = generate(model, cache, logits, jnp.array([9, 5, 7], jnp.int32), jnp.ones(3, bool),
                       jax.random.split(jax.random.key(0), 3), SamplingConfig.greedy(), jnp.array([-1], jnp.int32),
                       jnp.zeros((0, 0), jnp.int32), 24)
        outs[mode] = (np.asarray(logits), np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(out.cache.k))
    np.testing.assert_allclose(outs["on"][0], outs["off"][0], atol=1e-5)
    np.testing.assert_array_equal(outs["on"][1], outs["off"][1])
    np.testing.assert_allclose(outs["on"][2], outs["off"][2], atol=1e-4)
    np.testing.assert_allclose(outs["on"][3], outs["off"][3], atol=1e-4)


def test_packing_applies_where_the_kernels_run():
    from ragen_jax.models.decoder import pack_for_decode

    def packed(model):
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, pack_for_decode(graphdef, state))

    model = packed(_tiny("on", tied=True)[1])
    assert model.embed_tokens.embedding[...].shape == (96 // 32, 64, 32)
    assert model.layers[0].mlp.up_proj.kernel[...].shape == (128 // 32, 64, 32)
    # A width that is not a multiple of 32 keeps XLA's matmul; 'off' packs nothing.
    assert packed(_tiny("on", tied=True, vocab=97)[1]).embed_tokens.embedding[...].ndim == 2
    graphdef, state = nnx.split(_tiny("off", tied=True)[1])
    assert pack_for_decode(graphdef, state) is state


def test_modes_and_errors():
    with pytest.raises(ValueError, match="cpu_kernels must be 'auto', 'on' or 'off'"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, cpu_kernels="fast")
    assert ca.kernels_apply("on", jnp.float32) and ca.kernels_apply("auto", jnp.float32)
    assert not ca.kernels_apply("off", jnp.float32) and not ca.kernels_apply("auto", jnp.bfloat16)
    with pytest.raises(ValueError, match="needs float32 computation"):
        ca.kernels_apply("on", jnp.bfloat16)
