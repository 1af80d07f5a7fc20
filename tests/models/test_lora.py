"""LoRA adapters: the adapted forward against the merged weights' forward, the export read back
by our loader, a StarPO update that moves the adapters only (the frozen base is the KL reference),
and a trainer run whose checkpoints hold the adapters only and resume exactly. Seeds fixed.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.models.loading import load_hf
from ragen_jax.models.lora import add_lora, export_hf, has_lora, merge_lora
from ragen_jax.starpo import update as U
from ragen_jax.config import CollapseConfig, FilterConfig, StarPOConfig
from ragen_jax.starpo.logprobs import positions_for

CFG = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, model_type="qwen2", qkv_bias=True)
TOKENS = jnp.asarray([[3, 7, 1, 9, 4, 2, 8], [5, 5, 6, 1, 2, 3, 4]])


def _logits(model):
    return np.asarray(model(TOKENS, positions_for(TOKENS))[0])


def _perturbed(model, seed=1):
    gd, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    adapters = jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return nnx.merge(gd, adapters, base)


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj")])
def test_adapters_start_at_the_base_and_equal_the_merged_weights(targets):
    base = Decoder(CFG, rngs=nnx.Rngs(0))
    lora = add_lora(base, rank=4, alpha=8.0, targets=targets)
    np.testing.assert_array_equal(_logits(lora), _logits(base))  # B = 0
    adapters = nnx.state(lora, nnx.LoRAParam)
    names = {str(p[-3]) for p, _ in nnx.to_flat_state(adapters)}
    assert names == set(targets) and has_lora(lora) and not has_lora(base)
    tuned = _perturbed(lora)
    merged = merge_lora(tuned)
    assert not has_lora(merged)
    # Reference for one projection: W + (alpha / r) A B, by hand.
    q = tuned.layers[0].self_attn.q_proj
    want = np.asarray(q.kernel[...]) + 2.0 * np.asarray(q.lora.lora_a[...]) @ np.asarray(q.lora.lora_b[...])
    np.testing.assert_allclose(np.asarray(merged.layers[0].self_attn.q_proj.kernel[...]), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_logits(merged), _logits(tuned), atol=1e-5)
    assert np.abs(_logits(tuned) - _logits(base)).max() > 1e-3  # the adapters do change the model


def test_export_reads_back_as_the_merged_model(tmp_path):
    tuned = _perturbed(add_lora(Decoder(CFG, rngs=nnx.Rngs(0)), rank=2, alpha=4.0))
    export_hf(tuned, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    cfg, back = load_hf(tmp_path)
    assert not has_lora(back) and cfg.num_layers == CFG.num_layers
    np.testing.assert_allclose(_logits(back), _logits(tuned), atol=1e-5)


def test_starpo_update_moves_only_the_adapters_and_the_base_is_the_reference():
    from tests.starpo.test_update import BATCH, GROUP_SIZE, MODEL_CFG, random_traj

    policy = add_lora(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), rank=4, alpha=8.0)
    cfg = StarPOConfig(adv_estimator="grpo", mini_batch_size=8, actor_lr=0.05, use_kl_loss=True, kl_coef=0.1,
                       logprob_chunk_size=8)
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    n_base = sum(x.size for x in jax.tree.leaves(state.rest[0]))
    assert 0 < n_adapter < n_base
    # Optimizer state only for the adapters (AdamW: two moments of each).
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) <= 2 * n_adapter + 8
    assert state.rest[2] is None and all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state.ref_params))
    base_before = jax.tree.map(np.asarray, state.rest[0])
    update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(num_samples=8, micro_batch_size=32),
                                group_size=GROUP_SIZE, donate=False)
    new, metrics = update(state, random_traj(3))
    assert float(metrics["train/optimizer_steps"]) >= 1
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)))
    assert moved > 0
    for a, b in zip(jax.tree.leaves(new.rest[0]), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    # The reference log-probs are the base model's: zero adapters over the same base.
    ref = nnx.merge(graphdefs.reference, new.ref_params, new.rest[0])
    plain = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    tokens = random_traj(3).tokens[:2]
    np.testing.assert_allclose(np.asarray(ref(tokens, positions_for(tokens))[0]),
                               np.asarray(plain(tokens, positions_for(tokens))[0]), atol=1e-6)
    assert BATCH == 16


def test_trainer_run_keeps_adapter_only_checkpoints_and_resumes(tmp_path):
    from ragen_jax.training.checkpoint import Checkpointer
    from ragen_jax.training.event_log import read_scalars
    from ragen_jax.training.trainer import train
    from tests.training.test_trainer import small_config

    over = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "starpo.use_kl_loss": True, "starpo.kl_coef": 0.01}
    train(small_config(tmp_path / "run", total_steps=2, **over))
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    shapes = ckpt.saved_shapes(ckpt.latest_step())
    assert any("lora_a" in "/".join(map(str, p)) for p in shapes)
    assert not any("kernel" in "/".join(map(str, p)) and "lora" not in "/".join(map(str, p))
                   for p in shapes if str(p[0]) in ("rest", "params"))
    logged = read_scalars(tmp_path / "run" / "tensorboard")
    assert len(logged["actor/pg_loss"]) == 2 and np.isfinite(logged["actor/pg_loss"][-1][1])
    spec = small_config(tmp_path / "run", total_steps=3, **over)
    train(spec)  # resumes from step 2
    assert len(read_scalars(tmp_path / "run" / "tensorboard")["actor/pg_loss"]) == 3
    # config.mode=export: the merged policy as an HF checkpoint our loader reads back.
    from ragen_jax.training.evaluate import run_export
    from ragen_jax.starpo.train_state import policy_params, saved_part, with_base
    from ragen_jax.training.run import setup

    out = run_export(spec)
    _, exported = load_hf(out)
    run = setup(spec)
    state = Checkpointer(tmp_path / "run" / "checkpoints").restore(saved_part(run.train_state))[0]
    trained = nnx.merge(run.graphdefs.policy, policy_params(with_base(state, run.train_state)))
    tokens = jnp.asarray([[5, 9, 12, 40, 7]])
    np.testing.assert_allclose(np.asarray(exported(tokens, positions_for(tokens))[0]),
                               np.asarray(trained(tokens, positions_for(tokens))[0]), atol=1e-4)


def test_lora_branch_gradients_equal_autodiff_of_the_plain_product():
    """``decoder.lora_delta`` has its own backward rule (row-major products for XLA's fast CPU path):
    its gradients for x, A and B equal autodiff's of ``(x @ A) @ B`` (fixed seed)."""
    from ragen_jax.models.decoder import lora_delta

    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (3, 5, 12))
    a = jax.random.normal(keys[1], (12, 4))
    b = jax.random.normal(keys[2], (4, 9))
    g = jax.random.normal(keys[3], (3, 5, 9))
    plain = jax.grad(lambda x, a, b: jnp.sum(((x @ a) @ b) * g), argnums=(0, 1, 2))(x, a, b)
    ours = jax.grad(lambda x, a, b: jnp.sum(lora_delta(x, a, b) * g), argnums=(0, 1, 2))(x, a, b)
    np.testing.assert_allclose(np.asarray(lora_delta(x, a, b)), np.asarray((x @ a) @ b), rtol=1e-6, atol=1e-6)
    for p, o in zip(plain, ours):
        assert p.shape == o.shape
        np.testing.assert_allclose(np.asarray(o), np.asarray(p), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_projection_gradients_equal_autodiff_of_the_plain_product(out_dtype):
    """``decoder.projection`` (every dense layer's product) has its own backward rule: its gradients
    for x and the kernel equal autodiff's of ``lax.dot_general`` — float32, and bfloat16 operands with
    a float32 product (``model.matmul_dtype``), within bfloat16's rounding of the operands (fixed seed)."""
    from ragen_jax.models.decoder import projection

    keys = jax.random.split(jax.random.key(8), 3)
    dtype = jnp.float32 if out_dtype is None else jnp.bfloat16
    x = jax.random.normal(keys[0], (3, 5, 12)).astype(dtype)
    w = jax.random.normal(keys[1], (12, 9)).astype(dtype)
    g = jax.random.normal(keys[2], (3, 5, 9))

    def plain(x, w):
        y = jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=out_dtype)
        return jnp.sum(y.astype(jnp.float32) * g)

    def ours(x, w):
        return jnp.sum(projection(x, w, out_dtype).astype(jnp.float32) * g)

    np.testing.assert_allclose(float(ours(x, w)), float(plain(x, w)), rtol=1e-6)
    tol = 1e-5 if out_dtype is None else 2e-2
    for p, o in zip(jax.grad(plain, argnums=(0, 1))(x, w), jax.grad(ours, argnums=(0, 1))(x, w)):
        assert p.shape == o.shape and p.dtype == o.dtype
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(p, np.float32), rtol=tol, atol=tol)
