"""Decoder parity against PyTorch transformers (fp32), and KV-cache semantics.

All models are tiny and randomly initialised from fixed seeds (torch.manual_seed / nnx.Rngs), so every
run sees the same weights and tokens.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Critic, Decoder, ModelConfig, ValueHead, init_cache
from ragen_jax.models.kv_cache import SharedPrefix, broadcast_cache
from ragen_jax.models.loading import from_hf_state_dict
from tests.models import torch_reference as ref

ATOL = 1e-4


def _ours(torch_model, **overrides):
    cfg = ModelConfig.from_hf_config(ref.hf_config_dict(torch_model), **overrides)
    return cfg, from_hf_state_dict(cfg, ref.state_dict_numpy(torch_model))


def _jitted(model):
    """model(tokens, positions, cache) compiled once per shape (eager dispatch is slow on a busy CPU)."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(tokens, positions, cache))
    return lambda tokens, positions, cache=None: fn(state, jnp.asarray(tokens), jnp.asarray(positions), cache)


def _tokens(batch, seq, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int32)


def _arange(batch, seq, start=0):
    return np.broadcast_to(np.arange(start, start + seq, dtype=np.int32), (batch, seq)).copy()


@pytest.fixture(scope="module")
def qwen2():
    return ref.tiny_qwen2(seed=0)


@pytest.fixture(scope="module")
def llama():
    return ref.tiny_llama(seed=1)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_logits_match_transformers(family, scan_layers, qwen2, llama):
    torch_model = qwen2 if family == "qwen2" else llama
    cfg, model = _ours(torch_model, scan_layers=scan_layers)
    assert cfg.qkv_bias == (family == "qwen2") and cfg.tie_word_embeddings == (family == "llama")
    tokens = _tokens(2, 11, cfg.vocab_size, seed=3)
    positions = _arange(2, 11)
    logits, cache = _jitted(model)(tokens, positions)
    assert cache is None and logits.dtype == jnp.float32 and logits.shape == (2, 11, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), ref.torch_logits(torch_model, tokens), atol=ATOL, rtol=0)


