"""SNR-adaptive rollout filter against hand-worked examples of RAGEN's filter and a loop-based reference.

Random batches come from seeded ``numpy.random.default_rng`` generators (reproducible runs).
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import snr_filter
from tests.starpo import numpy_reference as ref


def filter_on_stds(stds, **kwargs):
    """Runs the filter with episode scores built so each group's std is exactly ``stds[g]``.

    Group of 2 rows (m - a, m + a) has unbiased std a * sqrt(2); we pick a = std / sqrt(2).
    """
    rows = []
    for s in stds:
        a = s / np.sqrt(2.0)
        rows += [1.0 - a, 1.0 + a]
    return snr_filter.rollout_filter(group_size=2, episode_scores=jnp.asarray(rows, jnp.float32), **kwargs)


def kept(result):
    return np.nonzero(np.asarray(result.group_weights))[0].tolist()


# --- RAGEN worked examples ----------------------------------------------------------------


@pytest.mark.parametrize("stds,want", [
    ([0.5, 0.5, 0.45, 0.4, 0, 0, 0, 0], 7),
    ([0.5, 0.5, 0.3, 0, 0, 0, 0, 0], 8),
    ([5, 4.5, 3] + [0.3] * 5, 3),
    ([2.9] + [0.3] * 7, 6),
])
def test_softmax_nucleus_spec_examples(stds, want):
    res = filter_on_stds(stds, strategy="top_p", value=0.9, top_p_mode="softmax")
    assert int(res.kept_count) == want
    assert kept(res) == list(range(want))  # the highest-std groups, ties by index


def test_linear_walk_hand_worked():
    # sum = 6.5, threshold = 0.6 * 6.5 - 0.01 = 3.89. Walk: +3 (cum 3), +2 (cum 5 >= 3.89) -> stop.
    res = filter_on_stds([1, 3, 0.5, 2, 0, 0], strategy="top_p", value=0.6)
    assert kept(res) == [1, 3]
    # [0.5, 0.5, 0.45, 0.4, 0 x 4] at 0.9: threshold 1.655; 0.5 + 0.5 + 0.45 = 1.45 < 1.655, + 0.4 -> keep 4.
    res = filter_on_stds([0.5, 0.5, 0.45, 0.4, 0, 0, 0, 0], strategy="top_p", value=0.9)
    assert kept(res) == [0, 1, 2, 3]
    assert float(res.metrics["rollout/filter_kept_ratio"]) == 0.5
    assert float(res.metrics["rollout/filter_zero_count"]) == 4


def test_linear_all_zero_is_empty_and_softmax_is_not():
    res = filter_on_stds([0, 0, 0, 0], strategy="top_p", value=0.9)
    assert bool(res.is_empty) and int(res.kept_count) == 0
    np.testing.assert_array_equal(res.row_weights, np.zeros(8))
    res = filter_on_stds([0, 0, 0, 0], strategy="top_p", value=0.9, top_p_mode="softmax")
    assert int(res.kept_count) == 4  # softmax of equal scores is uniform: needs all 4 for 0.9


def test_include_zero_and_no_op_fast_path():
    stds = [0.7, 0, 0.2, 0]
    # value 1.0 with include_zero=True keeps everything (the no-op)...
    res = filter_on_stds(stds, strategy="top_p", value=1.0, include_zero=True)
    np.testing.assert_array_equal(res.row_weights, np.ones(8))
    # ...but value 1.0 with include_zero=False still drops the zero-std groups.
    res = filter_on_stds(stds, strategy="top_p", value=1.0, include_zero=False)
    assert kept(res) == [0, 2]
    # All groups zero and include_zero=False: empty for every strategy.
    for strategy in snr_filter.FILTER_STRATEGIES.names():
        res = filter_on_stds([0, 0, 0], strategy=strategy, value=0.5, include_zero=False)
        assert bool(res.is_empty), strategy


def test_direction_largest_keeps_high_variance():
    stds = [0.1, 2.0, 0.5, 1.0]
    assert kept(filter_on_stds(stds, strategy="top_k", value=0.5)) == [1, 3]
    assert kept(filter_on_stds(stds, strategy="top_k", value=0.5, filter_type="smallest")) == [0, 2]


def test_weighted_mode_mean_one_and_uniform_fallback():
    res = filter_on_stds([1, 3, 0, 4], strategy="weighted")
    np.testing.assert_allclose(res.group_weights, [0.5, 1.5, 0.0, 2.0], rtol=1e-5)
    res = filter_on_stds([0, 0, 0], strategy="weighted")
    np.testing.assert_allclose(res.group_weights, [1, 1, 1])
    assert not bool(res.is_empty)


# --- random inputs against the reference --------------------------------------------------------


def random_scores(seed, num_groups=8, group_size=4):
    rng = np.random.default_rng(seed)
    # Small integer rewards: some groups constant (std 0), some std ties; plus a continuous batch.
    if seed % 2:
        rows = rng.integers(-1, 3, size=num_groups * group_size).astype(float)
        for g in rng.choice(num_groups, size=2, replace=False):
            rows[g * group_size:(g + 1) * group_size] = rows[g * group_size]
    else:
        rows = rng.normal(size=num_groups * group_size) * rng.choice([0.1, 1.0, 5.0])
        rows[:group_size] = 0.0
    return rows


CASES = list(itertools.product(
    ["top_p", "top_k", "top_k_abs", "min_p", "weighted"],
    [True, False],  # largest
    [True, False],  # include_zero
))


@pytest.mark.parametrize("strategy,largest,include_zero", CASES)
@pytest.mark.parametrize("metric", ["reward_variance", "reward"])
def test_selection_matches_reference(strategy, largest, include_zero, metric):
    values = {"top_p": [0.3, 0.7, 0.9, 1.0], "top_k": [0.25, 0.5, 0.7, 0.01],
              "top_k_abs": [1, 3, 5, 20], "min_p": [0.37, 0.83, 0.61], "weighted": [1.0]}[strategy]
    modes = ["linear", "softmax"] if strategy == "top_p" else ["linear"]
    for seed, value, mode in itertools.product(range(4), values, modes):
        rows = random_scores(seed)
        scores = ref.group_score(rows, 4, metric)
        want = ref.select_groups(scores, strategy, value, largest, include_zero, mode)
        res = snr_filter.rollout_filter(
            group_size=4, episode_scores=jnp.asarray(rows, jnp.float32), metric=metric, strategy=strategy,
            value=value, filter_type="largest" if largest else "smallest", include_zero=include_zero,
            top_p_mode=mode)
        ctx = f"seed={seed} value={value} mode={mode} scores={np.round(scores, 4)}"
        np.testing.assert_allclose(res.group_scores, scores, rtol=1e-5, atol=1e-5, err_msg=ctx)
        np.testing.assert_allclose(res.group_weights, want, rtol=1e-5, atol=1e-6, err_msg=ctx)
        np.testing.assert_allclose(res.row_weights, np.repeat(want, 4), rtol=1e-5, atol=1e-6)
        assert bool(res.is_empty) == (sum(want) == 0)


@pytest.mark.parametrize("metric", ["reward_variance", "reward_std", "reward", "reward_sum"])
def test_reward_group_scores(metric):
    rows = random_scores(3)
    res = snr_filter.rollout_filter(group_size=4, episode_scores=jnp.asarray(rows, jnp.float32),
                                    metric=metric, strategy="top_k", value=0.5)
    scores = ref.group_score(rows, 4, metric)
    np.testing.assert_allclose(res.group_scores, scores, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res.group_weights, ref.select_groups(scores, "top_k", 0.5))


@pytest.mark.parametrize("metric,source", [("length", "length"), ("entropy", "entropy"),
                                           ("entropy_variance", "entropy")])
def test_non_reward_metrics_and_logged_metrics(metric, source):
    rng = np.random.default_rng(21)
    per_row = rng.random(24) * 10
    kwargs = {"response_lengths" if source == "length" else "row_entropy": jnp.asarray(per_row, jnp.float32)}
    res = snr_filter.rollout_filter(group_size=4, metric=metric, strategy="top_k", value=0.5, **kwargs)
    scores = ref.group_score(per_row, 4, metric)
    want_w = ref.select_groups(scores, "top_k", 0.5)
    np.testing.assert_allclose(res.group_weights, want_w)
    for k, v in ref.filter_metrics(per_row, 4, want_w, source).items():
        np.testing.assert_allclose(res.metrics[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(res.metrics["rollout/in_group_std"],
                               res.metrics[f"rollout/in_group_{source}_std"])


def test_reward_metrics_over_kept_groups():
    rows = random_scores(4)
    res = snr_filter.rollout_filter(group_size=4, episode_scores=jnp.asarray(rows, jnp.float32),
                                    strategy="top_p", value=0.5)
    weights = ref.select_groups(ref.group_score(rows, 4, "reward_variance"), "top_p", 0.5)
    for k, v in ref.filter_metrics(rows, 4, weights, "reward").items():
        np.testing.assert_allclose(res.metrics[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(res.row_group_scores, np.repeat(res.group_scores, 4))


def test_reward_std_is_the_reward_std_whatever_the_metric():
    """``reward_std`` is the original's batch["reward_std"] (group std of episode scores, ddof 1)
    even when the filter ranks by another metric; ``row_group_scores`` holds that metric."""
    rng = np.random.default_rng(5)
    rewards, lengths = rng.random(16), rng.integers(5, 50, 16).astype(np.float32)
    res = snr_filter.rollout_filter(group_size=4, episode_scores=jnp.asarray(rewards, jnp.float32),
                                    response_lengths=jnp.asarray(lengths), metric="length", strategy="top_k", value=0.5)
    want_std = np.repeat([np.std(rewards[4 * g:4 * g + 4], ddof=1) for g in range(4)], 4)
    np.testing.assert_allclose(res.reward_std, want_std, rtol=1e-5)
    np.testing.assert_allclose(res.row_group_scores, np.repeat([lengths[4 * g:4 * g + 4].mean() for g in range(4)], 4),
                               rtol=1e-6)
    assert snr_filter.rollout_filter(group_size=4, response_lengths=jnp.asarray(lengths), metric="length",
                                     strategy="top_k", value=0.5).reward_std is None


def test_row_mean_entropy():
    ent = jnp.array([[0.0, 1.0, 3.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = jnp.array([[False, True, True, False], [False] * 4])
    np.testing.assert_allclose(snr_filter.row_mean_entropy(ent, mask), [2.0, 0.0])


@pytest.mark.parametrize("strategy,mode", [("top_p", "linear"), ("top_p", "softmax"), ("top_k", "linear"),
                                           ("top_k_abs", "linear"), ("min_p", "linear")])
def test_jit_with_traced_value(strategy, mode):
    rows = jnp.asarray(random_scores(2), jnp.float32)
    fn = jax.jit(lambda r, v: snr_filter.rollout_filter(
        group_size=4, episode_scores=r, strategy=strategy, value=v, top_p_mode=mode).group_weights)
    for value in ([0.5, 0.7] if strategy != "top_k_abs" else [2.0, 5.0]):
        want = ref.select_groups(ref.group_score(np.asarray(rows, float), 4, "reward_variance"),
                                 strategy, value, mode=mode)
        np.testing.assert_allclose(fn(rows, jnp.float32(value)), want)


def test_filter_loss_scale():
    np.testing.assert_allclose(snr_filter.filter_loss_scale("none", 0.25), 1.0)
    np.testing.assert_allclose(snr_filter.filter_loss_scale("linear", 0.25), 0.25)
    np.testing.assert_allclose(snr_filter.filter_loss_scale("sqrt", 0.25), 0.5)
    with pytest.raises(ValueError, match="Unknown filter loss scaling 'log'"):
        snr_filter.filter_loss_scale("log", 0.25)


def test_bad_configuration_errors():
    rows = jnp.zeros(8)
    with pytest.raises(ValueError, match="Unknown filter strategy 'top-p'.*'top_p'"):
        snr_filter.rollout_filter(group_size=4, episode_scores=rows, strategy="top-p")
    with pytest.raises(ValueError, match="Unknown filter type 'biggest'.*'largest'"):
        snr_filter.rollout_filter(group_size=4, episode_scores=rows, filter_type="biggest")
    with pytest.raises(ValueError, match="Unknown top_p probability mode"):
        snr_filter.rollout_filter(group_size=4, episode_scores=rows, top_p_mode="exp")
    with pytest.raises(ValueError, match="needs row_entropy"):
        snr_filter.rollout_filter(group_size=4, episode_scores=rows, metric="entropy")
    with pytest.raises(ValueError, match="contiguous blocks"):
        snr_filter.rollout_filter(group_size=3, episode_scores=rows)
    with pytest.raises(ValueError, match="Unknown filter group score 'variance'"):
        snr_filter.rollout_filter(group_size=4, episode_scores=rows, metric="variance")


def test_filter_advantages_loss_pipeline_on_a_trajectory_under_jit():
    """Filter -> bi-level GAE -> loss scaling -> PPO objective in one jit, on a real Trajectory layout,
    against the same chain of NumPy references."""
    from ragen_jax.starpo import advantages, losses
    from tests.starpo.traj_factory import Conversation, Turn, build_trajectory

    rng = np.random.default_rng(31)
    group_size, num_groups = 3, 4
    convs = []
    for g in range(num_groups):
        for _ in range(group_size):
            turns = [Turn(obs=[5] * int(rng.integers(1, 4)), reasoning=[6] * int(rng.integers(0, 4)),
                          answer=[7] * int(rng.integers(1, 3)),
                          reward=float(rng.choice([0.0, 1.0, -0.5])) * (g > 0),  # group 0: zero std
                          format_penalty=-0.1 * float(rng.random() < 0.3) * (g > 0))
                     for _ in range(int(rng.integers(1, 4)))]
            convs.append(Conversation(preamble=[4, 4], turns=turns))
    traj = build_trajectory(convs, [i // group_size for i in range(len(convs))])
    B, L = traj.tokens.shape
    values = rng.normal(size=(B, L)).astype(np.float32)
    logp = (-rng.exponential(size=(B, L))).astype(np.float32)
    old = (logp - rng.normal(scale=0.3, size=(B, L))).astype(np.float32)

    @jax.jit
    def step(traj, values, logp, old):
        res = snr_filter.rollout_filter(group_size=group_size,
                                        episode_scores=advantages.episode_scores(traj.token_rewards),
                                        strategy="top_p", value=0.6, include_zero=False)
        mask = traj.loss_mask & (res.row_weights[:, None] > 0)
        adv, _ = advantages.compute_advantages("bilevel_gae", traj.token_rewards, values, mask,
                                               traj.turn_ids, group_size=group_size, high_level_gamma=0.9)
        adv = adv * snr_filter.filter_loss_scale("sqrt", res.kept_ratio)
        num, den, _ = losses.actor_objective(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
        return num / den, res.group_weights

    loss, weights = step(traj, values, logp, old)

    r = np.asarray(traj.token_rewards, float)
    scores = ref.group_score(r.sum(1), group_size, "reward_variance")
    want_w = ref.select_groups(scores, "top_p", 0.6, include_zero=False)
    np.testing.assert_allclose(weights, want_w)
    assert 0 < sum(want_w) < num_groups and want_w[0] == 0
    mask = np.asarray(traj.loss_mask) & np.repeat(np.array(want_w) > 0, group_size)[:, None]
    a, _ = ref.bilevel_gae(r, values.astype(float), mask, np.asarray(traj.turn_ids), 1.0, 1.0, 0.9)
    a = ref.whiten(a, mask) * np.sqrt(sum(w > 0 for w in want_w) / num_groups)
    per_token, _ = ref.ppo(logp.astype(float), old.astype(float), a, mask, 0.2, 0.28, 3.0)
    num, den = ref.aggregate(per_token, mask, "seq-mean-token-mean")
    np.testing.assert_allclose(loss, num / den, rtol=1e-4, atol=1e-6)
