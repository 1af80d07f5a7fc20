"""The jitted StarPO update step on a tiny Decoder and synthetic Trajectory batches.

Seeds are fixed everywhere (``nnx.Rngs(0)``, ``jax.random.key(n)``, ``np.random.default_rng(n)``), so
every run trains the same model on the same batches. Compiles are expensive on CPU: most fast tests
share one compiled update (the ``shared`` fixture); the default-path variants that need their own
compile (GAE with either critic, micro-batches, the shared prompt, windows) run in the default suite too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Critic, Decoder, ModelConfig, ValueHead
from ragen_jax.starpo import losses
from ragen_jax.starpo import update as U
from ragen_jax.config import CollapseConfig, FilterConfig, StarPOConfig
from ragen_jax.starpo.logprobs import positions_for
from tests.starpo.traj_factory import THINK, Conversation, Turn, build_trajectory

VOCAB = 16
SEQ_LEN = 12
NUM_GROUPS, GROUP_SIZE = 4, 4
BATCH = NUM_GROUPS * GROUP_SIZE
TARGETS = (10, 11, 12, 13)  # the rewarded reasoning tokens of the training test

MODEL_CFG = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)


def prompt_of(group):
    return [7, 8], [4, 5 + group]


def make_traj(reasoning, rewards, sampler_logprobs=None):
    """One turn per row: preamble | obs | <think> | reasoning | </think>; reward on the last token."""
    convs = []
    for row, (z, r) in enumerate(zip(reasoning, rewards)):
        pre, obs = prompt_of(row // GROUP_SIZE)
        convs.append(Conversation(preamble=pre, turns=[Turn(obs=obs, reasoning=list(z), answer=[], reward=r)]))
    return build_trajectory(convs, [b // GROUP_SIZE for b in range(BATCH)], seq_len=SEQ_LEN, max_turns=1,
                            sampler_logprobs=sampler_logprobs)


def random_traj(seed):
    rng = np.random.default_rng(seed)
    reasoning = [rng.integers(4, VOCAB, rng.integers(1, 4)).tolist() for _ in range(BATCH)]
    return make_traj(reasoning, rng.normal(size=BATCH).tolist())


def tree_max_abs_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------------------------------
# The shared compiled update: GRPO, SNR filter dropping zero-variance groups, collapse every 2 steps.

SHARED_CFG = StarPOConfig(adv_estimator="grpo", mini_batch_size=8, micro_batch_size=4, actor_lr=0.05,
                          entropy_coeff=0.0, logprob_chunk_size=8)
SHARED_FILTER = FilterConfig(include_zero=False, empty_stop_steps=2)
SHARED_COLLAPSE = CollapseConfig(compute_freq=2, num_samples=8, micro_batch_size=32, baseline_steps=1)


@pytest.fixture(scope="module")
def shared():
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, SHARED_CFG, key=jax.random.key(0))
    raw = U.make_update_step(graphdefs, SHARED_CFG, SHARED_FILTER, SHARED_COLLAPSE, group_size=GROUP_SIZE,
                             jit=False)
    traces = []

    def counted(state, traj):
        traces.append(1)  # runs once per trace, never at execution time
        return raw(state, traj)

    return {"graphdefs": graphdefs, "state": state, "update": jax.jit(counted), "traces": traces}


def test_one_compile_for_filter_advantages_loss_update_and_diagnostics(shared):
    update, state = shared["update"], shared["state"]
    flags, steps = [], []
    for seed in range(4):
        state, metrics = update(state, random_traj(seed))
        flags.append(float(metrics["collapse/computed"]))
        steps.append(float(metrics["train/optimizer_steps"]))
        assert all(np.isfinite(float(v)) for v in metrics.values())
    assert len(shared["traces"]) == 1 and update._cache_size() == 1
    # Collapse diagnostics at global steps 1, 2, 4 (step 1 and every compute_freq=2).
    assert flags == [1.0, 1.0, 0.0, 1.0]
    assert int(state.step) == 4
    assert int(state.optimizer_steps) == sum(steps) > 0
    assert float(metrics["collapse/valid_thinking_rate"]) == 1.0


def test_nonfinite_gradient_skips_the_step_and_is_counted(shared):
    update, state = shared["update"], shared["state"]
    traj = random_traj(10)
    rewards = np.array(traj.token_rewards)
    rewards[0, :] = np.nan  # one row of group 0: its mini-batch's gradient is NaN
    new_state, metrics = update(state, traj.replace(token_rewards=jnp.asarray(rewards)))
    assert float(metrics["train/nonfinite_grad_skipped"]) == 1.0
    assert int(new_state.num_nonfinite_skipped) == 1
    assert int(new_state.optimizer_steps) == 1  # the other mini-batch still trains
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new_state.params))

    rewards[:, :] = np.nan
    new_state, metrics = update(state, traj.replace(token_rewards=jnp.asarray(rewards)))
    assert int(new_state.num_nonfinite_skipped) == 2 and int(new_state.optimizer_steps) == 0
    assert tree_max_abs_diff(new_state.params, state.params) == 0.0
    assert tree_max_abs_diff(new_state.opt_state, state.opt_state) == 0.0
    # The rollout statistics report the NaN data as it is; the update's own metrics stay finite.
    assert all(np.isfinite(float(v)) for k, v in metrics.items() if k.startswith("actor/"))


def test_empty_filter_skips_update_and_raises_early_stop(shared):
    update, state = shared["update"], shared["state"]
    flat = random_traj(20)
    # Every member of a group scores the same: zero reward std everywhere, include_zero=False drops all.
    same = np.zeros((BATCH, SEQ_LEN), np.float32)
    last = np.asarray(flat.turn_last_token)[:, 0]
    same[np.arange(BATCH), last] = np.repeat(np.arange(NUM_GROUPS, dtype=np.float32), GROUP_SIZE)
    flat = flat.replace(token_rewards=jnp.asarray(same))
    s1, m1 = update(state, flat)
    assert float(m1["rollout/empty_after_filter"]) == 1.0 and float(m1["train/optimizer_steps"]) == 0.0
    assert tree_max_abs_diff(s1.params, state.params) == 0.0
    assert float(m1["early_stop/empty_filter"]) == 0.0
    s2, m2 = update(s1, flat)
    assert int(s2.consecutive_empty) == 2 and int(s2.num_empty_skipped) == 2
    assert float(m2["early_stop/empty_filter"]) == 1.0  # empty_stop_steps = 2
    s3, m3 = update(s2, random_traj(21))
    assert int(s3.consecutive_empty) == 0 and float(m3["rollout/empty_after_filter"]) == 0.0
    assert tree_max_abs_diff(s3.params, s2.params) > 0.0


def _sample_batch(policy_params, graphdefs, rest, key):
    """On-policy one-token reasoning per row, sampled from the tiny policy at temperature 1."""
    policy = nnx.merge(graphdefs.policy, policy_params, rest)
    prompts = jnp.array([sum(prompt_of(b // GROUP_SIZE), []) + [THINK] for b in range(BATCH)])
    logits, _ = policy(prompts, positions_for(prompts))
    logp = jax.nn.log_softmax(logits[:, -1])
    tok = jax.random.categorical(key, logp)
    return tok, jnp.take_along_axis(logp, tok[:, None], 1)[:, 0], jnp.exp(logp)


def test_training_raises_probability_of_rewarded_tokens(shared):
    update, state, gd = shared["update"], shared["state"], shared["graphdefs"]
    sample = jax.jit(lambda p, k: _sample_batch(p, gd, state.rest[0], k))
    targets = np.array(TARGETS)

    def p_target(params):
        return float(np.asarray(sample(params, jax.random.key(0))[2])[:, targets].sum(1).mean())

    before = p_target(state.params)
    for it in range(12):
        tok, logp, _ = sample(state.params, jax.random.key(100 + it))
        tok = np.asarray(tok)
        rewards = np.isin(tok, targets).astype(float).tolist()
        slp = np.zeros((BATCH, SEQ_LEN), np.float32)
        slp[:, 5] = np.asarray(logp)  # the reasoning token sits right after <think> (index 5)
        traj = make_traj([[int(t)] for t in tok], rewards, sampler_logprobs=slp)
        state, metrics = update(state, traj)
    after = p_target(state.params)
    assert before < 0.4 and after > before + 0.3, (before, after)
    assert len(shared["traces"]) == 1


def exact_logprobs(gd, state, tokens):
    """``[B, L]`` log-probs of ``tokens`` under the state's policy (column t: token t given the ones
    before it; 0 in column 0), from a plain forward: what a sampler in exact agreement recorded."""
    policy = nnx.merge(gd.policy, state.params, state.rest[0])
    logits, _ = jax.jit(lambda t: policy(t, positions_for(t)))(tokens)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    at_tokens = jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    return jnp.concatenate([jnp.zeros((tokens.shape[0], 1)), at_tokens], 1)


def test_sampler_logprob_agreement_metric(shared):
    update, state, gd = shared["update"], shared["state"], shared["graphdefs"]
    traj = random_traj(30)
    exact = exact_logprobs(gd, state, traj.tokens)
    _, m = update(state, traj.replace(sampler_logprobs=jnp.where(traj.loss_mask, exact, 0.0)))
    assert float(m["actor/sampler_logprob_abs_diff_max"]) < 1e-5
    _, m = update(state, traj.replace(sampler_logprobs=jnp.where(traj.loss_mask, exact - 0.5, 0.0)))
    np.testing.assert_allclose(float(m["actor/sampler_logprob_abs_diff_mean"]), 0.5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# The loss function itself: finite differences and exact micro-batch accumulation


FD_CFG = StarPOConfig(adv_estimator="grpo", use_kl_loss=True, kl_coef=0.5, kl_type="low_var_kl",
                      entropy_coeff=0.01, logprob_chunk_size=5)


@pytest.fixture(scope="module")
def loss_setup():
    """The micro-batch loss of FD_CFG on a tiny policy, one jitted value-and-grad for every use.

    Old log-probs are the current ones perturbed, so many ratios sit outside [1 - 0.2, 1 + 0.28]
    (clipped) and large ratios with negative advantages hit the dual clip; group 1 is
    filtered out (row weight 0); the KL is k3 against a perturbed reference.
    """
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(3))
    graphdefs, state = U.init_train_state(policy, FD_CFG, key=jax.random.key(0))
    loss_fn, _ = U.make_loss_fn(graphdefs, FD_CFG)
    traj = random_traj(40)
    rng = np.random.default_rng(0)
    model = nnx.merge(graphdefs.policy, state.params, state.rest[0])
    logits, _ = jax.jit(lambda t: model(t, positions_for(t)))(traj.tokens)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    logp = jnp.concatenate([jnp.zeros((BATCH, 1)), jnp.take_along_axis(lp, traj.tokens[:, 1:, None], -1)[..., 0]], 1)
    mask = traj.loss_mask
    mb = {"tokens": traj.tokens, "loss_mask": mask,
          "row_weights": jnp.asarray(np.repeat([1.0, 0.0, 1.0, 1.0], GROUP_SIZE), jnp.float32),
          # ±0.4 nats everywhere, and a fifth of the tokens 1.5 nats less likely before (ratio ≈ 4.5 > c).
          "old_logp": logp + jnp.asarray(rng.uniform(-0.4, 0.4, logp.shape)
                                         - 1.5 * (rng.random(logp.shape) < 0.2), jnp.float32),
          "advantages": jnp.asarray(rng.normal(size=(BATCH, SEQ_LEN)) * 2.0, jnp.float32) * mask,
          "ref_logp": logp + jnp.asarray(rng.normal(size=logp.shape) * 0.3, jnp.float32)}
    den = losses.loss_denominator(mask, FD_CFG.loss_agg_mode, mb["row_weights"])
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, part: loss_fn(p, None, state.rest, part, den, den), has_aux=True))
    return {"graphdefs": graphdefs, "state": state, "mb": mb, "value_and_grad": value_and_grad}


def _unit(tree):
    norm = np.sqrt(sum(float(jnp.sum(x * x)) for x in jax.tree.leaves(tree)))
    return jax.tree.map(lambda x: x / norm, tree)


def test_clipped_loss_gradient_matches_finite_differences(loss_setup):
    params, mb, vg = loss_setup["state"].params, loss_setup["mb"], loss_setup["value_and_grad"]
    (_, aux), grad = vg(params, mb)
    n_tok = float(aux["n_tokens"])
    assert float(aux["pg_clipfrac"]) / n_tok > 0.2 and float(aux["pg_clipfrac_lower"]) > 0  # both clips active
    rng = np.random.default_rng(1)
    h = 2e-3
    g_unit = _unit(grad)
    for _ in range(3):
        # Half along the gradient, half random: the loss moves along it, and every parameter is probed.
        r = _unit(jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params))
        d = _unit(jax.tree.map(jnp.add, g_unit, r))
        plus = vg(jax.tree.map(lambda p, v: p + h * v, params, d), mb)[0][0]
        minus = vg(jax.tree.map(lambda p, v: p - h * v, params, d), mb)[0][0]
        fd = (float(plus) - float(minus)) / (2 * h)
        analytic = sum(float(jnp.sum(g * v)) for g, v in zip(jax.tree.leaves(grad), jax.tree.leaves(d)))
        assert abs(analytic) > 0.1
        np.testing.assert_allclose(fd, analytic, rtol=1e-3)


def _reference_loss(params, graphdefs, rest, mb, cfg):
    """The full-batch objective written out directly from RAGEN's loss (token-mean over kept rows)."""
    model = nnx.merge(graphdefs.policy, params, rest)
    logits, _ = model(mb["tokens"], positions_for(mb["tokens"]))
    lp_all = jax.nn.log_softmax(logits[:, :-1], -1)
    logp = jnp.take_along_axis(lp_all, mb["tokens"][:, 1:, None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(lp_all) * lp_all, -1)
    m = (mb["loss_mask"][:, 1:] * mb["row_weights"][:, None]).astype(jnp.float32)
    old, adv, ref = mb["old_logp"][:, 1:], mb["advantages"][:, 1:], mb["ref_logp"][:, 1:]
    ratio = jnp.exp(jnp.clip(logp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    lc = jnp.maximum(l1, l2)
    pg = jnp.where(adv < 0, jnp.minimum(lc, -adv * cfg.clip_ratio_c), lc)
    d = jnp.clip(ref - logp, -20, 20)
    kl = jnp.clip(jnp.exp(d) - d - 1, -10, 10)
    per_tok = pg - cfg.entropy_coeff * ent + cfg.kl_coef * kl
    return jnp.sum(per_tok * m) / jnp.sum(m)


def test_micro_batch_gradients_sum_to_the_full_batch_gradient(loss_setup):
    params, mb, vg = loss_setup["state"].params, loss_setup["mb"], loss_setup["value_and_grad"]
    gd, rest = loss_setup["graphdefs"], loss_setup["state"].rest[0]
    (full_loss, _), full = vg(params, mb)
    # Micro-batches of 4 rows (rows outside a micro-batch masked out: same arithmetic as slicing them,
    # which the slow end-to-end test checks) against the one mini-batch denominator.
    summed, loss_sum = None, 0.0
    for start in range(0, BATCH, 4):
        rows = (jnp.arange(BATCH) >= start) & (jnp.arange(BATCH) < start + 4)
        part = {**mb, "loss_mask": mb["loss_mask"] & rows[:, None]}
        (loss, _), g = vg(params, part)
        loss_sum += float(loss)
        summed = g if summed is None else jax.tree.map(jnp.add, summed, g)
    ref_loss, ref = jax.jit(jax.value_and_grad(lambda p: _reference_loss(p, gd, rest, mb, FD_CFG)))(params)
    np.testing.assert_allclose(float(full_loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(loss_sum, float(ref_loss), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref))
    assert tree_max_abs_diff(full, ref) < 1e-5 * scale
    assert tree_max_abs_diff(summed, ref) < 1e-5 * scale


# ---------------------------------------------------------------------------------------------------
# Configuration errors


def test_config_errors_name_the_key_and_allowed_values():
    with pytest.raises(ValueError, match=r"unknown key starpo\.clip_ratio; allowed: .*clip_ratio_low"):
        StarPOConfig.from_dict({"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="advantage estimator 'ppo'.*'gae'.*'grpo'"):
        StarPOConfig(adv_estimator="ppo")
    with pytest.raises(ValueError, match="loss aggregation.*token-mean"):
        StarPOConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="needs a critic"):
        StarPOConfig(adv_estimator="gae", critic="none")
    with pytest.raises(ValueError, match="both set"):
        StarPOConfig(mini_batch_size=4, num_mini_batches=2)
    with pytest.raises(ValueError, match="filter strategy 'top_q'.*'top_p'"):
        FilterConfig.from_dict({"strategy": "top_q"})
    with pytest.raises(ValueError, match=r"unknown key filter\.rollout_filter_value"):
        FilterConfig.from_dict({"rollout_filter_value": 0.9})
    cfg = StarPOConfig.from_dict({"adv_estimator": "grpo", "norm_adv_by_std": False})
    assert cfg.estimator == "drgrpo" and cfg.critic_mode == "none"
    assert StarPOConfig().critic_mode == "separate"
    assert StarPOConfig().mini_batch_layout(128) == (4, 32)
    with pytest.raises(ValueError, match="does not divide"):
        StarPOConfig(mini_batch_size=5).mini_batch_layout(16)
    with pytest.raises(ValueError, match=r"lr_schedule='linear'; allowed: constant, cosine"):
        StarPOConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match=r"lr_schedule='cosine' needs starpo\.lr_decay_steps >= 1"):
        StarPOConfig(lr_schedule="cosine")


def test_learning_rate_schedules_hand_worked():
    """Linear warm-up (step i: lr (i + 1) / warmup), then constant or a cosine to min_lr_ratio × lr."""
    const = U.learning_rate_schedule(2.0, 4)
    np.testing.assert_allclose([float(const(i)) for i in (0, 1, 3, 100)], [0.5, 1.0, 2.0, 2.0], rtol=1e-6)
    cos = U.learning_rate_schedule(2.0, 4, "cosine", decay_steps=10, min_lr_ratio=0.1)
    # After warm-up (3 counts), count 3 + k is 0.2 + 1.8 (1 + cos(pi k / 10)) / 2, then 0.2 from k = 10.
    expected = [2.0 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(k, 10) / 10))) for k in (0, 5, 10, 20)]
    np.testing.assert_allclose([float(cos(3 + k)) for k in (0, 5, 10, 20)], expected, rtol=1e-6)
    np.testing.assert_allclose([float(cos(i)) for i in (0, 1)], [0.5, 1.0], rtol=1e-6)


def test_init_rejects_a_critic_of_the_wrong_kind():
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a critic module"):
        U.init_train_state(policy, StarPOConfig(critic="shared"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="pass a models.ValueHead"):
        U.init_train_state(policy, StarPOConfig(critic="shared"), key=jax.random.key(0),
                           critic=Critic(MODEL_CFG, rngs=nnx.Rngs(1)))
    with pytest.raises(ValueError, match="no KL term uses it"):
        U.init_train_state(policy, StarPOConfig(adv_estimator="grpo"), key=jax.random.key(0),
                           reference=Decoder(MODEL_CFG, rngs=nnx.Rngs(2)))


# ---------------------------------------------------------------------------------------------------
# Slow: variants with their own compile


# A large Adam epsilon makes the first step linear in the gradient (no sign amplification of tiny
# float differences), so two ways of computing the same update give tightly comparable parameters.
LINEAR_FIRST_STEP = dict(adv_estimator="grpo", mini_batch_size=8, actor_lr=1.0, adam_eps=10.0, weight_decay=0.0,
                         grad_clip=1e6, logprob_chunk_size=8)


def test_micro_batching_gives_the_same_update_end_to_end():
    traj = random_traj(50)
    results = []
    for micro in (None, 1):
        cfg = StarPOConfig(**LINEAR_FIRST_STEP, micro_batch_size=micro)
        graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                    trajectory_enabled=False), group_size=GROUP_SIZE)
        results.append(update(state, traj))
    (s_full, m_full), (s_micro, m_micro) = results
    assert tree_max_abs_diff(s_full.params, s_micro.params) < 1e-6
    np.testing.assert_allclose(float(m_full["actor/pg_loss"]), float(m_micro["actor/pg_loss"]), atol=1e-6)
    np.testing.assert_allclose(float(m_full["actor/grad_norm"]), float(m_micro["actor/grad_norm"]), rtol=1e-5)