def test_positions_drive_rope_without_cache(qwen2):
    """Without a cache, positions shift RoPE exactly as HF position_ids do (here per row)."""
    cfg, model = _ours(qwen2)
    tokens = _tokens(2, 7, cfg.vocab_size, seed=4)
    positions = np.stack([np.arange(5, 12), np.arange(40, 47)]).astype(np.int32)
    logits, _ = _jitted(model)(tokens, positions)
    np.testing.assert_allclose(np.asarray(logits), ref.torch_logits(qwen2, tokens, positions), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama_untied_attention_bias", "llama3_rope", "linear_rope"])
def test_llama_variants(variant):
    overrides = {
        "llama_untied_attention_bias": dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
        "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    }[variant]
    torch_model = ref.tiny_llama(seed=2, **overrides)
    cfg, model = _ours(torch_model)
    tokens = _tokens(2, 9, cfg.vocab_size, seed=5)
    positions = _arange(2, 9, start=60)  # long wavelengths matter only at larger positions
    logits, _ = _jitted(model)(tokens, positions)
    np.testing.assert_allclose(np.asarray(logits), ref.torch_logits(torch_model, tokens, positions),
                               atol=ATOL, rtol=0)


def _greedy(model, prompt, new_tokens, max_len):
    """Greedy decode with the cache: prefill the prompt, then one token per jitted step."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tokens, positions):
        logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    B, P = prompt.shape
    cache = init_cache(model.cfg, B, max_len, jnp.float32)
    nxt, cache = step(state, cache, jnp.asarray(prompt), jnp.asarray(_arange(B, P)))
    out = [nxt]
    for t in range(P, P + new_tokens - 1):
        nxt, cache = step(state, cache, nxt[:, None], jnp.full((B, 1), t, jnp.int32))
        out.append(nxt)
    return np.stack([np.asarray(o) for o in out], axis=1)


@pytest.mark.parametrize("family,cache_block", [("qwen2", 0), ("llama", 0), ("qwen2", 16)])
def test_greedy_decode_matches_transformers(family, cache_block, qwen2, llama):
    torch_model = qwen2 if family == "qwen2" else llama
    cfg, model = _ours(torch_model, cache_block_size=cache_block)
    prompt = _tokens(2, 6, cfg.vocab_size, seed=6)
    ours = _greedy(model, prompt, 32, max_len=48)
    np.testing.assert_array_equal(ours, ref.torch_greedy(torch_model, prompt, 32))


@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_token_by_token_cache_equals_full_recompute(qwen2, scan_layers):
    cfg, model = _ours(qwen2, scan_layers=scan_layers)
    tokens = _tokens(3, 10, cfg.vocab_size, seed=7)
    fwd = _jitted(model)
    full, _ = fwd(tokens, _arange(3, 10))
    cache = init_cache(cfg, 3, 16)
    steps = []
    for t in range(10):
        logits, cache = fwd(tokens[:, t:t + 1], np.full((3, 1), t, np.int32), cache)
        steps.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.stack(steps, axis=1), np.asarray(full), atol=ATOL, rtol=0)


@pytest.mark.parametrize("block", [0, 4, 5])
def test_blocked_causal_attention_matches_transformers(block, qwen2):
    """Query blocks that skip the score blocks above the diagonal (4 and 5 split 13 tokens
    unevenly; 0 = one masked softmax) give the transformers model's logits."""
    cfg, model = _ours(qwen2, attention_block_size=block)
    tokens = _tokens(2, 13, cfg.vocab_size, seed=4)
    logits, _ = _jitted(model)(tokens, _arange(2, 13))
    np.testing.assert_allclose(np.asarray(logits), ref.torch_logits(qwen2, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_shared_prefix_continuation_matches_transformers(llama, scan_layers):
    """A prompt run once (one row) and continued by every row gives each whole row's logits."""
    cfg, model = _ours(llama, scan_layers=scan_layers, attention_block_size=4)
    tokens = _tokens(3, 15, cfg.vocab_size, seed=5)
    tokens[:, :6] = tokens[0, :6]
    expected = ref.torch_logits(llama, tokens)
    h_pre, prefix = model.encode_prefix(jnp.asarray(tokens[:1, :6]))
    assert isinstance(prefix, SharedPrefix) and prefix.length == 6 and prefix.k.shape[1] == 1
    hidden, out = model.hidden(jnp.asarray(tokens[:, 6:]), jnp.asarray(_arange(3, 9, start=6)), prefix)
    for a, b in zip(out, prefix):  # read-only: comes back unchanged
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(model.logits(h_pre)), expected[:1, :6], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), expected[:, 6:], atol=ATOL, rtol=0)
    two_rows = SharedPrefix(*(jnp.concatenate([x, x], axis=1) for x in prefix))
    with pytest.raises(ValueError, match="cannot serve 3 rows"):
        model.hidden(jnp.asarray(tokens[:, 6:]), jnp.asarray(_arange(3, 9, start=6)), two_rows)


@pytest.mark.parametrize("scan_layers,slots,cache_block", [(False, 32, 0), (False, 32, 8), (False, 13, 5),
                                                           pytest.param(True, 32, 0, marks=pytest.mark.slow)])
def test_ragged_chunked_prefill_equals_full_recompute(llama, scan_layers, slots, cache_block):
    """Fixed-size chunks written at per-row positions with per-row valid lengths; the padding of
    each chunk is garbage that the next chunk overwrites. Every real token's logits must equal the
    PyTorch model run on that row's real tokens alone. ``cache_block`` > 0 reads the cache in blocks
    up to the furthest position (positions reach 11: 8 of 32 slots leaves two blocks unread; 5 of 13
    slots ends with a block at slot 8, overlapping the one before); 0 = one pass over every slot."""
    cfg, model = _ours(llama, scan_layers=scan_layers, cache_block_size=cache_block)
    rng = np.random.default_rng(8)
    B, C, chunks = 3, 5, 3
    valid = np.array([[5, 2, 4], [1, 5, 3], [3, 3, 1]])  # [B, chunks] valid tokens per chunk
    real = [rng.integers(0, cfg.vocab_size, size=valid[b].sum()).astype(np.int32) for b in range(B)]
    fwd = _jitted(model)
    cache = init_cache(cfg, B, slots)
    start = np.zeros(B, np.int32)
    got = [[] for _ in range(B)]
    for c in range(chunks):
        chunk = rng.integers(0, cfg.vocab_size, size=(B, C)).astype(np.int32)  # padding = garbage
        for b in range(B):
            offset = valid[b, :c].sum()
            chunk[b, :valid[b, c]] = real[b][offset:offset + valid[b, c]]
        positions = start[:, None] + np.arange(C, dtype=np.int32)
        logits, cache = fwd(chunk, positions, cache)
        for b in range(B):
            got[b].append(np.asarray(logits[b, :valid[b, c]]))
        start = start + valid[:, c]
    for b in range(B):
        expected = ref.torch_logits(llama, real[b][None])[0]
        np.testing.assert_allclose(np.concatenate(got[b]), expected, atol=ATOL, rtol=0)


def test_cache_slots_hold_rope_keys_and_drop_out_of_range():
    """Slot p of layer 0 holds RoPE(k_proj(norm(embed(token)))) of the token at position p, written
    by a NumPy re-derivation; a position past the end (and a negative one) is dropped."""
    cfg = ModelConfig(vocab_size=13, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, model_type="llama")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = np.array([[3, 5, 7]], np.int32)
    positions = np.array([[1, 6, -1]], np.int32)
    _, cache = _jitted(model)(tokens, positions, init_cache(cfg, 1, 4))

    emb = np.asarray(model.embed_tokens.embedding[...])[3]
    scale = np.asarray(model.layers[0].input_layernorm.scale[...])
    x = emb / np.sqrt(np.mean(emb ** 2) + cfg.rms_norm_eps) * scale
    k = x @ np.asarray(model.layers[0].self_attn.k_proj.kernel[...])  # [Hd]
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, 4, 2) / 4)
    ang = np.concatenate([inv_freq, inv_freq]) * 1  # position 1
    k_rot = k * np.cos(ang) + np.concatenate([-k[2:], k[:2]]) * np.sin(ang)
    ck = np.asarray(cache.k)
    np.testing.assert_allclose(ck[0, 0, 0, 1], k_rot, atol=1e-5)  # [layer, row, kv head, slot]
    for slot in (0, 2, 3):  # position 6 >= max_len and -1 were dropped, not wrapped
        np.testing.assert_array_equal(ck[0, 0, :, slot], 0.0)

    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(jnp.asarray(tokens[0]), jnp.asarray(positions[0]))
    with pytest.raises(ValueError, match="integer"):
        model(jnp.asarray(tokens, jnp.float32), jnp.asarray(positions))
    with pytest.raises(ValueError, match="init_cache"):
        model(jnp.asarray(tokens), jnp.asarray(positions), init_cache(cfg.replace(num_layers=2), 1, 4))

    # A prompt prefilled once serves several rows: every row sees the same slots.
    shared = broadcast_cache(cache, 3)
    assert shared.k.shape == (1, 3, 1, 4, 4)
    for row in range(3):
        np.testing.assert_array_equal(np.asarray(shared.k[0, row]), ck[0, 0])
    with pytest.raises(ValueError, match="one-row cache"):
        broadcast_cache(shared, 2)


