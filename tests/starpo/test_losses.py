"""Policy/value losses, KL estimators and loss aggregation against NumPy re-derivations.

Random inputs come from seeded ``numpy.random.default_rng`` generators (reproducible runs).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import losses
from tests.starpo import numpy_reference as ref


def random_policy_batch(seed, batch=6, length=12):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(batch, length))
    # Log-ratios spread wide enough to hit both clip edges, the dual clip and the +-20 clamp.
    old = logp - rng.normal(scale=0.5, size=(batch, length))
    old[0, :3] = logp[0, :3] - np.array([25.0, -30.0, 3.0])
    adv = rng.normal(scale=2.0, size=(batch, length))
    mask = rng.random((batch, length)) < 0.7
    # Negative advantages with ratio e^1.5 > 3: the dual clip binds for c = 3.
    old[1, 1:3] = logp[1, 1:3] - 1.5
    adv[1, 1:3] = -1.0
    mask[1, 1:3] = True
    mask[:, 0] = False
    mask[-1] = False  # an empty row
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("eps_low,eps_high,c", [(0.2, 0.28, 3.0), (0.2, 0.2, None), (0.1, 0.3, 1.5)])
def test_ppo_clip_loss_matches_reference(seed, eps_low, eps_high, c):
    logp, old, adv, mask = random_policy_batch(seed)
    want, want_metrics = ref.ppo(logp, old, adv, mask, eps_low, eps_high, c)
    got, metrics = losses.policy_loss(
        "ppo", *(jnp.asarray(a, jnp.float32) for a in (logp, old, adv)), jnp.asarray(mask),
        clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=c)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for k, v in want_metrics.items():
        np.testing.assert_allclose(metrics[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert want_metrics["pg_clipfrac"] > 0  # the batch really exercises clipping
    if c is not None and c > 2:
        assert want_metrics["pg_clipfrac_lower"] > 0


def test_ppo_worked_example():
    """Hand-worked tokens (eps 0.2/0.28, c = 3).

    t=1: A=-1, ratio e:   L1 = e, L2 = 1.28, Lc = e < 3            -> e
    t=2: A=-1, ratio e^2: Lc = e^2 = 7.39 > 3 (dual clip binds)   -> 3
    t=3: A=+1, ratio 1/e: L1 = -0.368, L2 = -0.8, Lc = max        -> -1/e
    """
    logp = jnp.array([[0.0, 1.0, 2.0, -1.0]])
    adv = jnp.array([[0.0, -1.0, -1.0, 1.0]])
    mask = jnp.array([[False, True, True, True]])
    got, m = losses.ppo_clip_loss(logp, jnp.zeros((1, 4)), adv, mask)
    np.testing.assert_allclose(got, [[0.0, np.e, 3.0, -np.exp(-1.0)]], rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 0.0)  # L2 > L1 nowhere
    np.testing.assert_allclose(m["pg_clipfrac_lower"], 1.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["ppo_kl"], -2.0 / 3.0, rtol=1e-6)


def test_ppo_worked_example_positive_advantage_low_ratio():
    got, _ = losses.ppo_clip_loss(jnp.array([[-1.0]]), jnp.zeros((1, 1)), jnp.ones((1, 1)),
                                  jnp.ones((1, 1), bool))
    np.testing.assert_allclose(got, [[-np.exp(-1.0)]], rtol=1e-6)


def test_ppo_gradient_is_zero_when_clipped():
    """Positive advantage and ratio above 1 + eps_high: the clipped branch has no gradient."""
    grad = jax.grad(lambda lp: losses.ppo_clip_loss(lp, jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                                    jnp.ones((1, 2), bool))[0].sum())
    g = grad(jnp.array([[0.5, 0.1]]))
    np.testing.assert_allclose(g, [[0.0, -np.exp(0.1)]], rtol=1e-6)


def test_bad_dual_clip_is_rejected():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.ppo_clip_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1, 1)),
                             jnp.ones((1, 1), bool), clip_ratio_c=0.9)


@pytest.mark.parametrize("name", losses.KL_ESTIMATORS.names())
def test_kl_estimators_match_reference(name):
    rng = np.random.default_rng(1)
    logp = -rng.exponential(1.0, size=(4, 9))
    ref_logp = logp + rng.normal(scale=2.0, size=(4, 9))
    ref_logp[0, 0] = logp[0, 0] + 30.0  # exercises the k3 clamps
    want = np.vectorize(lambda a, b: ref.kl_token(name, a, b))(logp, ref_logp)
    got = losses.kl_penalty(name, jnp.asarray(logp, jnp.float32), jnp.asarray(ref_logp, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["kl+", "abs+", "low_var_kl+", "k3+"])
def test_straight_through_kl_has_k2_gradient(name):
    rng = np.random.default_rng(2)
    logp = jnp.asarray(-rng.exponential(1.0, size=(3, 5)), jnp.float32)
    ref_logp = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    g = jax.grad(lambda lp: losses.kl_penalty(name, lp, ref_logp).sum())(logp)
    np.testing.assert_allclose(g, logp - ref_logp, rtol=1e-5, atol=1e-6)


def test_kl_in_reward_and_adaptive_controller():
    rng = np.random.default_rng(4)
    r = rng.normal(size=(3, 6))
    logp = -rng.exponential(size=(3, 6))
    ref_logp = -rng.exponential(size=(3, 6))
    mask = rng.random((3, 6)) < 0.6
    mask[2] = False
    new_r, current = losses.apply_kl_in_reward(
        *(jnp.asarray(a, jnp.float32) for a in (r, logp, ref_logp)), jnp.asarray(mask),
        beta=0.1, estimator="low_var_kl")
    kl = np.vectorize(lambda a, b: ref.kl_token("k3", a, b))(logp, ref_logp) * mask
    np.testing.assert_allclose(new_r, r - 0.1 * kl, rtol=1e-5, atol=1e-6)
    rows = [kl[b][mask[b]].mean() for b in range(3) if mask[b].any()]
    np.testing.assert_allclose(current, np.mean(rows), rtol=1e-5)
    # kl twice the target: error clipped to +0.2, beta grows by 0.2 * 64 / 1000.
    np.testing.assert_allclose(losses.adaptive_kl_coef(0.1, 0.2, 64, target_kl=0.1, horizon=1000),
                               0.1 * (1 + 0.2 * 64 / 1000), rtol=1e-6)
    np.testing.assert_allclose(losses.adaptive_kl_coef(0.1, 0.095, 10, target_kl=0.1, horizon=100),
                               0.1 * (1 - 0.05 * 10 / 100), rtol=1e-6)


MODES = losses.LOSS_AGGREGATIONS.names()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_aggregation_matches_reference(mode, weighted):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(7, 10))
    mask = rng.random((7, 10)) < 0.5
    mask[3] = False
    w = rng.random(7) * (rng.random(7) < 0.8) if weighted else None
    want = ref.aggregate(x, mask, mode, w)
    got = losses.aggregate(jnp.asarray(x, jnp.float32), jnp.asarray(mask), mode,
                           None if w is None else jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses.loss_denominator(jnp.asarray(mask), mode,
                                                       None if w is None else jnp.asarray(w)),
                               want[1], rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_exact_under_micro_batching(mode):
    """Sum of numerators / sum of denominators over any micro-batch split == full-batch value."""
    rng = np.random.default_rng(9)
    x = rng.normal(size=(12, 8))
    mask = rng.random((12, 8)) < 0.4
    w = (rng.random(12) < 0.75).astype(float)  # SNR-filter style 0/1 row weights
    full_num, full_den = ref.aggregate(x, mask, mode, w)
    for cuts in ([4, 8], [1, 2, 3, 5, 11], [6]):
        parts = [losses.aggregate(jnp.asarray(xs, jnp.float32), jnp.asarray(ms), mode, jnp.asarray(ws))
                 for xs, ms, ws in zip(np.split(x, cuts), np.split(mask, cuts), np.split(w, cuts))]
        # The update's way: the numerators of the parts over the whole batch's denominator.
        den = losses.loss_denominator(jnp.asarray(mask), mode, jnp.asarray(w))
        np.testing.assert_allclose(sum(p[0] for p in parts) / den, full_num / full_den, rtol=1e-5)
        if mode != "seq-mean-token-sum-norm":  # verl's constant denominator does not add up over parts
            np.testing.assert_allclose(losses.combine(parts), full_num / full_den, rtol=1e-5)


def test_sum_norm_aggregations_are_verls_and_dr_grpos():
    """Hand-worked: rows of 3 and 1 tokens with losses 1 each, width L = 4. verl's
    seq-mean-token-sum-norm is 4 / 4 = 1 (no mean over rows); Dr. GRPO's is 4 / (2 * 4) = 0.5."""
    x = jnp.ones((2, 4))
    mask = jnp.asarray([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    assert float(losses.aggregate_mean(x, mask, "seq-mean-token-sum-norm")) == pytest.approx(1.0)
    assert float(losses.aggregate_mean(x, mask, "drgrpo-token-sum-norm")) == pytest.approx(0.5)


def test_micro_batch_token_mean_differs_from_naive_average():
    """The original's per-micro-batch token-mean averaged over micro-batches is a different number."""
    x = np.array([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    parts = [losses.aggregate(jnp.asarray(x[i:i + 1]), jnp.asarray(mask[i:i + 1]), "token-mean")
             for i in range(2)]
    np.testing.assert_allclose(losses.combine(parts), 7.0 / 4.0)  # exact: all 4 tokens
    assert abs(np.mean([1.0, 4.0]) - 7.0 / 4.0) > 0.5


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_is_exact(mode):
    """grad of sum_i num_i / D (D = sum of micro-batch denominators) == full-batch gradient."""
    rng = np.random.default_rng(10)
    feats = jnp.asarray(rng.normal(size=(8, 6, 3)), jnp.float32)
    mask = jnp.asarray(rng.random((8, 6)) < 0.6)
    theta = jnp.asarray(rng.normal(size=3), jnp.float32)

    def per_token(th, f):
        return jnp.tanh(f @ th) ** 2

    slices = [slice(0, 3), slice(3, 4), slice(4, 8)]

    @jax.jit
    def both(th):
        full = jax.grad(lambda t: losses.aggregate_mean(per_token(t, feats), mask, mode))(th)
        total_den = losses.loss_denominator(mask, mode)  # once per mini-batch, as the update does
        acc = sum(jax.grad(lambda t, s=s: losses.aggregate(per_token(t, feats[s]), mask[s], mode)[0]
                           / total_den)(th) for s in slices)
        return full, acc

    full, acc = both(theta)
    np.testing.assert_allclose(acc, full, rtol=1e-5, atol=1e-7)


def test_combine_of_empty_is_zero():
    assert float(losses.combine([(jnp.array(0.0), jnp.array(0.0))])) == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_value_loss_matches_reference(seed):
    rng = np.random.default_rng(seed)
    v_old = rng.normal(size=(5, 9))
    v = v_old + rng.normal(scale=0.8, size=(5, 9))
    ret = rng.normal(size=(5, 9))
    mask = rng.random((5, 9)) < 0.7
    want, want_metrics = ref.value_loss(v, v_old, ret, mask, 0.5)
    got, metrics = losses.value_loss(*(jnp.asarray(a, jnp.float32) for a in (v, v_old, ret)),
                                     jnp.asarray(mask), cliprange_value=0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for k, val in want_metrics.items():
        np.testing.assert_allclose(metrics[k], val, rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < want_metrics["vf_clipfrac"] < 1


def test_unknown_names_list_allowed_values():
    with pytest.raises(ValueError, match="Unknown loss aggregation 'mean'.*'token-mean'"):
        losses.aggregate(jnp.zeros((1, 1)), jnp.ones((1, 1)), "mean")
    with pytest.raises(ValueError, match="Unknown KL estimator 'low-var-kl'.*'low_var_kl'"):
        losses.kl_penalty("low-var-kl", jnp.zeros(1), jnp.zeros(1))
    with pytest.raises(ValueError, match="Unknown policy loss 'gspo_token'.*'ppo'"):
        losses.policy_loss("gspo_token", *([jnp.zeros((1, 1))] * 4))


@pytest.mark.parametrize("mode", MODES)
def test_actor_objective_combines_terms_over_one_denominator(mode):
    logp, old, adv, mask = random_policy_batch(5)
    rng = np.random.default_rng(6)
    ent = rng.random(logp.shape) * 3
    ref_logp = logp + rng.normal(scale=0.3, size=logp.shape)
    w = (rng.random(logp.shape[0]) < 0.8).astype(float)
    pg, _ = ref.ppo(logp, old, adv, mask, 0.2, 0.28, 3.0)
    kl = np.vectorize(lambda a, b: ref.kl_token("low_var_kl", a, b))(logp, ref_logp)
    pg_num, den = ref.aggregate(pg, mask, mode, w)
    ent_num, _ = ref.aggregate(ent, mask, mode, w)
    kl_num, _ = ref.aggregate(kl, mask, mode, w)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    num, got_den, metrics = losses.actor_objective(
        f(logp), f(old), f(adv), jnp.asarray(mask), loss_agg_mode=mode, row_weights=f(w),
        entropy=f(ent), entropy_coeff=0.01, ref_logp=f(ref_logp), kl_type="low_var_kl", kl_coef=0.1)
    np.testing.assert_allclose(got_den, den, rtol=1e-5)
    np.testing.assert_allclose(num, pg_num - 0.01 * ent_num + 0.1 * kl_num, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["pg_loss"], pg_num / den, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], ent_num / den, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_loss"], kl_num / den, rtol=1e-4, atol=1e-6)


def test_critic_objective_matches_reference():
    rng = np.random.default_rng(13)
    v_old = rng.normal(size=(4, 7))
    v = v_old + rng.normal(scale=0.8, size=(4, 7))
    ret = rng.normal(size=(4, 7))
    mask = rng.random((4, 7)) < 0.7
    per_token, _ = ref.value_loss(v, v_old, ret, mask, 0.2)
    want = ref.aggregate(per_token, mask, "seq-mean-token-mean")
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    num, den, metrics = losses.critic_objective(f(v), f(v_old), f(ret), jnp.asarray(mask),
                                                loss_agg_mode="seq-mean-token-mean", cliprange_value=0.2)
    np.testing.assert_allclose([num, den], want, rtol=1e-5)
    np.testing.assert_allclose(metrics["vf_loss"], want[0] / want[1], rtol=1e-5)


def test_objective_missing_inputs_are_named():
    z = jnp.zeros((1, 2))
    m = jnp.ones((1, 2), bool)
    with pytest.raises(ValueError, match="entropy"):
        losses.actor_objective(z, z, z, m, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="ref_logp"):
        losses.actor_objective(z, z, z, m, kl_coef=0.1)


def test_shape_mismatches_are_named():
    with pytest.raises(ValueError, match=r"x \(2, 3\), mask \(2, 4\)"):
        losses.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 4)), "token-mean")
    with pytest.raises(ValueError, match="row_weights must be"):
        losses.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "token-mean", jnp.ones(3))
    with pytest.raises(ValueError, match="ppo_clip_loss.*advantages \\(1, 2\\)"):
        losses.ppo_clip_loss(jnp.zeros((2, 2)), jnp.zeros((2, 2)), jnp.zeros((1, 2)), jnp.ones((2, 2)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_decoupled_ppo_matches_the_papers_objective(seed, cap):
    """AReaL's decoupled objective against ``ref.decoupled_ppo`` (the paper's eq. 5 per token): loss,
    gradient in the current log-probs and the weight metrics, with behaviour log-probs drawn apart
    from the proximal ones (some weights above the cap)."""
    logp, prox, adv, mask = random_policy_batch(seed)
    rng = np.random.default_rng(100 + seed)
    behav = prox - rng.normal(scale=0.6, size=prox.shape)
    want, want_grad, want_w = ref.decoupled_ppo(logp, prox, behav, adv, mask, 0.2, 0.28, 3.0, cap)
    args = [jnp.asarray(a, jnp.float32) for a in (logp, prox, adv)]

    def total(lp):
        out, _ = losses.policy_loss("decoupled_ppo", lp, *args[1:], jnp.asarray(mask),
                                    behaviour_logp=jnp.asarray(behav, jnp.float32), clip_ratio_low=0.2,
                                    clip_ratio_high=0.28, clip_ratio_c=3.0, decoupled_weight_cap=cap)
        return out.sum(), out

    (_, got), grad = jax.value_and_grad(total, has_aux=True)(args[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-5)
    _, metrics = losses.policy_loss("decoupled_ppo", *args, jnp.asarray(mask),
                                    behaviour_logp=jnp.asarray(behav, jnp.float32), decoupled_weight_cap=cap)
    np.testing.assert_allclose(float(metrics["behaviour_weight_mean"]), want_w, rtol=1e-5)
    w = np.exp(prox - behav)[mask]
    np.testing.assert_allclose(float(metrics["behaviour_capped"]), np.mean(w > cap) if cap else 0.0, rtol=1e-6)
    assert (cap == 0.0) or 0 < float(metrics["behaviour_capped"]) < 1


def test_decoupled_ppo_on_a_synchronous_batch_is_ppo_and_names_its_missing_input():
    """Behaviour = proximal log-probs (a synchronous batch): every weight is 1 and the loss is PPO's."""
    logp, old, adv, mask = random_policy_batch(5)
    args = [jnp.asarray(a, jnp.float32) for a in (logp, old, adv)] + [jnp.asarray(mask)]
    got, metrics = losses.policy_loss("decoupled_ppo", *args, behaviour_logp=args[1])
    np.testing.assert_allclose(got, losses.policy_loss("ppo", *args)[0], rtol=1e-6, atol=1e-7)
    assert float(metrics["behaviour_weight_mean"]) == 1.0 and float(metrics["behaviour_capped"]) == 0.0
    with pytest.raises(ValueError, match="behaviour_logp"):
        losses.policy_loss("decoupled_ppo", *args)