def first_updates(traj, variants):
    """The first LINEAR_FIRST_STEP update of the same fresh policy, once per ``make_update_step``
    keyword set in ``variants`` (no diagnostics): ``[(state, metrics), ...]``."""
    cfg = StarPOConfig(**LINEAR_FIRST_STEP)
    results = []
    for kwargs in variants:
        graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                    trajectory_enabled=False), group_size=GROUP_SIZE, **kwargs)
        results.append(update(state, traj))
    return results


def test_kl_coef_without_use_kl_loss_is_no_kl_term():
    """``use_kl_loss=False`` switches the KL loss off whatever ``kl_coef`` says (as verl's
    ``kl_loss_coef``): ``--config.starpo.use_kl_loss=false`` on ``configs/sokoban.py`` (kl_coef 0.1)
    gives the update of kl_coef 0 — the same parameters and loss — instead of asking for reference
    log-probs that a run without the KL loss does not compute."""
    traj = random_traj(53)
    results = []
    for coef in (0.0, 0.1):
        cfg = StarPOConfig(**{**LINEAR_FIRST_STEP, "use_kl_loss": False, "kl_coef": coef, "kl_type": "low_var_kl"})
        graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        assert state.ref_params is None
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                    trajectory_enabled=False), group_size=GROUP_SIZE)
        results.append(update(state, traj))
    (s0, m0), (s1, m1) = results
    assert tree_max_abs_diff(s0.params, s1.params) == 0.0
    assert float(m0["actor/pg_loss"]) == float(m1["actor/pg_loss"]) and "actor/kl_loss" not in m1