@pytest.mark.parametrize("dtype,bits", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_write_layer_scatters_rows_into_their_slots_like_numpy(dtype, bits):
    """``write_layer`` (jitted; a bfloat16 cache is written through its uint16 bits, or held as bits
    with ``as_bits`` as ``generate`` holds it) equals NumPy assignment of the values rounded to the
    cache dtype: each row's tokens land in its own slots of the chosen layer, positions past the end
    and negative ones are dropped, nothing else changes."""
    import ml_dtypes

    from ragen_jax.models.kv_cache import as_bits, from_bits, write_layer

    cfg = ModelConfig(vocab_size=13, hidden_size=8, intermediate_size=16, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=4, kv_cache_dtype=dtype)
    rng = np.random.default_rng(7)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    k0 = rng.normal(size=(3, 2, 2, 5, 4)).astype(np_dtype)  # [L, B, K, S, Hd]
    v0 = rng.normal(size=(3, 2, 2, 5, 4)).astype(np_dtype)
    cache = init_cache(cfg, 2, 5)._replace(k=jnp.asarray(k0), v=jnp.asarray(v0))
    positions = np.array([[4, 0, 7], [-1, 2, 3]], np.int32)
    k_new = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)  # [B, T, K, Hd]
    v_new = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
    if bits:
        cache = as_bits(cache)
        assert cache.k.dtype == jnp.uint16
    out = jax.jit(write_layer, static_argnums=1)(cache, 1, jnp.asarray(positions), jnp.asarray(k_new),
                                                 jnp.asarray(v_new))
    if bits:
        assert out.k.dtype == jnp.uint16
        out = from_bits(out)
    assert out.k.dtype == jnp.dtype(dtype) and out.v.dtype == jnp.dtype(dtype)
    want_k, want_v = k0.copy(), v0.copy()
    for b in range(2):
        for t in range(3):
            if 0 <= positions[b, t] < 5:
                want_k[1, b, :, positions[b, t]] = k_new[b, t].astype(np_dtype)
                want_v[1, b, :, positions[b, t]] = v_new[b, t].astype(np_dtype)
    np.testing.assert_array_equal(np.asarray(out.k).astype(np.float32), want_k.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(out.v).astype(np.float32), want_v.astype(np.float32))


