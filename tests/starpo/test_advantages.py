"""Advantage estimators and score normalisation against NumPy re-derivations and hand-worked cases.

Random batches come from seeded ``numpy.random.default_rng`` generators, so every run is identical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import advantages as adv_lib
from tests.starpo import numpy_reference as ref


def make_batch(rng, batch=6, length=40, max_turns=3):
    """Trajectory-like arrays: preamble, turns of sampled tokens separated by observations, padding.

    Returns float64 numpy arrays: token_rewards, values, loss_mask (bool), turn_ids (int).
    """
    mask = np.zeros((batch, length), bool)
    turn_ids = np.full((batch, length), -1, np.int64)
    rewards = np.zeros((batch, length))
    for b in range(batch):
        t = int(rng.integers(1, 4))  # preamble
        for k in range(int(rng.integers(1, max_turns + 1))):
            obs = int(rng.integers(1, 4))
            turn_ids[b, t:t + obs] = k
            t += obs
            n = int(rng.integers(1, 6))
            if t + n > length:
                break
            mask[b, t:t + n] = True
            turn_ids[b, t:t + n] = k
            # Some turns get exactly zero reward (the case the original bi-level GAE crashes on).
            rewards[b, t + n - 1] = 0.0 if rng.random() < 0.3 else rng.normal()
            t += n
    values = rng.normal(size=(batch, length))
    return rewards, values, mask, turn_ids


def to_jnp(*arrays):
    return [jnp.asarray(a, jnp.float32) if a.dtype != bool and a.dtype.kind == "f" else jnp.asarray(a)
            for a in arrays]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_reference(seed, gamma, lam):
    rng = np.random.default_rng(seed)
    r, v, m, tid = make_batch(rng)
    # Also put rewards on sampled tokens that are not turn ends: plain GAE must credit them too.
    r = r + np.where(m & (rng.random(m.shape) < 0.1), rng.normal(size=m.shape), 0.0)
    want_a, want_ret = ref.gae(r, v, m, gamma, lam)
    got_a, got_ret = adv_lib.gae(*to_jnp(r, v, m), gamma=gamma, lam=lam)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ret, want_ret, rtol=1e-5, atol=1e-5)


def test_gae_gamma_lambda_one_terminal_reward():
    """gamma = lam = 1 with one terminal reward R: A_t = R - V_t and returns_t = R on sampled tokens."""
    rng = np.random.default_rng(7)
    _, v, m, _ = make_batch(rng, batch=5)
    R = rng.normal(size=5)
    last = np.array([np.nonzero(m[b])[0][-1] for b in range(5)])
    r = np.zeros_like(v)
    r[np.arange(5), last] = R
    got_a, got_ret = adv_lib.gae(*to_jnp(r, v, m), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(got_a, (R[:, None] - v) * m, atol=1e-5)
    np.testing.assert_allclose(got_ret, R[:, None] * m, atol=1e-5)


def test_gae_skips_observation_tokens():
    """Masked-carry rule: observation values must not leak into the recursion (hand-worked)."""
    #        t:  0    1    2    3     4    5
    mask = np.array([[0, 1, 0, 0, 1, 0]], bool)
    v = np.array([[9.0, 0.5, 7.0, 8.0, 0.25, 6.0]])
    r = np.array([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    gamma, lam = 0.5, 0.5
    # t=4: delta = 1 - 0.25 = 0.75 -> A4 = 0.75.  t=1: delta = 0 + 0.5*0.25 - 0.5 = -0.375,
    # A1 = -0.375 + 0.25*0.75 = -0.1875.
    a, ret = adv_lib.gae(*to_jnp(r, v, mask), gamma=gamma, lam=lam)
    np.testing.assert_allclose(a, [[0, -0.1875, 0, 0, 0.75, 0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0, 0.3125, 0, 0, 1.0, 0]], atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam,high", [(1.0, 1.0, 0.95), (0.99, 0.9, 0.8)])
def test_bilevel_gae_matches_reference(seed, gamma, lam, high):
    rng = np.random.default_rng(100 + seed)
    r, v, m, tid = make_batch(rng, max_turns=4)
    want_a, want_ret = ref.bilevel_gae(r, v, m, tid, gamma, lam, high)
    got_a, got_ret = adv_lib.bilevel_gae(*to_jnp(r, v, m, tid), gamma=gamma, lam=lam,
                                         high_level_gamma=high)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ret, want_ret, rtol=1e-5, atol=1e-5)


def test_bilevel_gae_hand_worked_two_turns():
    """Two turns, gamma = lam = 1, gamma_H = 0.5 (worked on paper in the comments)."""
    # t:        0   1    2    3   4   5    6    7
    mask = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
    turn_ids = np.array([[-1, 0, 0, 1, 1, 1, 1, -1]])
    r = np.array([[0, 0, 1.0, 0, 0, 0, 2.0, 0]])
    v = np.array([[0, 0.5, 0.4, 0, 0, 0.3, 0.2, 0]])
    # High level: turn 2: delta = 2 - 0.2 = 1.8 = A^H_2, G_2 = 2.0.
    #             turn 1: delta = 1 + 0.5*0.2 - 0.4 = 0.7, A^H_1 = 0.7 + 0.5*1.8 = 1.6, G_1 = 2.0.
    # Low level:  A_6 = 1.8, A_5 = 0.2 - 0.3 + 1.8 = 1.7, A_2 = 1.6, A_1 = 0.4 - 0.5 + 1.6 = 1.5.
    a, ret = adv_lib.bilevel_gae(*to_jnp(r, v, mask, turn_ids), gamma=1.0, lam=1.0,
                                 high_level_gamma=0.5)
    np.testing.assert_allclose(a, [[0, 1.5, 1.6, 0, 0, 1.7, 1.8, 0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0, 2.0, 2.0, 0, 0, 2.0, 2.0, 0]], atol=1e-6)


def test_bilevel_gae_zero_reward_rows_and_empty_rows():
    """All-zero rewards and rows without sampled tokens are fine (the original crashes on these)."""
    mask = np.array([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], bool)
    turn_ids = np.array([[-1, 0, 0, 1, 1], [-1, -1, -1, -1, -1]])
    r = np.zeros((2, 5))
    v = np.array([[0, 0.1, 0.2, 0, 0.3], [0, 0, 0, 0, 0]])
    got_a, got_ret = adv_lib.bilevel_gae(*to_jnp(r, v, mask, turn_ids), gamma=1.0, lam=1.0,
                                         high_level_gamma=0.95)
    want_a, want_ret = ref.bilevel_gae(r, v, mask, turn_ids, 1.0, 1.0, 0.95)
    assert np.all(np.isfinite(got_a))
    np.testing.assert_allclose(got_a, want_a, atol=1e-6)
    np.testing.assert_allclose(got_ret, want_ret, atol=1e-6)


@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("name,scale", [("grpo", True), ("drgrpo", False)])
def test_grpo_family_matches_reference(group_size, name, scale):
    rng = np.random.default_rng(group_size)
    r, _, m, _ = make_batch(rng, batch=8)
    est = adv_lib.ADVANTAGE_ESTIMATORS.get(name)
    got_a, got_ret = est.fn(*to_jnp(r), None, jnp.asarray(m), group_size=group_size)
    want_a, want_ret = ref.grpo(r, m, group_size, scale_by_std=scale)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ret, want_ret, rtol=1e-5, atol=1e-5)


def test_grpo_worked_example():
    """Group scores [1, 0, 0, 1]: mean 0.5, unbiased std 1/sqrt(3)."""
    r = np.zeros((4, 3))
    r[:, 2] = [1, 0, 0, 1]
    m = np.ones((4, 3), bool)
    a, _ = adv_lib.grpo(*to_jnp(r), None, jnp.asarray(m), group_size=4)
    z = 0.5 / (1 / np.sqrt(3) + 1e-6)
    np.testing.assert_allclose(a[:, 0], [z, -z, -z, z], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae", "grpo", "drgrpo"])
@pytest.mark.parametrize("whiten", [None, True, False])
@pytest.mark.parametrize("length_weight", [False, True])
def test_compute_advantages_postprocessing(estimator, whiten, length_weight):
    rng = np.random.default_rng(11)
    r, v, m, tid = make_batch(rng, batch=8)
    if estimator == "gae":
        base, ret = ref.gae(r, v, m, 0.99, 0.95)
    elif estimator == "bilevel_gae":
        base, ret = ref.bilevel_gae(r, v, m, tid, 0.99, 0.95, 0.9)
    else:
        base, ret = ref.grpo(r, m, 4, scale_by_std=estimator == "grpo")
    do_whiten = estimator in ("gae", "bilevel_gae") if whiten is None else whiten
    want = ref.whiten(base, m) if do_whiten else base
    if length_weight:
        want = ref.length_weight(want, m)
    got, got_ret = adv_lib.compute_advantages(
        estimator, *to_jnp(r, v, m, tid), group_size=4, gamma=0.99, lam=0.95,
        high_level_gamma=0.9, whiten=whiten, grpo_length_weight=length_weight)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_ret, ret, rtol=1e-5, atol=1e-5)


def test_length_weight_ignores_rows_the_filter_dropped():
    """Kept rows get the same weights as in a batch of only the kept rows (lengths 2 and 4 -> mean 3)."""
    adv = jnp.ones((4, 5))
    mask = jnp.asarray([[1, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 1, 0], [0] * 5], bool)
    got = adv_lib.length_weight(adv, mask)
    np.testing.assert_allclose(np.asarray(got)[[0, 2], 0], [3 / (2 + 1e-6), 3 / (4 + 1e-6)], rtol=1e-6)
    kept_only = adv_lib.length_weight(adv[jnp.asarray([0, 2])], mask[jnp.asarray([0, 2])])
    np.testing.assert_allclose(np.asarray(got)[[0, 2]], np.asarray(kept_only), rtol=1e-6)


def test_compute_advantages_is_jittable():
    rng = np.random.default_rng(3)
    r, v, m, tid = to_jnp(*make_batch(rng, batch=4))
    fn = jax.jit(lambda r, v, m, tid: adv_lib.compute_advantages(
        "bilevel_gae", r, v, m, tid, group_size=2))
    a, _ = fn(r, v, m, tid)
    b, _ = adv_lib.compute_advantages("bilevel_gae", r, v, m, tid, group_size=2)
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("method", ["identity", "mean", "mean_std", "asym_clip"])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_normalize_scores_matches_reference(method, group_size):
    rng = np.random.default_rng(5)
    scores = rng.normal(size=8) * 3
    scores[4:8] = 2.5  # one constant group (std 0 -> zeros for mean_std) when group_size == 4
    got = adv_lib.normalize_scores(jnp.asarray(scores, jnp.float32), method=method,
                                   group_size=group_size)
    np.testing.assert_allclose(got, ref.normalize_scores(scores, method, group_size),
                               rtol=1e-5, atol=1e-5)
    got_batch = adv_lib.normalize_scores(jnp.asarray(scores, jnp.float32), method=method,
                                         group_size=group_size, grouping="batch")
    np.testing.assert_allclose(got_batch, ref.normalize_scores(scores, method, 8),
                               rtol=1e-5, atol=1e-5)


def test_place_at_last_token_and_align():
    m = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
    out = adv_lib.place_at_last_token(jnp.array([3.0, 4.0]), jnp.asarray(m))
    np.testing.assert_array_equal(out, [[0, 0, 0, 0, 3.0, 0], [0] * 6])
    x = jnp.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(adv_lib.align_to_targets(x), [[0, 0, 1, 2, 3, 4], [0, 6, 7, 8, 9, 10]])


def test_errors_name_the_problem():
    r = jnp.zeros((6, 4))
    m = jnp.ones((6, 4), bool)
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'.*'gae'"):
        adv_lib.compute_advantages("ppo", r, r, m, group_size=2)
    with pytest.raises(ValueError, match="not a whole number of groups"):
        adv_lib.compute_advantages("grpo", r, None, m, group_size=4)
    with pytest.raises(ValueError, match="uses a critic"):
        adv_lib.compute_advantages("gae", r, None, m, group_size=2)
    with pytest.raises(ValueError, match="turn_ids"):
        adv_lib.compute_advantages("bilevel_gae", r, r, m, group_size=2)
    with pytest.raises(ValueError, match="Unknown reward normalization 'zscore'"):
        adv_lib.normalize_scores(r[:, 0], method="zscore", group_size=2)


def test_rewards_off_the_loss_mask_are_ignored_by_gae():
    rng = np.random.default_rng(17)
    r, v, m, tid = make_batch(rng)
    stray = np.where(~m & (rng.random(m.shape) < 0.3), rng.normal(size=m.shape), 0.0)
    for fn, extra in ((adv_lib.gae, {}), (adv_lib.bilevel_gae, {"turn_ids": jnp.asarray(tid)})):
        a0, _ = fn(*to_jnp(r, v, m), **extra)
        a1, _ = fn(*to_jnp(r + stray, v, m), **extra)
        np.testing.assert_allclose(a1, a0, atol=1e-6)


@pytest.mark.parametrize("estimator", adv_lib.ADVANTAGE_ESTIMATORS.names())
def test_empty_mask_gives_finite_zeros(estimator):
    """A batch the filter emptied (mask all False) must not produce NaN/inf anywhere."""
    r = jnp.ones((4, 6))
    m = jnp.zeros((4, 6), bool)
    tid = jnp.zeros((4, 6), jnp.int32)
    extras = dict(turn_rewards=jnp.ones((4, 2)), turn_mask=jnp.zeros((4, 2), bool),
                  anchor_ids=jnp.zeros((4, 2), jnp.uint32), reward_baselines=jnp.ones(4))
    a, ret = adv_lib.compute_advantages(estimator, r, r, m, tid, group_size=2, whiten=True,
                                        grpo_length_weight=estimator.startswith(("grpo", "dr")), extras=extras)
    assert np.all(np.asarray(a) == 0) and np.all(np.asarray(ret) == 0)


def test_registry_behaviour():
    from ragen_jax.registry import Registry

    reg = Registry("widget")
    reg.register("a", "alias_a")(len)
    reg.add("b", max)
    assert reg.names() == ("a", "alias_a", "b") and "alias_a" in reg and reg.get("alias_a") is len
    assert reg.validate("b") == "b" and len(reg) == 3
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", min)
    with pytest.raises(ValueError, match=r"Unknown widget 'c'. Allowed values: 'a', 'alias_a', 'b'"):
        reg.get("c")
    with pytest.raises(ValueError, match="Unknown widget"):
        reg.get(["unhashable"])


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_rloo_matches_leave_one_out_reference(group_size):
    rng = np.random.default_rng(40 + group_size)
    r, _, m, _ = make_batch(rng, batch=8)
    got, got_ret = adv_lib.compute_advantages("rloo", *to_jnp(r), None, jnp.asarray(m), group_size=group_size)
    want, _ = ref.rloo(r, m, group_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_ret, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 4])
def test_soft_advantage_weights(group_size):
    scores = np.random.default_rng(44).normal(size=8) * 2
    scores[:4] = 1.5 if group_size == 4 else scores[:4]  # a zero-std group gets weight 0
    got = adv_lib.soft_advantage_weights(jnp.asarray(scores, jnp.float32), group_size)
    np.testing.assert_allclose(got, ref.soft_advantage_weights(scores, group_size), rtol=1e-5, atol=1e-6)
