"""Sharded forward / decode on 8 simulated CPU devices, checked against the unsharded model.

Run by tests/models/test_sharding.py in its own process: the device count must be set before jax
is imported. Exits non-zero (an AssertionError with its message) on the first mismatch; prints one
line per passed check. Seeds are fixed, so every run uses the same weights and tokens.
"""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ragen_jax.models.config import ModelConfig  # noqa: E402
from ragen_jax.models.decoder import Decoder  # noqa: E402
from ragen_jax.models.kv_cache import init_cache  # noqa: E402
from ragen_jax.models.sampler import SamplingConfig, generate, prefill  # noqa: E402
from ragen_jax.models.sharding import (  # noqa: E402
    batch_sharding,
    cache_shardings,
    constrain_activations,
    make_mesh,
    param_shardings,
    shard_params,
    sharding_fn,
)

BATCH, CHUNK, NEW = 8, 6, 5


def tiny(scan_layers: bool, tie: bool):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, qkv_bias=True, initializer_range=0.3, tie_word_embeddings=tie,
                      scan_layers=scan_layers, model_type="qwen2")
    return cfg, Decoder(cfg, rngs=nnx.Rngs(0))


def expected_spec(name: str, ndim: int):
    """The layout written out by hand for a (2, 2, 2) mesh and the tiny shapes (all divisible)."""
    table = [
        ("embed_tokens/embedding", ("tensor", "fsdp")),
        ("_proj/bias", ("tensor",)),
        ("o_proj/kernel", ("tensor", "fsdp")),
        ("down_proj/kernel", ("tensor", "fsdp")),
        ("_proj/kernel", ("fsdp", "tensor")),
        ("lm_head/kernel", ("fsdp", "tensor")),
        ("scale", (None,)),
    ]
    for key, spec in table:
        if key in name:
            return P(*((None,) * (ndim - len(spec)) + spec))
    raise AssertionError(f"no expected layout written for {name}")


def check_params_sharded(state, cfg):
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    assert flat, "model has no parameters"
    for path, x in flat:
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        assert isinstance(x.sharding, NamedSharding), name
        want = expected_spec(name, x.ndim)
        got = x.sharding.spec
        assert tuple(got) + (None,) * (x.ndim - len(got)) == tuple(want), f"{name}: {got} != {want}"
        # Really split: a sharded dim holds a fraction of the array on each device.
        shard = x.addressable_shards[0].data.shape
        for dim, axis in zip(range(x.ndim), tuple(want)):
            if axis is not None:
                assert shard[dim] == x.shape[dim] // 2, f"{name}: shard {shard} of {x.shape}"
    return len(flat)


def run(scan_layers: bool, tie: bool):
    cfg, model = tiny(scan_layers, tie)
    graphdef, state = nnx.split(model)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}

    sharded_state = shard_params(state, mesh)
    n = check_params_sharded(sharded_state, cfg)
    # The loader's per-tensor callable gives the same layout.
    fn = sharding_fn(mesh)
    assert fn("layers.0.self_attn.q_proj.kernel", (32, 32)).spec == P("fsdp", "tensor")
    assert fn(("layers", "self_attn", "o_proj", "kernel"), (2, 32, 32)).spec == P(None, "tensor", "fsdp")

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (BATCH, CHUNK)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(CHUNK, dtype=jnp.int32), (BATCH, CHUNK))

    def forward(params, tokens, positions):
        return nnx.merge(graphdef, params)(tokens, positions)[0]

    forward = jax.jit(forward)
    ref = np.asarray(forward(state, tokens, positions))
    tok_s, pos_s = jax.device_put((tokens, positions), batch_sharding((tokens, positions), mesh))
    out = forward(sharded_state, tok_s, pos_s)
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)

    # Prefill + generate (greedy and sampled) with sharded weights, cache, inputs.
    lengths = jnp.asarray(rng.integers(1, CHUNK + 1, BATCH), jnp.int32)
    keys = jax.random.split(jax.random.key(0), BATCH)
    stop_ids = jnp.array([3], jnp.int32)
    seqs = jnp.array([[5, 9]], jnp.int32)

    def decode(params, cache, tokens, lengths, keys, sampling):
        start = jnp.zeros(BATCH, jnp.int32)
        logits, cache = prefill((graphdef, params), cache, tokens, start, lengths)
        out = generate((graphdef, params), cache, logits, start + lengths, jnp.ones(BATCH, bool), keys, sampling,
                       stop_ids, seqs, NEW)
        return out.tokens, out.logprobs, out.lengths, out.cache.k

    cache = init_cache(cfg, BATCH, 16)
    cache_s = jax.device_put(cache, cache_shardings(cache, mesh))
    assert cache_s.k.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None), cache_s.k.sharding.spec
    lengths_s, keys_s = jax.device_put((lengths, keys), batch_sharding((lengths, keys), mesh))
    decode = jax.jit(decode)  # one compilation per placement: the sampling values are traced
    for sampling in (SamplingConfig.greedy(), SamplingConfig.create(1.0), SamplingConfig.create(0.8, 10, 0.9)):
        want = decode(state, cache, tokens, lengths, keys, sampling)
        got = decode(sharded_state, cache_s, tok_s, lengths_s, keys_s, sampling)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
        np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), atol=2e-5)
        assert len(got[3].sharding.device_set) == 8
    print(f"ok scan_layers={scan_layers} tie={tie}: {n} params sharded, forward and decode match")


def check_activation_constraint():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    x = jnp.ones((BATCH, 3, 4))
    assert constrain_activations(x) is x  # no mesh set: untouched

    @jax.jit
    def f(x):
        return constrain_activations(x * 2)

    with jax.set_mesh(mesh):
        y = f(x)
    assert y.sharding.spec[0] == ("data", "fsdp"), y.sharding.spec
    assert y.addressable_shards[0].data.shape == (2, 3, 4)
    # A batch that the 4 batch shards do not divide falls back to what divides it (here: 'data').
    z = jax.jit(lambda x: constrain_activations(x, mesh))(jnp.ones((2, 3)))
    assert z.sharding.spec[0] == "data", z.sharding.spec
    # Rules applied to an abstract state (what a loader builds with nnx.eval_shape).
    cfg, _ = tiny(False, False)
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    shardings = param_shardings(abstract, mesh)
    flat = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    assert flat and all(isinstance(s, NamedSharding) for s in flat)
    print("ok activation constraint and abstract-state shardings")


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    # Default: the looped-layer model. --scan: stacked layers (leading [L] axis) with tied embeddings.
    if "--scan" in sys.argv:
        run(scan_layers=True, tie=True)
    else:
        check_activation_constraint()
        run(scan_layers=False, tie=False)
    sys.exit(0)
