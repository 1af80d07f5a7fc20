"""Placement (one process): shardings by the partition rules, put / fetch, the mesh config, the
float32 optimizer state, and the memory planner (8 simulated devices, in a subprocess)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import frozen_lake
from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.placement import single_device
from ragen_jax.config import StarPOConfig
from ragen_jax.starpo.update import in_float32, init_train_state
from ragen_jax.config import ConfigError, resolve

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2")


def _state():
    return init_train_state(Decoder(CFG, rngs=nnx.Rngs(0)), StarPOConfig(adv_estimator="grpo"),
                            key=jax.random.key(0))[1]


def test_optimizer_moments_are_sharded_like_their_parameters():
    placement = single_device()  # axes of size 1 keep their names in the specs
    shardings = placement.state_shardings(_state())
    flat = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    q = [k for k in flat if "q_proj" in k and "kernel" in k]
    assert len(q) == 3 * CFG.num_layers, q  # the parameter and its two AdamW moments, per layer
    assert all(flat[k] == P("fsdp", "tensor") for k in q), {k: flat[k] for k in q}
    down = [k for k in flat if "down_proj" in k]
    assert down and all(flat[k] == P("tensor", "fsdp") for k in down)
    counters = [k for k in flat if k.endswith(("step", "optimizer_steps", ".count", "key"))]
    assert counters and all(flat[k] == P() for k in counters), counters


def test_put_and_fetch_round_trip_arrays_keys_and_none():
    placement = single_device()
    tree = {"x": np.arange(12.0).reshape(4, 3), "k": jax.random.key(7), "none": None}
    placed = placement.put_batch(tree)
    assert placed["none"] is None and isinstance(placed["x"], jax.Array)
    assert jax.dtypes.issubdtype(placed["k"].dtype, jax.dtypes.prng_key)
    back = placement.fetch(placed)
    np.testing.assert_array_equal(back["x"], tree["x"])
    # The key survives the trip: the same random numbers as the original key.
    np.testing.assert_array_equal(jax.random.uniform(placed["k"], (3,)), jax.random.uniform(tree["k"], (3,)))
    assert placement.broadcast(5) == 5 and placement.is_main


def test_unmatched_parameter_is_an_error_under_strict():
    placement = single_device()
    with pytest.raises(ValueError, match="no partition rule matches parameter 'mystery/kernel'"):
        placement.state_shardings({"mystery": {"kernel": jnp.zeros((2, 2))}}, strict=True)


@pytest.mark.parametrize("mesh, expected", [
    (dict(data=0), "mesh.data=0 must be an int >= 1, or -1"),
    (dict(data=-1, fsdp=-1), "at most one mesh axis may be -1"),
    (dict(tenser=2), "did you mean mesh.tensor"),
])
def test_bad_mesh_config_is_refused(mesh, expected):
    cfg = frozen_lake.get_config()
    with cfg.unlocked():
        for k, v in mesh.items():
            cfg.mesh[k] = v
    with pytest.raises(ConfigError, match=expected):
        resolve(cfg)


def test_mesh_larger_than_the_devices_names_the_fix():
    from ragen_jax.training.run import make_placement

    cfg = frozen_lake.get_config()
    cfg.mesh.fsdp = 2 * jax.device_count()
    cfg.mesh.data = 1
    with pytest.raises(ConfigError, match="does not fit the .* set --config.mesh.data/fsdp/tensor|needs .* devices"):
        make_placement(resolve(cfg))


def test_float32_optimizer_state_under_bfloat16_parameters():
    """AdamW's first step by hand (NumPy, float64): m = (1-b1) g, v = (1-b2) g², so the update is
    -lr (g / (|g| + eps) + wd p) — computed in float32 and only then rounded to the weights' bf16."""
    params = {"w": jnp.asarray([[0.5, -1.25], [2.0, 0.75]], jnp.bfloat16)}
    grads = {"w": jnp.asarray([[0.1, -0.3], [0.02, 0.0]], jnp.bfloat16)}
    lr, wd, eps = 1e-2, 0.1, 1e-8
    tx = in_float32(optax.adamw(lr, b1=0.9, b2=0.999, eps=eps, weight_decay=wd))
    state = tx.init(params)
    assert state[0].mu["w"].dtype == jnp.float32 and state[0].nu["w"].dtype == jnp.float32
    updates, state = tx.update(grads, state, params)
    assert updates["w"].dtype == jnp.bfloat16
    g, p = np.asarray(grads["w"], np.float64), np.asarray(params["w"], np.float64)
    expected = -lr * (g / (np.abs(g) + eps) + wd * p)
    np.testing.assert_allclose(np.asarray(updates["w"], np.float64),
                               np.asarray(jnp.asarray(expected, jnp.bfloat16), np.float64), rtol=0, atol=1e-7)
    # With float32 parameters the wrapper changes nothing, bit for bit.
    p32, g32 = jax.tree.map(lambda x: x.astype(jnp.float32), (params, grads))
    plain = optax.adamw(lr, eps=eps, weight_decay=wd)
    a = tx.update(g32, tx.init(p32), p32)[0]["w"]
    b = plain.update(g32, plain.init(p32), p32)[0]["w"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


PLAN_SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from configs import frozen_lake
from ragen_jax import plan
from ragen_jax.models.sharding import make_mesh
from ragen_jax.placement import Placement
from ragen_jax.config import resolve

c = frozen_lake.get_config()
c.rollout.update(dict(num_groups=2, group_size=4, max_turns=2, max_new_tokens=16, max_seq_len=400))
c.starpo.update(dict(adv_estimator="gae", critic="separate", mini_batch_size=4))
c.collapse.update(dict(num_samples=4, micro_batch_size=8))
c.mesh.update(dict(data=1, fsdp=8))
spec = resolve(c)
out = {"fsdp8": plan.plan(spec), "one": plan.plan(spec, Placement(make_mesh(1, 1, 1, devices=jax.devices()[:1])))}
print(plan.report(spec, out["fsdp8"]))
print("JSON" + json.dumps(out))
"""


def test_planner_fsdp_divides_parameters_and_optimizer_state():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    figures = json.loads(proc.stdout.split("JSON", 1)[1])
    eight, one = figures["fsdp8"], figures["one"]
    assert eight["devices"] == 8 and one["devices"] == 1
    for key in ("policy_params", "critic_params", "optimizer_states"):
        ratio = eight[key] / one[key]
        # Everything 2-D is split 8 ways; norm gains and biases (replicated) keep it a little above 1/8.
        assert 1 / 8 <= ratio < 0.16, (key, ratio)
    # AdamW: m and v per parameter, plus a few int32 step counters.
    assert 0 <= one["optimizer_states"] - 2 * (one["policy_params"] + one["critic_params"]) <= 64
    assert eight["peak"] < one["peak"]
    assert "A100/H100 80GB" in proc.stdout and "fits" in proc.stdout


MESH_WARNING_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
from flax import nnx
from configs import frozen_lake
from ragen_jax import plan
from ragen_jax.models import Decoder
from ragen_jax.models.sharding import make_mesh
from ragen_jax.config import resolve

spec = resolve(frozen_lake.get_config())
cfg = plan.model_config(spec)
params = nnx.state(jax.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)
out = {"arch": [cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size]}
for shape in [(1, 1, 3), (1, 1, 2), (1, 8, 1), (2, 2, 2)]:
    out[str(shape)] = plan.mesh_warnings(cfg, params, make_mesh(*shape, devices=jax.devices()[:shape[0] * shape[1] * shape[2]]))
print("JSON" + json.dumps(out))
"""


def test_planner_warns_when_the_mesh_asks_for_splits_the_model_cannot_take():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", MESH_WARNING_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("JSON", 1)[1])
    # The main job's model, worked by hand: 8 heads, 4 kv heads of width 8, D = 64, F = 192, V = 1028.
    assert out["arch"] == [8, 4, 64, 192, 1028]
    # tensor = 3 divides neither 64 (q/k/v columns, o rows), nor 8 heads: both said.
    three = out["(1, 1, 3)"]
    assert len(three) == 2 and three[0].startswith("mesh.tensor=3 does not divide") and "replicated" in three[0]
    assert "8 attention heads" in three[1] and "divides 4" in three[1]
    # Sizes that divide every split dimension and the heads: no warning.
    assert out["(1, 1, 2)"] == [] and out["(1, 8, 1)"] == [] and out["(2, 2, 2)"] == []
    # The report ends with them.
    figures = dict.fromkeys(["policy_params", "critic_params", "reference_params", "optimizer_states", "kv_cache",
                             "trajectory", "rollout_temporaries", "update_temporaries", "rollout_peak",
                             "update_peak", "peak", "num_parameters"], 1)
    figures.update(devices=3, mesh=dict(data=1, fsdp=1, tensor=3), warnings=three)
    from configs import frozen_lake
    from ragen_jax import plan
    from ragen_jax.config import resolve

    text = plan.report(resolve(frozen_lake.get_config()), figures)
    assert text.splitlines()[-2:] == [f"Warning: {w}." for w in three]


def test_the_accelerator_check_names_what_the_image_lacks(monkeypatch):
    """The offline installer asks ``--missing`` which runtime requirements to take from the wheel
    folder: nothing here (the test extra installs them all), and exactly a distribution that is absent."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import accelerator_check
    finally:
        sys.path.pop(0)
    from importlib import metadata

    assert accelerator_check.missing_requirements() == []
    real = metadata.version

    def without(name):
        if name in ("gguf", "ml-collections"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without)
    assert accelerator_check.missing_requirements() == ["ml-collections", "gguf"]


def test_create_initialises_in_shards_as_the_eager_constructor_does():
    """``Placement.create`` builds the module in one compiled program; its values are those of the
    eager constructor with the same seed (the reference: op-by-op, no placement), up to float rounding,
    and the seed's key enters that program as an argument (a constant key lets XLA's GPU compiler fold
    the random initialisers at compile time: minutes for a 0.5B model)."""
    from ragen_jax.models import Critic

    placement = single_device()
    for make, seed in ((lambda rngs: Decoder(CFG, rngs=rngs), 3), (lambda rngs: Critic(CFG, rngs=rngs), 5)):
        created = nnx.state(placement.create(make, seed=seed))
        eager = nnx.state(make(nnx.Rngs(seed)))
        a, b = jax.tree.leaves(created), jax.tree.leaves(eager)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6, atol=1e-6)
        # A different seed gives different weights: the key really reaches the initialisers.
        other = jax.tree.leaves(nnx.state(placement.create(make, seed=seed + 1)))
        assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, other))
    # The initialiser program's only input is the key, so nothing random is a compile-time constant.
    compiled_inputs = []
    jit = placement.jit
    placement.jit = lambda f, **kw: (lambda *args: (compiled_inputs.append(args), jit(f, **kw)(*args))[1])
    placement.create(lambda rngs: Decoder(CFG, rngs=rngs), seed=0)
    (args,) = compiled_inputs
    assert len(args) == 1 and jax.dtypes.issubdtype(args[0].dtype, jax.dtypes.prng_key)