def test_shared_prompt_once_per_batch_gives_the_same_update():
    """``shared_prefix_len``: the preamble every row opens with ([7, 8]) run once per batch."""
    traj = random_traj(51)
    assert np.all(np.asarray(traj.tokens[:, :2]) == [7, 8])
    (s_full, m_full), (s_once, m_once) = first_updates(traj, [dict(shared_prefix_len=0), dict(shared_prefix_len=2)])
    assert tree_max_abs_diff(s_full.params, s_once.params) < 1e-6
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        np.testing.assert_allclose(float(m_full[key]), float(m_once[key]), rtol=1e-5, atol=1e-7)


def test_single_pass_update_equals_the_two_pass_update():
    """One epoch, one mini-batch: the loss pass's own log-probs stand in for the scoring forward (ratio 1).
    Same parameters and metrics as the two-pass reference; the sampler agreement is a maximum over the
    micro-batches (one row is off by 0.7, the rest by 0.1), not a sum."""
    traj = random_traj(52)
    gd, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), StarPOConfig(**LINEAR_FIRST_STEP),
                                   key=jax.random.key(0))
    exact = exact_logprobs(gd, state, traj.tokens)
    shift = jnp.full((BATCH, 1), 0.1).at[5].set(0.7)
    traj = traj.replace(sampler_logprobs=jnp.where(traj.loss_mask, exact - shift, 0.0))

    cfg = StarPOConfig(**{**LINEAR_FIRST_STEP, "mini_batch_size": BATCH, "micro_batch_size": 4})
    filt, diag = FilterConfig(), CollapseConfig(first_turn_enabled=False, trajectory_enabled=False)
    assert U.is_single_pass(cfg, filt, 1, per_turn=False)
    results = []
    for single in (None, False):
        gd, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(gd, cfg, filt, diag, group_size=GROUP_SIZE, single_pass=single)
        results.append(update(state, traj))
    (s_one, m_one), (s_two, m_two) = results
    assert tree_max_abs_diff(s_one.params, s_two.params) < 1e-6
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/sampler_logprob_abs_diff_mean",
                "actor/sampler_logprob_abs_diff_max"):
        np.testing.assert_allclose(float(m_one[key]), float(m_two[key]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m_one["actor/sampler_logprob_abs_diff_max"]), 0.7, atol=1e-5)
    # Anything that reads the pre-update scores, or a second optimizer step, keeps the scoring pass.
    for other, f, num_mini, per_turn in (
            (cfg, filt, 2, False), (cfg, filt, 1, True), (cfg, FilterConfig(metric="entropy_variance"), 1, False),
            (StarPOConfig(**{**LINEAR_FIRST_STEP, "ppo_epochs": 2}), filt, 1, False),
            (StarPOConfig(adv_estimator="gae"), filt, 1, False),
            (StarPOConfig(**{**LINEAR_FIRST_STEP, "use_kl_loss": True, "kl_coef": 0.1}), filt, 1, False)):
        assert not U.is_single_pass(other, f, num_mini, per_turn)


