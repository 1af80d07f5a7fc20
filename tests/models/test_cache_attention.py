"""The CPU cache-attention kernel (models/cache_attention.py) against a NumPy re-derivation of
attention over a KV cache, its gradient against a plain masked softmax, and the decode it serves."""
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import cache_attention as ca
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
                          64, 16, "kernel")


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
    got = np.asarray(_cached_attend(jnp.asarray(q), bits, 1, jnp.asarray(positions), 64, 16, "kernel"))
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


def _tiny(mode, seed=0):
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, initializer_range=0.2, cache_attention=mode, cache_block_size=16)
    return cfg, Decoder(cfg, rngs=nnx.Rngs(seed))


def test_greedy_decode_and_logits_agree_with_the_xla_form():
    """Same seeded weights, prompts and cache: the kernel's decode gives the XLA form's tokens and logits."""
    prompt = jnp.asarray(np.random.RandomState(5).randint(0, 97, (3, 9)), jnp.int32)
    outs = {}
    for mode in ("kernel", "xla"):
        cfg, model = _tiny(mode)
        cache = init_cache(cfg, 3, 40)
        start = jnp.zeros(3, jnp.int32)
        logits, cache = prefill(model, cache, prompt, start, jnp.array([9, 5, 7], jnp.int32))
        out = generate(model, cache, logits, jnp.array([9, 5, 7], jnp.int32), jnp.ones(3, bool),
                       jax.random.split(jax.random.key(0), 3), SamplingConfig.greedy(), jnp.array([-1], jnp.int32),
                       jnp.zeros((0, 0), jnp.int32), 24)
        outs[mode] = (np.asarray(logits), np.asarray(out.tokens), np.asarray(out.logprobs))
    np.testing.assert_allclose(outs["kernel"][0], outs["xla"][0], atol=1e-5)
    np.testing.assert_array_equal(outs["kernel"][1], outs["xla"][1])
    np.testing.assert_allclose(outs["kernel"][2], outs["xla"][2], atol=1e-4)


def test_modes_and_errors():
    with pytest.raises(ValueError, match="cache_attention must be 'auto', 'kernel' or 'xla'"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, cache_attention="fast")
    q32, q16 = jnp.zeros((1, 1, 2, 8), jnp.float32), jnp.zeros((1, 1, 2, 8), jnp.bfloat16)
    assert ca.kernel_applies("kernel", q32) and ca.kernel_applies("auto", q32)
    assert not ca.kernel_applies("xla", q32) and not ca.kernel_applies("auto", q16)
    with pytest.raises(ValueError, match="needs float32 compute"):
        ca.kernel_applies("kernel", q16)
