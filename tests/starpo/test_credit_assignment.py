"""The credit-assignment estimators (GiGPO, REINFORCE++ and its variants, ReMax, OPO, GPG, GRPO
pass@k) against NumPy re-derivations (``numpy_reference_credit``) and hand-worked cases.

Random batches come from seeded ``numpy.random.default_rng`` generators, so every run is identical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import advantages as adv_lib
from tests.starpo import numpy_reference_credit as cref
from tests.starpo.test_advantages import make_batch, to_jnp


def _run(name, rewards, mask, turn_ids=None, group_size=2, whiten=None, **extras):
    r, m = to_jnp(rewards, mask)
    t = None if turn_ids is None else jnp.asarray(turn_ids, jnp.int32)
    adv, ret = adv_lib.compute_advantages(name, r, None, m, t, group_size=group_size, whiten=whiten,
                                          gamma=extras.pop("gamma", 1.0), extras=extras)
    return np.asarray(adv, np.float64), np.asarray(ret, np.float64)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_verl_recursion(seed, gamma):
    rewards, _, mask, turn_ids = make_batch(np.random.default_rng(seed))
    # Rewards on several sampled tokens, as with KL-in-reward.
    rewards = rewards + np.where(mask, np.random.default_rng(seed + 10).normal(size=mask.shape) * 0.1, 0.0)
    adv, ret = _run("reinforce_plus_plus", rewards, mask, gamma=gamma)
    want_adv, want_ret = cref.reinforce_pp(rewards, mask, gamma)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    np.testing.assert_allclose(adv, want_adv, atol=1e-4)


def test_reinforce_plus_plus_resets_between_turns_but_multiturn_carries():
    """Hand-worked: two turns of two sampled tokens, an observation between, the episode score 2.0
    at the last token. verl's recursion leaves the first turn at 0; the multi-turn variant gives it
    the score (gamma = 1, unwhitened)."""
    mask = np.array([[False, True, True, False, True, True]])
    rewards = np.array([[0, 0, 0, 0, 0, 2.0]])
    _, ret = _run("reinforce_plus_plus", rewards, mask, group_size=1, whiten=False)
    np.testing.assert_allclose(ret[0], [0, 0, 0, 0, 2, 2])
    adv, ret = _run("reinforce_plus_plus_multiturn", rewards, mask, group_size=1, whiten=False)
    np.testing.assert_allclose(ret[0], [0, 2, 2, 0, 2, 2])
    adv, _ = _run("reinforce_plus_plus_multiturn", rewards, mask, group_size=1, gamma=0.5, whiten=False)
    np.testing.assert_allclose(adv[0], [0, 0.25, 0.5, 0, 1, 2])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_multiturn_matches_reference(seed, gamma):
    rewards, _, mask, _ = make_batch(np.random.default_rng(seed))
    adv, ret = _run("reinforce_plus_plus_multiturn", rewards, mask, gamma=gamma)
    want_adv, want_ret = cref.reinforce_pp_multiturn(rewards, mask, gamma)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    np.testing.assert_allclose(adv, want_adv, atol=1e-4)


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_reinforce_plus_plus_baseline_matches_reference(group_size):
    rewards, _, mask, _ = make_batch(np.random.default_rng(group_size), batch=6)
    adv, _ = _run("reinforce_plus_plus_baseline", rewards, mask, group_size=group_size)
    np.testing.assert_allclose(adv, cref.reinforce_pp_baseline(rewards, mask, group_size), atol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_remax_matches_reference_and_signs(seed):
    rng = np.random.default_rng(seed)
    rewards, _, mask, _ = make_batch(rng)
    baselines = rng.normal(size=rewards.shape[0])
    adv, ret = _run("remax", rewards, mask, reward_baselines=jnp.asarray(baselines, jnp.float32))
    want_adv, want_ret = cref.remax(rewards, mask, baselines)
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    # An episode that beat its greedy rollout is pushed up on every sampled token, one that lost down.
    scores = rewards.sum(1)
    beat = scores - baselines
    last = [np.flatnonzero(mask[b]).min() for b in range(len(scores)) if mask[b].any()]
    for b, t in zip([b for b in range(len(scores)) if mask[b].any()], last):
        if rewards[b, :t].sum() == 0 and abs(beat[b]) > 1e-3:
            assert np.sign(adv[b, t]) == np.sign(beat[b])


@pytest.mark.parametrize("group_size", [1, 2, 3])
def test_opo_matches_reference(group_size):
    rewards, _, mask, _ = make_batch(np.random.default_rng(5 + group_size), batch=6)
    adv, _ = _run("opo", rewards, mask, group_size=group_size)
    np.testing.assert_allclose(adv, cref.opo(rewards, mask, group_size), atol=1e-5)


def test_gpg_matches_reference_and_ignores_dropped_rows():
    rewards, _, mask, _ = make_batch(np.random.default_rng(7), batch=6)
    rewards[1] = 0.0  # a zero score: alpha = rows / non-zero rows > 1
    mask[4:] = False  # a group the filter dropped does not count in alpha
    adv, _ = _run("gpg", rewards, mask, group_size=2)
    np.testing.assert_allclose(adv, cref.gpg(rewards, mask, 2), atol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_reference(norm):
    rewards, _, mask, _ = make_batch(np.random.default_rng(11), batch=8)
    rewards[2], rewards[3] = 0.0, 0.0  # a tied group: the first row takes it, with gap 0
    adv, _ = _run("grpo_passk", rewards, mask, group_size=4, norm_adv_by_std=norm)
    np.testing.assert_allclose(adv, cref.grpo_passk(rewards, mask, 4, norm), atol=1e-4)
    with pytest.raises(ValueError, match="at least 2"):
        _run("grpo_passk", rewards, mask, group_size=1)


# --- GiGPO ------------------------------------------------------------------------------------


def _turn_batch(rng, batch, turns, n_states):
    """A transcript whose turn ``t`` holds a few sampled tokens with the turn's reward on the last,
    per-turn rewards / mask / anchor ids drawn from ``n_states`` observations (so anchors repeat)."""
    turn_mask = np.zeros((batch, turns), bool)
    for b in range(batch):
        turn_mask[b, :int(rng.integers(1, turns + 1))] = True
    turn_rewards = np.where(turn_mask, np.round(rng.normal(size=(batch, turns)), 1), 0.0)
    anchors = np.where(turn_mask, rng.integers(0, n_states, size=(batch, turns)), 0).astype(np.uint32)
    length = 2 + turns * 5
    mask = np.zeros((batch, length), bool)
    turn_ids = np.full((batch, length), -1)
    rewards = np.zeros((batch, length))
    for b in range(batch):
        for t in range(turns):
            if turn_mask[b, t]:
                start = 2 + 5 * t
                turn_ids[b, start:start + 5] = t
                mask[b, start + 1:start + 4] = True  # one observation token, three sampled, one close
                rewards[b, start + 3] = turn_rewards[b, t]
    return rewards, mask, turn_ids, turn_rewards, turn_mask, anchors


def _gigpo(rewards, mask, turn_ids, turn_rewards, turn_mask, anchors, group_size, **kw):
    return _run("gigpo", rewards, mask, turn_ids, group_size=group_size,
                turn_rewards=jnp.asarray(turn_rewards, jnp.float32), turn_mask=jnp.asarray(turn_mask),
                anchor_ids=jnp.asarray(anchors, jnp.uint32), **kw)[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("norm", ["mean", "std"])
@pytest.mark.parametrize("group_size", [1, 4])
def test_gigpo_matches_reference(seed, norm, group_size):
    rng = np.random.default_rng(seed)
    rewards, mask, turn_ids, turn_rewards, turn_mask, anchors = _turn_batch(rng, 8, 4, n_states=3)
    weight, gamma = 0.7, 0.9
    adv = _gigpo(rewards, mask, turn_ids, turn_rewards, turn_mask, anchors, group_size,
                 step_weight=weight, step_gamma=gamma, step_norm=norm)
    per_turn = cref.gigpo(rewards.sum(1), turn_rewards, turn_mask, anchors.tolist(), group_size, weight, gamma, norm)
    want = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        for p in range(rewards.shape[1]):
            if mask[b, p]:
                want[b, p] = per_turn[b, turn_ids[b, p]]
    np.testing.assert_allclose(adv, want, atol=1e-4)


def test_gigpo_hand_worked():
    """One group of two episodes on a board. Episode 0 visits states A, B and scores 1 (reward at its
    second turn); episode 1 visits A, C and scores 0. gamma = 1, mean norm, weight 1.

    Episode term, each episode counted once per turn: scores [1, 1, 0, 0], mean 0.5 -> +0.5, -0.5.
    Step term: turn 0 of both is state A with returns 1 and 0 (mean 0.5) -> +0.5, -0.5; the second
    turns (B, C) are alone in their anchor groups -> 0.
    """
    turn_rewards = np.array([[0.0, 1.0], [0.0, 0.0]])
    turn_mask = np.ones((2, 2), bool)
    anchors = np.array([[7, 8], [7, 9]], np.uint32)
    rewards = np.zeros((2, 12))
    mask = np.zeros((2, 12), bool)
    turn_ids = np.full((2, 12), -1)
    for b in range(2):
        for t in range(2):
            turn_ids[b, 2 + 5 * t:7 + 5 * t] = t
            mask[b, 3 + 5 * t:6 + 5 * t] = True
            rewards[b, 5 + 5 * t] = turn_rewards[b, t]
    adv = _gigpo(rewards, mask, turn_ids, turn_rewards, turn_mask, anchors, 2, step_weight=1.0, step_gamma=1.0,
                 step_norm="mean")
    np.testing.assert_allclose(adv[0, 3:6], 1.0)  # 0.5 + 0.5
    np.testing.assert_allclose(adv[0, 8:11], 0.5)
    np.testing.assert_allclose(adv[1, 3:6], -1.0)
    np.testing.assert_allclose(adv[1, 8:11], -0.5)
    assert np.all(adv[~mask] == 0)
    stats = adv_lib.anchor_group_stats(jnp.asarray(anchors), jnp.asarray(turn_mask), 2)
    assert float(stats["shared_turn_fraction"]) == pytest.approx(0.5)  # the two A turns
    assert float(stats["mean_group_size"]) == pytest.approx(4 / 3)  # {A, A}, {B}, {C}


def test_gigpo_without_repeated_states_is_the_per_turn_weighted_grpo():
    """With every anchor distinct the step term vanishes: what is left is the episode term."""
    rng = np.random.default_rng(3)
    rewards, mask, turn_ids, turn_rewards, turn_mask, _ = _turn_batch(rng, 4, 3, n_states=1)
    anchors = np.arange(12, dtype=np.uint32).reshape(4, 3)
    adv = _gigpo(rewards, mask, turn_ids, turn_rewards, turn_mask, anchors, 4, step_weight=5.0, step_gamma=1.0,
                 step_norm="mean")
    scores, counts = rewards.sum(1), turn_mask.sum(1)
    mu = (scores * counts).sum() / counts.sum()
    for b in range(4):
        np.testing.assert_allclose(adv[b][mask[b]], scores[b] - mu, atol=1e-5)


def test_gigpo_is_jittable_and_names_missing_inputs():
    rng = np.random.default_rng(0)
    rewards, mask, turn_ids, turn_rewards, turn_mask, anchors = _turn_batch(rng, 4, 3, n_states=2)
    r, m = to_jnp(rewards, mask)
    fn = jax.jit(lambda r, m, t, tr, tm, a: adv_lib.compute_advantages(
        "gigpo", r, None, m, t, group_size=2, extras=dict(turn_rewards=tr, turn_mask=tm, anchor_ids=a))[0])
    out = fn(r, m, jnp.asarray(turn_ids), jnp.asarray(turn_rewards, jnp.float32), jnp.asarray(turn_mask),
             jnp.asarray(anchors))
    assert np.all(np.isfinite(np.asarray(out)))
    with pytest.raises(ValueError, match="anchor_ids"):
        adv_lib.compute_advantages("gigpo", r, None, m, jnp.asarray(turn_ids), group_size=2,
                                   extras=dict(turn_rewards=jnp.asarray(turn_rewards), turn_mask=jnp.asarray(turn_mask)))
    with pytest.raises(ValueError, match="greedy_baseline"):
        adv_lib.compute_advantages("remax", r, None, m, group_size=2)


@pytest.mark.parametrize("name", ["gigpo", "reinforce_plus_plus", "reinforce_plus_plus_multiturn",
                                  "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk"])
def test_better_episodes_get_positive_advantages(name):
    """Hand-made batch: one group of two one-turn episodes, the first scoring 1, the second 0, from
    the same state; ReMax's greedy baseline 0.5. The winner's tokens go up, the loser's down (or
    stay at 0 where the estimator only moves the best, as pass@k does)."""
    rewards = np.zeros((2, 6))
    rewards[0, 4] = 1.0
    mask = np.zeros((2, 6), bool)
    mask[:, 2:5] = True
    turn_ids = np.where(np.arange(6)[None] >= 1, 0, -1).repeat(2, 0)
    extras = dict(turn_rewards=jnp.asarray([[1.0], [0.0]]), turn_mask=jnp.ones((2, 1), bool),
                  anchor_ids=jnp.zeros((2, 1), jnp.uint32), reward_baselines=jnp.asarray([0.5, 0.5]))
    adv, _ = _run(name, rewards, mask, turn_ids, group_size=2, **extras)
    assert np.all(adv[0, 2:5] > 0)
    if name == "grpo_passk":
        assert np.all(adv[1] == 0)
    else:
        assert np.all(adv[1, 2:5] < 0)


# --- policy losses ------------------------------------------------------------------------------

from ragen_jax.starpo import losses  # noqa: E402


def _policy_batch(seed, batch=5, length=9):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(batch, length))
    old = logp - rng.normal(scale=0.3, size=(batch, length))
    adv = rng.normal(scale=1.5, size=(batch, length))
    mask = rng.random((batch, length)) < 0.7
    mask[:, 0] = False
    mask[-1] = False
    return logp, old, adv, mask


def _f(*arrays):
    return [jnp.asarray(a, jnp.float32) if a.dtype.kind == "f" else jnp.asarray(a) for a in arrays]


@pytest.mark.parametrize("seed", range(3))
def test_gspo_loss_and_gradient_match_reference(seed):
    logp, old, adv, mask = _policy_batch(seed)
    # One sequence far off-policy so the sequence ratio leaves the clip range.
    old[0] = logp[0] - 0.8
    want_loss, want_grad, want_clip = cref.gspo(logp, old, adv, mask, 0.2, 0.28)
    lp, o, a, m = _f(logp, old, adv, mask)
    got, metrics = losses.policy_loss("gspo", lp, o, a, m, clip_ratio_low=0.2, clip_ratio_high=0.28)
    np.testing.assert_allclose(got, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["pg_clipfrac"], want_clip, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(losses.policy_loss("gspo", x, o, a, m)[0]))(lp)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert losses.loss_aggregation("gspo", "token-mean") == "seq-mean-token-mean"


@pytest.mark.parametrize("seed", range(3))
def test_geo_mean_sequence_losses_match_reference(seed):
    logp, old, adv, mask = _policy_batch(seed)
    old[1] = logp[1] - 0.5  # clipped tokens on both sides of the advantage's sign
    num, den, _ = losses.actor_objective(*_f(logp, old, adv, mask), loss_agg_mode="token-mean",
                                         policy_loss_name="geo_mean")
    rows = cref.gmpo_rows(logp, old, adv, mask, 0.2, 0.28)
    np.testing.assert_allclose(num / den, np.mean(rows), rtol=1e-5)


def test_gpg_loss_is_the_plain_policy_gradient():
    logp, old, adv, mask = _policy_batch(4)
    lp, o, a, m = _f(logp, old, adv, mask)
    got, _ = losses.policy_loss("gpg", lp, o, a, m)
    np.testing.assert_allclose(got, np.where(mask, -adv * logp, 0.0), rtol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_kl_cov_matches_reference(seed):
    logp, old, adv, mask = _policy_batch(seed, batch=8, length=20)
    lp, o, a, m = _f(logp, old, adv, mask)
    got, metrics = losses.policy_loss("kl_cov", lp, o, a, m, kl_cov_ratio=0.05, ppo_kl_coef=2.0)
    np.testing.assert_allclose(got, cref.kl_cov(logp, old, adv, mask, 0.05, 2.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["ppo_kl"], np.abs(logp - old)[mask].mean(), rtol=1e-5)


def test_clip_cov_cuts_the_drawn_candidates_only():
    logp, old, adv, mask = _policy_batch(2, batch=8, length=30)
    adv = adv * 3  # covariances above the lower bound
    want, cands, toks = cref.clip_cov_candidates(logp, old, adv, mask, 0.2, 0.28, 0.5, 5.0)
    assert len(cands) >= 3
    n_clip = max(int(0.02 * len(toks)), 1)
    noise = np.random.default_rng(0).random(mask.shape)
    drawn = sorted(cands, key=lambda p: noise[p])[:n_clip]
    for p in drawn:
        want[p] = 0.0
    lp, o, a, m = _f(logp, old, adv, mask)
    got, metrics = losses.policy_loss("clip_cov", lp, o, a, m, clip_cov_ratio=0.02, clip_cov_lb=0.5, clip_cov_ub=5.0,
                                      noise=jnp.asarray(noise, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["pg_clipfrac"], len(drawn) / len(toks), rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "none"])
def test_rollout_correction_matches_reference(level):
    logp, old, adv, mask = _policy_batch(6)
    old[2, :] = logp[2, :] - 0.5  # weights above the threshold, truncated
    want_loss, want_grad = cref.rollout_correction(logp, old, adv, mask, level, 1.5)
    lp, o, a, m = _f(logp, old, adv, mask)
    fn = lambda x: losses.policy_loss("rollout_correction", x, o, a, m, rollout_is=level,  # noqa: E731
                                      rollout_is_threshold=1.5)
    np.testing.assert_allclose(fn(lp)[0], want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(fn(x)[0]))(lp), want_grad, rtol=1e-5, atol=1e-6)
    # Rejection: the off-policy row's tokens (ratio e^0.5 > 1.2) are dropped.
    got, metrics = losses.policy_loss("rollout_correction", lp, o, a, m, rollout_rs="token", rollout_rs_threshold=1.2,
                                      rollout_rs_threshold_lower=0.0)
    assert np.all(np.asarray(got)[2] == 0) and float(metrics["pg_clipfrac_lower"]) > 0


@pytest.mark.parametrize("name", losses.POLICY_LOSSES.names())
def test_every_policy_loss_moves_towards_positive_advantages(name):
    """On-policy (ratio 1), a positive advantage on a token must raise its log-prob: the gradient
    of the aggregated loss with respect to that log-prob is negative, and positive for A < 0."""
    logp = jnp.asarray([[-1.0, -2.0], [-0.5, -1.5]])
    adv = jnp.asarray([[1.0, 1.0], [-1.0, -1.0]])  # one advantage per sequence, as GMPO assumes
    mask = jnp.ones((2, 2), bool)
    # On-policy the behaviour policy is the proximal one (what a loss reading it gets from the update).
    extra = {"behaviour_logp": logp} if losses.uses_behaviour_logp(name) else {}
    grad = jax.grad(lambda x: losses.actor_objective(x, logp, adv, mask, policy_loss_name=name, **extra)[0])(logp)
    np.testing.assert_array_less(grad[0], 0.0)
    np.testing.assert_array_less(0.0, grad[1])


def test_rollout_rejection_leaves_the_denominator_hand_worked():
    """Four tokens, the third's ratio 3 above the rejection threshold 2: the kept three give
    token-mean ((1 + 1 + 1) / 3 = 1.0, not 3 / 4 as with the rejected token still counted), and
    ppo_kl is measured on the kept tokens (0, not -ln 3 / 4)."""
    logp = jnp.full((1, 4), -1.0)
    old = logp - jnp.asarray([[0.0, 0.0, np.log(3.0), 0.0]])
    adv, mask = jnp.ones((1, 4)), jnp.ones((1, 4), bool)
    num, den, metrics = losses.actor_objective(logp, old, adv, mask, policy_loss_name="rollout_correction",
                                               rollout_rs="token", rollout_rs_threshold=2.0,
                                               rollout_rs_threshold_lower=0.5)
    np.testing.assert_allclose(float(num / den), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["pg_loss"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ppo_kl"]), 0.0, atol=1e-7)
    np.testing.assert_allclose(float(metrics["pg_clipfrac_lower"]), 0.25, rtol=1e-6)


VERL_CASES = [
    dict(rollout_is="token"),
    dict(rollout_is="sequence", is_threshold=5.0),
    dict(rollout_is=None),
    dict(rollout_is="token", rollout_rs="token", rs_upper=1.3, rs_lower=0.8),
    dict(rollout_is="token", rollout_rs="sequence", rs_upper=2.0),
    dict(rollout_is="token", rollout_rs="geometric", rs_upper=1.1, rs_lower=0.9),
    dict(rollout_is="token", veto=0.6),
    dict(rollout_is="token", batch_normalize=True, rollout_rs="token", rs_upper=1.5, rs_lower=0.7),
    dict(rollout_is="sequence", batch_normalize=True, veto=0.5, loss_agg_mode="seq-mean-token-mean"),
    dict(rollout_is="token", rollout_rs="token", rs_upper=1.2, rs_lower=0.8, loss_agg_mode="seq-mean-token-sum"),
]


@pytest.mark.parametrize("case", range(len(VERL_CASES)))
def test_rollout_correction_agrees_with_verl_bypass_reinforce(case):
    """Loss, gradient and ppo_kl against a NumPy re-derivation of verl v0.7's bypass-mode REINFORCE
    with rollout correction (IS levels, rejection at token / sequence / geometric level with its
    bounds, the veto of catastrophic tokens, batch-normalised weights, three aggregations)."""
    cfg = dict(VERL_CASES[case])
    logp, old, adv, mask = _policy_batch(case, batch=6, length=8)
    old[1] = logp[1] - 0.9  # one sequence far off-policy either way
    old[2] = logp[2] + 0.9
    mode = cfg.pop("loss_agg_mode", "token-mean")
    want_loss, want_grad, want_kl, effective = cref.verl_bypass_reinforce(logp, old, adv, mask, loss_agg_mode=mode,
                                                                         **cfg)
    ours = dict(rollout_is=cfg.get("rollout_is") or "none", rollout_is_threshold=cfg.get("is_threshold", 2.0),
                rollout_is_batch_normalize=cfg.get("batch_normalize", False),
                rollout_rs=cfg.get("rollout_rs") or "none", rollout_rs_threshold=cfg.get("rs_upper", 2.0),
                rollout_rs_threshold_lower=cfg.get("rs_lower") or 1.0 / cfg.get("rs_upper", 2.0),
                rollout_token_veto_threshold=cfg.get("veto") or 0.0)
    lp, o, a, m = _f(logp, old, adv, mask)

    def objective(x):
        num, den, metrics = losses.actor_objective(x, o, a, m, loss_agg_mode=mode,
                                                   policy_loss_name="rollout_correction", **ours)
        return num / den, metrics

    got, metrics = objective(lp)
    np.testing.assert_allclose(float(got), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: objective(x)[0])(lp), want_grad, rtol=2e-3, atol=2e-5)
    np.testing.assert_allclose(float(metrics["ppo_kl"]), want_kl, rtol=1e-5, atol=1e-6)
    rejected = 1.0 - effective.sum() / mask.sum()
    np.testing.assert_allclose(float(metrics["pg_clipfrac_lower"]), rejected, rtol=1e-6, atol=1e-7)
    if cfg.get("rollout_rs") or cfg.get("veto"):
        assert 0 < rejected < 1  # the case exercises rejection


def test_rollout_correction_settings_are_checked():
    from ragen_jax.config import StarPOConfig

    with pytest.raises(ValueError, match="rollout_rs='geo'; allowed: token, sequence, geometric, none"):
        StarPOConfig(policy_loss="rollout_correction", rollout_rs="geo")
    with pytest.raises(ValueError, match="rollout_is='geometric'; allowed: token, sequence, none"):
        StarPOConfig(policy_loss="rollout_correction", rollout_is="geometric")
    assert StarPOConfig().ppo_kl_coef == 0.1  # verl's PolicyLossConfig default


def test_similar_observations_group_hand_worked():
    """Pieces [1,2,3,4] and [1,2,3,5] match with ratio 2*3/8 = 0.75: one cluster at threshold 0.7,
    two at 0.8; [9,8,7,6] is alone either way; a missing turn gets -1; groups never share ids."""
    obs = np.zeros((4, 2, 4), np.int32)
    obs[0, 0], obs[0, 1], obs[1, 0] = [1, 2, 3, 4], [9, 8, 7, 6], [1, 2, 3, 5]
    obs[2, 0], obs[3, 0] = [1, 2, 3, 4], [1, 2, 3, 4]
    lens = np.full((4, 2), 4)
    mask = np.array([[True, True], [True, False], [True, False], [True, False]])
    ids = adv_lib.cluster_similar_observations(obs, lens, mask, group_size=2, threshold=0.7)
    assert ids[0, 0] == ids[1, 0] != ids[0, 1] and ids[1, 1] == -1
    assert ids[2, 0] == ids[3, 0] and ids[2, 0] not in (ids[0, 0], ids[0, 1])
    strict = adv_lib.cluster_similar_observations(obs, lens, mask, group_size=2, threshold=0.8)
    assert len({strict[0, 0], strict[1, 0], strict[0, 1]}) == 3


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.95])
def test_similarity_grouping_agrees_with_verl_agent(seed, threshold):
    """The same partition as a re-derivation of verl-agent's ``build_step_group`` run on text whose
    characters stand one-to-one for the pieces; then GiGPO's advantages on those groups equal the
    reference GiGPO's with verl-agent's step-group uids as anchors (jitted, through the callback)."""
    rng = np.random.default_rng(seed)
    B, T, P, group_size = 8, 3, 12, 4
    rewards, mask, turn_ids, turn_rewards, turn_mask, _ = _turn_batch(rng, B, T, n_states=3)
    base = rng.integers(0, 6, size=(B // group_size, P))
    obs = np.repeat(base, group_size * T, axis=0).reshape(B, T, P)
    flip = rng.random((B, T, P)) < 0.25  # each observation a noisy copy of its group's board
    obs = np.where(flip, rng.integers(0, 6, size=(B, T, P)), obs).astype(np.int32)
    lens = rng.integers(P - 3, P + 1, size=(B, T))
    ours = adv_lib.cluster_similar_observations(obs, lens, turn_mask, group_size, threshold)
    locs = [(b, t) for b in range(B) for t in range(T) if turn_mask[b, t]]
    text = ["".join(chr(65 + int(x)) for x in obs[b, t, :lens[b, t]]) for b, t in locs]
    theirs = cref.verl_agent_build_step_group(text, [b // group_size for b, _ in locs], threshold)
    pairs = [(i, j) for i in range(len(locs)) for j in range(len(locs))]
    assert all((ours[locs[i]] == ours[locs[j]]) == (theirs[i] == theirs[j]) for i, j in pairs)
    assert 1 < len(set(theirs)) < len(locs) or threshold == 0.95  # the case has shared and split groups

    turn_mask_j = jnp.asarray(turn_mask)
    ids = jax.jit(lambda o, n, m: adv_lib.similar_observation_groups(o, n, m, group_size, threshold))(
        jnp.asarray(obs), jnp.asarray(lens, jnp.int32), turn_mask_j)
    np.testing.assert_array_equal(np.asarray(ids), ours)
    adv = _gigpo(rewards, mask, turn_ids, turn_rewards, turn_mask, np.asarray(ids), group_size,
                 step_weight=1.0, step_gamma=0.95, step_norm="mean")
    anchors = [[None] * T for _ in range(B)]
    for (b, t), uid in zip(locs, theirs):
        anchors[b][t] = uid
    per_turn = cref.gigpo(rewards.sum(1), turn_rewards, turn_mask, anchors, group_size, 1.0, 0.95, "mean")
    want = np.where(mask, np.take_along_axis(per_turn, np.clip(turn_ids, 0, T - 1), axis=1), 0.0)
    np.testing.assert_allclose(adv, want, atol=1e-4)


def test_similarity_grouping_settings_are_checked():
    from ragen_jax.config import StarPOConfig

    with pytest.raises(ValueError, match=r"gigpo_similarity_thresh must be in \(0, 1\)"):
        StarPOConfig(adv_estimator="gigpo", gigpo_enable_similarity=True, gigpo_similarity_thresh=1.0)
    StarPOConfig(adv_estimator="gigpo", gigpo_enable_similarity=True, gigpo_similarity_thresh=0.9)