@pytest.mark.parametrize("critic_mode", ["shared", "separate"])
def test_gae_with_critic_and_kl_trains_the_value_function(critic_mode):
    cfg = StarPOConfig(adv_estimator="gae", critic=critic_mode, mini_batch_size=8, micro_batch_size=4,
                       actor_lr=1e-3, critic_lr=3e-2 if critic_mode == "shared" else 1e-2,
                       use_kl_loss=True, kl_coef=0.1, logprob_chunk_size=8)
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    critic = ValueHead(MODEL_CFG, rngs=nnx.Rngs(1)) if critic_mode == "shared" else Critic(MODEL_CFG, rngs=nnx.Rngs(1))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0), critic=critic)
    update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(num_samples=8),
                                group_size=GROUP_SIZE, donate=False)
    # Returns predictable from the prompt (each group scores its index): a critic can fit them exactly,
    # whereas random per-row scores leave the within-group variance irreducible at the first token.
    traj = random_traj(60)
    last = np.asarray(traj.turn_last_token)[:, 0]
    rewards = np.zeros((BATCH, SEQ_LEN), np.float32)
    rewards[np.arange(BATCH), last] = np.arange(BATCH) // GROUP_SIZE
    traj = traj.replace(token_rewards=jnp.asarray(rewards))
    state1, m = update(state, traj)
    # The reference is the initial policy: KL 0 before the first step.
    assert abs(float(m["actor/ref_kl"])) < 1e-6
    vf = [float(m["critic/vf_loss"])]
    for _ in range(40):
        state1, m = update(state1, traj)
        vf.append(float(m["critic/vf_loss"]))
    assert vf[-1] < 0.15 * vf[0], vf
    assert float(m["actor/kl_loss"]) != 0.0
    assert tree_max_abs_diff(state1.critic_params, state.critic_params) > 0