def test_scan_and_loop_agree_from_same_rngs():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, model_type="qwen2", qkv_bias=True)
    loop = Decoder(cfg, rngs=nnx.Rngs(7))
    scan = Decoder(cfg.replace(scan_layers=True), rngs=nnx.Rngs(7))
    np.testing.assert_array_equal(np.asarray(scan.layers.mlp.up_proj.kernel[...][1]),
                                  np.asarray(loop.layers[1].mlp.up_proj.kernel[...]))
    tokens = _tokens(2, 6, 50, seed=9)
    a, ca = _jitted(loop)(tokens, _arange(2, 6), init_cache(cfg, 2, 8))
    b, cb = _jitted(scan)(tokens, _arange(2, 6), init_cache(cfg, 2, 8))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ca.k), np.asarray(cb.k), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_remat_gives_same_gradients(scan_layers):
    cfg = ModelConfig(vocab_size=30, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, model_type="llama", scan_layers=scan_layers)
    tokens, positions = jnp.asarray(_tokens(2, 5, 30, seed=10)), jnp.asarray(_arange(2, 5))

    def grads(c):
        graphdef, state = nnx.split(Decoder(c, rngs=nnx.Rngs(0)))
        loss = lambda st: jnp.mean(nnx.merge(graphdef, st)(tokens, positions)[0] ** 2)
        return jax.jit(jax.grad(loss))(state)

    g0, g1 = grads(cfg), grads(cfg.replace(remat=True))
    for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_bf16_compute_keeps_float32_logits(qwen2):
    cfg, model32 = _ours(qwen2)
    _, model16 = _ours(qwen2, dtype="bfloat16", param_dtype="bfloat16")
    assert model16.embed_tokens.embedding[...].dtype == jnp.bfloat16
    tokens, positions = _tokens(2, 8, cfg.vocab_size, seed=11), _arange(2, 8)
    l32, _ = _jitted(model32)(tokens, positions)
    l16, cache = _jitted(model16)(tokens, positions, init_cache(model16.cfg, 2, 8))
    assert l16.dtype == jnp.float32 and cache.k.dtype == jnp.bfloat16
    # bf16 has an 8-bit mantissa: logits of size ~1 agree to a few 1e-2, not better.
    assert float(jnp.max(jnp.abs(l16 - l32))) < 0.1
    assert float(jnp.max(jnp.abs(l32))) > 0.1  # the comparison is not vacuous


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_bfloat16_matmuls_match_transformers_with_rounded_operands(family, qwen2, llama):
    """``matmul_dtype='bfloat16'`` (float32 compute, bf16 weights): logits equal a float32 transformers
    model whose parameters and Linear inputs are rounded to bfloat16 (``ref.bf16_matmul_copy``), whole
    sequence and token by token through the cache, and differ from the unrounded model by far more."""
    torch_model = qwen2 if family == "qwen2" else llama
    cfg, model = _ours(torch_model, param_dtype="bfloat16", matmul_dtype="bfloat16")
    assert cfg.compute_dtype == jnp.float32 and cfg.matmul_operand_dtype == jnp.bfloat16
    tokens, positions = _tokens(2, 9, cfg.vocab_size, seed=5), _arange(2, 9)
    mixed_ref = ref.torch_logits(ref.bf16_matmul_copy(torch_model), tokens)
    exact_ref = ref.torch_logits(torch_model, tokens)
    run = _jitted(model)
    whole, _ = run(tokens, positions)
    cache, steps = init_cache(cfg, 2, 9), []
    assert cache.k.dtype == jnp.float32  # the cache follows the compute dtype, not the matmuls'
    for t in range(9):
        logits, cache = run(tokens[:, t:t + 1], positions[:, t:t + 1], cache)
        steps.append(logits)
    for ours in (np.asarray(whole), np.concatenate([np.asarray(x) for x in steps], axis=1)):
        assert ours.dtype == np.float32
        # Rounding to bf16 at the matmul inputs can flip one ulp where the two sides' float32
        # activations straddle a rounding boundary (seen: 1e-4 at most, 1e-7 typical).
        err = np.abs(ours - mixed_ref).max()
        assert err < 3e-4, err
        # The rounding really happens: the unrounded model is ~2.5e-3 or more away.
        assert np.abs(ours - exact_ref).max() > 5 * max(err, 3e-4)


