"""Two levers of the LoRA StarPO step against the plain path they replace.

- ``decoder.decode_form`` (``rollout.decode_weights="folded"``): the weights sampling multiplies by
  — adapters folded into their projections, stacked layers unstacked, bfloat16 operands stored as
  bfloat16. Checked against W + (alpha / r) A B worked in NumPy, against the as-trained model's
  logits (within float rounding), and through a whole rollout: the same sampled tokens and the
  sampler's log-probs within 1e-4 of the as-trained rollout's, the same greedy tokens.
- ``ModelConfig.lora_top_layers``: the frozen layers' adapters get exactly zero gradient, the
  trained layers' gradients equal those of every-layer LoRA (whose lower adapters start at B = 0),
  and a StarPO update leaves the frozen adapters as they were.

All weights and keys come from fixed seeds.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import environments
from ragen_jax.config import CollapseConfig, FilterConfig, RolloutConfig, StarPOConfig
from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.models.decoder import decode_form
from ragen_jax.models.lora import add_lora
from ragen_jax.rollout.loop import make_rollout
from ragen_jax.starpo import update as U
from ragen_jax.starpo.logprobs import positions_for
from tests.rollout.helpers import make_tokenizer

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, scan_layers=True, remat=True)
TOKENS = jnp.asarray([[3, 7, 1, 9, 4, 2, 8, 11], [5, 5, 6, 1, 2, 3, 4, 90]])


def _perturbed(model, seed=1, scale=0.2):
    """The adapters moved off their start (B = 0), as after training."""
    gd, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    adapters = jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    return nnx.merge(gd, adapters, base)


def _logits(graphdef, state):
    return np.asarray(nnx.merge(graphdef, state)(TOKENS, positions_for(TOKENS))[0])


@pytest.mark.parametrize("scan", [True, False])
def test_decode_form_folds_the_adapters_and_unstacks_the_layers(scan):
    model = _perturbed(add_lora(Decoder(CFG.replace(scan_layers=scan), rngs=nnx.Rngs(0)), rank=4, alpha=8.0))
    graphdef, state = nnx.split(model)
    plain_graphdef, plain = decode_form(graphdef, state)
    plain_model = nnx.merge(plain_graphdef, plain)
    assert plain_model.cfg.lora_rank == 0 and not plain_model.cfg.scan_layers and not plain_model.cfg.remat
    # One folded projection against NumPy: W + (alpha / r) A B of layer 1's up_proj.
    up = model.layers.mlp.up_proj if scan else model.layers[1].mlp.up_proj
    pick = (lambda x: np.asarray(x)[1]) if scan else np.asarray
    want = pick(up.kernel[...]) + 2.0 * pick(up.lora.lora_a[...]) @ pick(up.lora.lora_b[...])
    got = np.asarray(plain_model.layers[1].mlp.up_proj.kernel[...])
    if got.ndim == 3:  # in the CPU kernel's panels [N / 32, K, 32]
        got = np.transpose(got, (1, 0, 2)).reshape(got.shape[1], -1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_logits(plain_graphdef, plain), _logits(graphdef, state), atol=2e-5)


def test_decode_form_stores_bfloat16_operands_as_bfloat16():
    cfg = CFG.replace(matmul_dtype="bfloat16")
    model = _perturbed(add_lora(Decoder(cfg, rngs=nnx.Rngs(0)), rank=4, alpha=8.0))
    graphdef, state = nnx.split(model)
    plain_graphdef, plain = decode_form(graphdef, state)
    kernels = [v for p, v in nnx.to_flat_state(plain) if p[-1] == "kernel"]
    assert kernels and all(v[...].dtype == jnp.bfloat16 for v in kernels)
    # Without adapters the same numbers up to summation order: the matmul rounds float32 weights to
    # bfloat16 anyway.
    base = Decoder(cfg, rngs=nnx.Rngs(0))
    g, s = nnx.split(base)
    np.testing.assert_allclose(_logits(*decode_form(g, s)), _logits(g, s), atol=1e-6)
    # With them, folding first rounds W + sAB once instead of W and the side branch apart: close, not equal.
    np.testing.assert_allclose(_logits(plain_graphdef, plain), _logits(graphdef, state), atol=0.05)


def _rollout_pair(decode_weights, temperature, model_cfg=CFG):
    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    cfg = RolloutConfig(num_groups=2, group_size=2, max_turns=3, max_new_tokens=12, max_seq_len=640,
                        max_obs_tokens=64, temperature=temperature, decode_weights=decode_weights)
    model = _perturbed(add_lora(Decoder(model_cfg.replace(vocab_size=len(tok)), rngs=nnx.Rngs(3)), rank=4),
                       scale=0.5)
    graphdef, state = nnx.split(model)
    return make_rollout(graphdef, env, env.default_params(), tok, cfg)(state, jax.random.key(7))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_folded_rollout_plays_the_as_trained_rollouts_tokens(temperature):
    folded = _rollout_pair("folded", temperature)
    trained = _rollout_pair("as_trained", temperature)
    np.testing.assert_array_equal(np.asarray(folded.tokens), np.asarray(trained.tokens))
    mask = np.asarray(folded.loss_mask)
    assert mask.sum() > 20
    np.testing.assert_allclose(np.asarray(folded.sampler_logprobs)[mask], np.asarray(trained.sampler_logprobs)[mask],
                               atol=1e-4)


def test_decode_weights_is_checked():
    with pytest.raises(ValueError, match="decode_weights"):
        RolloutConfig(decode_weights="merged")


# --------------------------------------------------------------------------------------------------
# lora_top_layers


def _grads(model):
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)

    def loss(adapters):
        logits = nnx.merge(graphdef, adapters, base)(TOKENS, positions_for(TOKENS))[0]
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5]) + jnp.sum(logits ** 2) * 1e-3

    value, grads = jax.value_and_grad(loss)(adapters)
    return float(value), {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("scan", [True, False])
def test_top_layers_train_and_the_rest_get_no_gradient(scan):
    base = Decoder(CFG.replace(scan_layers=scan), rngs=nnx.Rngs(0))
    every = add_lora(base, rank=4, alpha=8.0, seed=5)
    top = add_lora(base, rank=4, alpha=8.0, seed=5, top_layers=1)
    assert top.cfg.frozen_layers == 2 and every.cfg.frozen_layers == 0
    # Move only the top layer's adapters (the lower ones at B = 0, as where they start): the two
    # models are then the same function, and the top layer's gradient must be the same.
    moved = _perturbed(every)
    lower = (lambda p: True) if scan else (lambda p: p[1] < 2)
    _, adapters, rest = nnx.split(moved, nnx.LoRAParam, ...)
    start = dict(nnx.to_flat_state(nnx.state(every, nnx.LoRAParam)))
    flat = []
    for p, v in nnx.to_flat_state(adapters):
        value = v[...]
        if scan:  # stacked [L, ...]: layers 0 and 1 back to their start
            value = value.at[:2].set(start[tuple(p)][...][:2])
        elif lower(p):
            value = start[tuple(p)][...]
        flat.append((p, v.replace(value=value)))
    adapters = nnx.from_flat_state(flat)
    every_moved = nnx.merge(nnx.split(every, nnx.LoRAParam, ...)[0], adapters, rest)
    top_moved = nnx.merge(nnx.split(top, nnx.LoRAParam, ...)[0], adapters, rest)
    v_every, g_every = _grads(every_moved)
    v_top, g_top = _grads(top_moved)
    assert v_every == pytest.approx(v_top, abs=1e-6)
    for path, g in g_top.items():
        top_part, low_part = (g[2], g[:2]) if scan else ((g, None) if path[1] == 2 else (None, g))
        if low_part is not None:
            assert np.all(low_part == 0), path
        if top_part is not None:
            ref = g_every[path][2] if scan else g_every[path]
            np.testing.assert_allclose(top_part, ref, rtol=1e-5, atol=1e-6)
            if path[-1] == "lora_b":
                assert np.abs(top_part).max() > 0
    # Every-layer LoRA does train the lower layers (the switch is what stops it).
    assert max(np.abs(g[:2] if scan else g).max() for p, g in g_every.items()
               if scan or p[1] < 2) > 0


def test_update_with_top_layers_leaves_the_frozen_adapters():
    from tests.starpo.test_update import GROUP_SIZE, MODEL_CFG, random_traj

    policy = add_lora(Decoder(dataclasses.replace(MODEL_CFG, num_layers=2), rngs=nnx.Rngs(0)), rank=4, alpha=8.0,
                      top_layers=1)
    cfg = StarPOConfig(adv_estimator="grpo", mini_batch_size=8, actor_lr=0.05, logprob_chunk_size=8)
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(num_samples=8, micro_batch_size=32),
                                group_size=GROUP_SIZE, donate=False)
    new, metrics = update(state, random_traj(3))
    assert float(metrics["train/optimizer_steps"]) >= 1
    for (path, a), (_, b) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(new.params)):
        if path[1] == 0:
            np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    moved = [float(jnp.abs(a[...] - b[...]).max()) for (p, a), (_, b)
             in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(new.params)) if p[1] == 1]
    assert max(moved) > 0


def test_lora_top_layers_is_checked():
    with pytest.raises(ValueError, match="lora_top_layers"):
        CFG.replace(lora_top_layers=4)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("prefix_len", [0, 3])
def test_starting_above_the_frozen_layers_gives_the_whole_pass(scan, prefix_len):
    """``frozen_rows_residual`` then ``sequence_logprobs(lower=)`` (``starpo.keep_frozen_residual``):
    the same hidden states, log-probs and adapter gradients as the pass through every layer."""
    from ragen_jax.starpo.logprobs import frozen_rows_residual, sequence_logprobs

    model = _perturbed(add_lora(Decoder(CFG.replace(scan_layers=scan), rngs=nnx.Rngs(0)), rank=4, alpha=8.0,
                                top_layers=1))
    tokens = TOKENS.at[:, :3].set(TOKENS[0, :3])  # a prompt both rows share
    lower = frozen_rows_residual(model, tokens, shared_prefix_len=prefix_len)
    assert lower.shape == (2, 8 - prefix_len, CFG.hidden_size)
    graphdef, adapters, base = nnx.split(model, nnx.LoRAParam, ...)

    def loss(adapters, lower):
        logp, ent, hidden = sequence_logprobs(nnx.merge(graphdef, adapters, base), tokens, chunk_size=4,
                                              shared_prefix_len=prefix_len, lower=lower)
        return jnp.sum(logp * jnp.arange(8)) + jnp.sum(ent), hidden

    (v_whole, h_whole), g_whole = jax.value_and_grad(loss, has_aux=True)(adapters, None)
    (v_above, h_above), g_above = jax.value_and_grad(loss, has_aux=True)(adapters, lower)
    assert v_above == pytest.approx(float(v_whole), rel=1e-6)
    np.testing.assert_allclose(np.asarray(h_above), np.asarray(h_whole), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_whole), jax.tree.leaves(g_above)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="lower must be"):
        model.hidden(tokens, positions_for(tokens), lower=lower[:, :2])


def test_update_keeping_the_frozen_residual_equals_the_whole_model_update():
    """The loss pass started from the scoring pass's residual after the frozen layers: the same update
    (parameters, losses) as running the whole model again, on per-turn rows after a shared prompt."""
    from tests.starpo.test_update import GROUP_SIZE, MODEL_CFG, two_turn_traj

    traj = two_turn_traj(73, context_window=1)
    results = []
    for keep in (False, True):
        policy = add_lora(Decoder(dataclasses.replace(MODEL_CFG, num_layers=3), rngs=nnx.Rngs(0)), rank=4,
                          alpha=8.0, top_layers=1)
        policy = _perturbed(policy, scale=0.5)
        # Adam with a large epsilon is a plain gradient step: parameters compare the gradients linearly.
        cfg = StarPOConfig(adv_estimator="grpo", mini_batch_size=8, micro_batch_size=4, actor_lr=1.0,
                           adam_eps=10.0, weight_decay=0.0, grad_clip=1e6, logprob_chunk_size=8,
                           keep_frozen_residual=keep)
        graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                    trajectory_enabled=False), group_size=GROUP_SIZE, donate=False,
                                    shared_prefix_len=2, per_turn_rows=(2, 16), reply_tokens=8)
        results.append(update(state, traj))
    (s_whole, m_whole), (s_kept, m_kept) = results
    assert float(m_kept["train/optimizer_steps"]) == 2
    for a, b in zip(jax.tree.leaves(s_whole.params), jax.tree.leaves(s_kept.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params),
                                                           jax.tree.leaves(s_kept.params))) > 1e-3
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        np.testing.assert_allclose(float(m_kept[key]), float(m_whole[key]), rtol=1e-5, atol=1e-7)