def test_shared_value_head_loss_does_not_reach_the_policy_trunk():
    cfg = StarPOConfig(adv_estimator="gae", critic="shared", entropy_coeff=0.0, logprob_chunk_size=8)
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0),
                                          critic=ValueHead(MODEL_CFG, rngs=nnx.Rngs(1)))
    loss_fn, _ = U.make_loss_fn(graphdefs, cfg)
    traj = random_traj(70)
    mask = traj.loss_mask
    zeros = jnp.zeros(mask.shape)
    mb = {"tokens": traj.tokens, "loss_mask": mask, "row_weights": jnp.ones(BATCH), "old_logp": zeros,
          "advantages": zeros, "old_values": zeros, "returns": jnp.where(mask, 3.0, 0.0)}
    den = jnp.sum(mask).astype(jnp.float32)
    (loss, _), (g_policy, g_head) = jax.jit(jax.value_and_grad(
        lambda p, c: loss_fn(p, c, state.rest, mb, den, den), argnums=(0, 1), has_aux=True))(
        state.params, state.critic_params)
    assert float(loss) > 1.0  # the value loss is there ...
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_policy)) == 0.0  # ... not in the trunk
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_head)) > 0.0


# ---------------------------------------------------------------------------------------------------
# Limited context: one row per (episode, turn), scored on the window the reply was sampled in