def test_value_head_and_critic(qwen2):
    """hidden equals HF's final-normed last_hidden_state; values = hidden @ w + b (NumPy)."""
    cfg, model = _ours(qwen2)
    tokens = _tokens(2, 6, cfg.vocab_size, seed=12)
    graphdef, state = nnx.split(model)
    hidden, _ = jax.jit(lambda s, t, p: nnx.merge(graphdef, s).hidden(t, p))(state, tokens, _arange(2, 6))
    import torch
    with torch.no_grad():
        expected = qwen2.model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(hidden), expected, atol=ATOL, rtol=0)

    head = ValueHead(cfg, rngs=nnx.Rngs(1))
    w, b = np.asarray(head.score.kernel[...]), np.asarray(head.score.bias[...])
    np.testing.assert_allclose(np.asarray(head(hidden)), expected @ w[:, 0] + b[0], atol=1e-5)

    critic = Critic(cfg.replace(num_layers=1), rngs=nnx.Rngs(2))
    values, _ = _jitted(critic)(tokens, _arange(2, 6))
    graphdef, state = nnx.split(critic.trunk)
    h2, _ = jax.jit(lambda s, t, p: nnx.merge(graphdef, s).hidden(t, p))(state, tokens, _arange(2, 6))
    w2, b2 = np.asarray(critic.value_head.score.kernel[...]), np.asarray(critic.value_head.score.bias[...])
    assert values.shape == (2, 6) and values.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(values), np.asarray(h2) @ w2[:, 0] + b2[0], atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "yarn"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_configs_fail_clearly(change, message, qwen2):
    config = {**ref.hf_config_dict(qwen2), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(config)


def test_config_errors():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(**base)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(**{**base, "num_heads": 2, "dtype": "float16"})
    with pytest.raises(ValueError, match="matmul_dtype='float32' is wider than dtype='bfloat16'"):
        ModelConfig(**{**base, "num_heads": 2, "dtype": "bfloat16", "matmul_dtype": "float32"})
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig(**{**base, "num_heads": 2}).replace(scan=True)


def test_config_reads_legacy_rope_keys():
    """Older config.json files (transformers 4) carry rope_theta / rope_scaling at the top level."""
    legacy = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = ModelConfig.from_hf_config(legacy)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4
    hash(cfg)  # static under jit


def test_separate_critic_has_no_lm_head_and_starts_from_the_policy():
    """Untied embeddings: the critic's trunk holds every policy weight but the [D, V] LM head, and
    ``init_trunk_from`` copies them exactly, so its hidden states are the policy's."""
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
    policy = Decoder(cfg, rngs=nnx.Rngs(0))
    critic = Critic(cfg, rngs=nnx.Rngs(1))
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert "lm_head" not in nnx.state(critic.trunk, nnx.Param)
    assert count(policy) - count(critic.trunk) == cfg.hidden_size * cfg.vocab_size
    with pytest.raises(ValueError, match="lm_head=False"):
        critic.trunk.logits(jnp.zeros((1, 1, cfg.hidden_size)))
    critic.init_trunk_from(policy)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    positions = np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5))
    h_policy, _ = policy.hidden(jnp.asarray(tokens), jnp.asarray(positions))
    h_critic, _ = critic.trunk.hidden(jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_array_equal(np.asarray(h_policy), np.asarray(h_critic))