def two_turn_traj(seed, context_window=None, sampler_logprobs=None):
    """Two turns per row (group-specific observations, random reasoning); reward on the last turn."""
    rng = np.random.default_rng(seed)
    convs = []
    for row in range(BATCH):
        pre, obs = prompt_of(row // GROUP_SIZE)
        turns = [Turn(obs=obs, reasoning=rng.integers(4, VOCAB, rng.integers(1, 4)).tolist()),
                 Turn(obs=[6, 4 + rng.integers(0, 3)], reasoning=rng.integers(4, VOCAB, rng.integers(1, 4)).tolist(),
                      reward=float(rng.normal()))]
        convs.append(Conversation(preamble=pre, turns=turns))
    return build_trajectory(convs, [b // GROUP_SIZE for b in range(BATCH)], seq_len=24, max_turns=2,
                            sampler_logprobs=sampler_logprobs, context_window=context_window)


def _window_logprobs(model, traj, preamble_len):
    """NumPy-built contexts: preamble + tokens[context_start : turn end], one forward each; the
    log-prob of every sampled token under the context of its own turn, in transcript layout."""
    tokens, turn_ids = np.asarray(traj.tokens), np.asarray(traj.turn_ids)
    width = tokens.shape[1]
    # One compiled forward for every context: right padding cannot reach earlier positions (causal).
    forward = jax.jit(lambda x: jax.nn.log_softmax(model(x, jnp.arange(width)[None])[0][0], -1))
    out = np.zeros(tokens.shape, np.float32)
    for b in range(tokens.shape[0]):
        for t in range(traj.max_turns):
            cs, end = int(traj.context_start[b, t]), int(traj.turn_last_token[b, t]) + 1
            ctx = np.concatenate([tokens[b, :preamble_len], tokens[b, cs:end]])
            lp = np.asarray(forward(jnp.asarray(np.pad(ctx, (0, width - len(ctx))))[None]))
            for i in np.nonzero(np.asarray(traj.loss_mask[b]) & (turn_ids[b] == t))[0]:
                j = i - cs + preamble_len
                out[b, i] = lp[j - 1, ctx[j]]
    return out


def test_limited_context_update_scores_each_turn_on_its_window():
    cfg = StarPOConfig(**LINEAR_FIRST_STEP)
    graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
    update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(num_samples=8, micro_batch_size=32),
                                group_size=GROUP_SIZE, donate=False, shared_prefix_len=2, per_turn_rows=(2, 16))
    traj = two_turn_traj(70, context_window=1)
    assert int(traj.context_start[0, 1]) > int(traj.turn_last_token[0, 0])  # turn 0 left the window
    model = nnx.merge(graphdefs.policy, state.params, state.rest[0])
    windowed = _window_logprobs(model, traj, 2)
    _, m = update(state, traj.replace(sampler_logprobs=jnp.asarray(windowed)))
    assert float(m["actor/sampler_logprob_abs_diff_max"]) < 1e-5
    # Under the whole transcript the second turn's tokens are scored differently: the metric sees it.
    _, m_full = update(state, traj.replace(sampler_logprobs=jnp.asarray(_window_logprobs(
        model, traj.replace(context_start=jnp.full_like(traj.context_start, 2)), 2))))
    assert float(m_full["actor/sampler_logprob_abs_diff_max"]) > 1e-3
    assert float(m["collapse/computed"]) == 1.0
    assert np.isfinite(float(m["collapse_trajectory_sample/mi_estimate"]))
    assert float(m["train/optimizer_steps"]) == cfg.mini_batch_layout(BATCH)[0]


def test_limited_context_covering_the_conversation_gives_the_full_update():
    """A window that holds every turn sees the transcript's own prefixes: same update as full mode
    (same tokens per mini-batch, same token-mean), though computed on per-turn rows."""
    traj = two_turn_traj(71, context_window=2)
    (s_full, m_full), (s_rows, m_rows) = first_updates(traj, [dict(per_turn_rows=None), dict(per_turn_rows=(2, 24))])
    assert tree_max_abs_diff(s_full.params, s_rows.params) < 1e-6
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/sampler_logprob_abs_diff_mean"):
        np.testing.assert_allclose(float(m_full[key]), float(m_rows[key]), rtol=1e-5, atol=1e-7)


def test_trimmed_width_hand_worked():
    from ragen_jax.rollout.trajectory import trimmed_width

    assert trimmed_width(300, 512, 0) == 512          # off
    assert trimmed_width(300, 512, 128) == 384        # rounded up to a multiple
    assert trimmed_width(384, 512, 128) == 384        # already a multiple
    assert trimmed_width(500, 512, 128) == 512        # never wider than the rollout's rows
    assert trimmed_width(3, 512, 64) == 64


def test_an_update_on_rows_cut_to_their_longest_equals_the_padded_update():
    """``starpo.seq_len_multiple``: cutting the padding past the longest row (here 40 -> 16 positions)
    changes nothing the update computes: parameters, losses and the MI proxy (every sample computed)."""
    from ragen_jax.rollout.trajectory import trim, trimmed_width

    rng = np.random.default_rng(53)
    reasoning = [rng.integers(4, VOCAB, rng.integers(2, 6)).tolist() for _ in range(BATCH)]
    convs = []
    for row, z in enumerate(reasoning):
        pre, obs = prompt_of(row // GROUP_SIZE)
        convs.append(Conversation(preamble=pre, turns=[Turn(obs=obs, reasoning=z, answer=[3], reward=float(rng.normal()))]))
    wide = build_trajectory(convs, [b // GROUP_SIZE for b in range(BATCH)], seq_len=40, max_turns=1)
    longest = int(np.asarray(wide.lengths).max())
    width = trimmed_width(longest, wide.seq_len, 8)
    assert longest <= width == 16 < wide.seq_len
    cut = trim(wide, width)
    assert cut.tokens.shape == (BATCH, width) and cut.turn_rewards.shape == wide.turn_rewards.shape
    np.testing.assert_array_equal(np.asarray(cut.tokens), np.asarray(wide.tokens)[:, :width])
    assert int(np.asarray(cut.valid_mask).sum()) == int(np.asarray(wide.valid_mask).sum())  # only padding went

    cfg = StarPOConfig(**LINEAR_FIRST_STEP)
    diag = CollapseConfig(compute_freq=1, num_samples=BATCH, micro_batch_size=BATCH, baseline_steps=1)
    results = []
    for traj in (wide, cut):
        graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), diag, group_size=GROUP_SIZE, shared_prefix_len=2)
        results.append(update(state, traj))
    (s_wide, m_wide), (s_cut, m_cut) = results
    assert tree_max_abs_diff(s_wide.params, s_cut.params) < 1e-6
    assert float(m_wide["collapse_first_turn_sample/computed"]) == 1.0
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "collapse_first_turn_sample/mi_estimate",
                "collapse_first_turn_sample/conditional_entropy_est"):
        np.testing.assert_allclose(float(m_wide[key]), float(m_cut[key]), rtol=1e-5, atol=1e-6)


def test_cutting_rows_refuses_the_row_width_normaliser():
    with pytest.raises(ValueError, match="seq_len_multiple=64 would change the row width"):
        StarPOConfig(seq_len_multiple=64, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="seq_len_multiple must be an int >= 0"):
        StarPOConfig(seq_len_multiple=-1)


def test_rollout_rejection_is_exact_under_micro_batching():
    """Rollout correction with rejection, the veto and batch-normalised weights depends on the whole
    mini-batch under the current policy: measured before the gradient pass, the update is the same
    whether the mini-batch runs as one micro-batch or as one row at a time. Two mini-batches with a
    large step make the second one off-policy, so tokens really are rejected."""
    traj = random_traj(51)
    results = []
    for micro in (None, 1):
        cfg = StarPOConfig(**{**LINEAR_FIRST_STEP, "mini_batch_size": 4}, micro_batch_size=micro,
                           policy_loss="rollout_correction", rollout_rs="token", rollout_rs_threshold=1.02,
                           rollout_rs_threshold_lower=0.98, rollout_token_veto_threshold=0.5,
                           rollout_is_batch_normalize=True)
        graphdefs, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                    trajectory_enabled=False), group_size=GROUP_SIZE)
        results.append(update(state, traj, jax.random.key(3)))
    (s_full, m_full), (s_micro, m_micro) = results
    assert float(m_full["actor/pg_clipfrac_lower"]) > 0  # some tokens were rejected
    np.testing.assert_allclose(float(m_full["actor/pg_clipfrac_lower"]), float(m_micro["actor/pg_clipfrac_lower"]),
                               rtol=1e-5)
    assert tree_max_abs_diff(s_full.params, s_micro.params) < 1e-5
    np.testing.assert_allclose(float(m_full["actor/pg_loss"]), float(m_micro["actor/pg_loss"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(m_full["actor/ppo_kl"]), float(m_micro["actor/ppo_kl"]), rtol=1e-4, atol=1e-7)


def test_loss_token_logprobs_give_the_every_position_update():
    """``starpo.logprobs_at='loss_tokens'`` (the default, given the reply budget ``reply_tokens``) runs the
    LM head at the loss tokens only: the same parameters and metrics as scoring every position, on whole
    transcripts (budget × turns a row) and on per-turn rows (one reply a row); a budget the replies
    overflow is reported, not silent."""
    traj = two_turn_traj(72, context_window=1)
    longest_reply = int(np.max(np.sum(np.asarray(traj.loss_mask) & (np.asarray(traj.turn_ids) == 1), axis=1)))
    for rows in (None, (2, 16)):
        (s_all, m_all), (s_loss, m_loss) = first_updates(
            traj, [dict(per_turn_rows=rows, shared_prefix_len=2),
                   dict(per_turn_rows=rows, shared_prefix_len=2, reply_tokens=8)])
        assert "actor/unscored_loss_tokens" not in m_all
        assert float(m_loss["actor/unscored_loss_tokens"]) == 0.0
        assert tree_max_abs_diff(s_all.params, s_loss.params) < 1e-6
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/sampler_logprob_abs_diff_mean"):
            np.testing.assert_allclose(float(m_all[key]), float(m_loss[key]), rtol=1e-5, atol=1e-7)
    (_, m_short), = first_updates(traj, [dict(per_turn_rows=(2, 16), shared_prefix_len=2,
                                              reply_tokens=longest_reply - 1)])
    assert float(m_short["actor/unscored_loss_tokens"]) >= 1.0



def test_decoupled_ppo_update_weighs_tokens_by_proximal_over_behaviour():
    """The StarPO update hands the loss the rollout's log-probs as the behaviour policy's. When they are
    the proximal policy's less log 2 on every token (a batch sampled by a policy that found each token
    half as likely), the first step's policy loss and gradient are exactly twice PPO's (ratio 1, no
    clip: the weight 2 scales every token); half the rows shifted give the token-weighted mean weight."""
    traj = random_traj(53)
    gd, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), StarPOConfig(**LINEAR_FIRST_STEP),
                                   key=jax.random.key(0))
    exact = exact_logprobs(gd, state, traj.tokens)
    filt, diag = FilterConfig(), CollapseConfig(first_turn_enabled=False, trajectory_enabled=False)

    def first_step(policy_loss, shift):
        cfg = StarPOConfig(**{**LINEAR_FIRST_STEP, "mini_batch_size": BATCH, "policy_loss": policy_loss})
        gd, state = U.init_train_state(Decoder(MODEL_CFG, rngs=nnx.Rngs(0)), cfg, key=jax.random.key(0))
        update = U.make_update_step(gd, cfg, filt, diag, group_size=GROUP_SIZE, single_pass=False)
        return update(state, traj.replace(sampler_logprobs=jnp.where(traj.loss_mask, exact - shift, 0.0)))[1]

    ppo = first_step("ppo", 0.0)
    doubled = first_step("decoupled_ppo", jnp.log(2.0))
    np.testing.assert_allclose(float(doubled["actor/pg_loss"]), 2 * float(ppo["actor/pg_loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(doubled["actor/grad_norm"]), 2 * float(ppo["actor/grad_norm"]), rtol=1e-4)
    np.testing.assert_allclose(float(doubled["actor/behaviour_weight_mean"]), 2.0, rtol=1e-4)
    assert float(doubled["actor/behaviour_capped"]) == 0.0
    half = jnp.where(jnp.arange(BATCH)[:, None] < BATCH // 2, jnp.log(2.0), 0.0)
    mixed = first_step("decoupled_ppo", half)
    mask = np.asarray(traj.loss_mask)
    want = (2 * mask[: BATCH // 2].sum() + mask[BATCH // 2:].sum()) / mask.sum()
    np.testing.assert_allclose(float(mixed["actor/behaviour_weight_mean"]), want, rtol=1e-4)
    np.testing.assert_allclose(float(mixed["actor/behaviour_weight_max"]), 2.0, rtol=1e-4)
