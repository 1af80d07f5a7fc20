"""RAGEN-2's gradient analysis against hand-worked buckets and an independently written objective.

The tiny Decoder and one-turn batches of ``test_update``; seeds fixed (``nnx.Rngs(0)``), so every run
is identical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ragen_jax.models import Decoder
from ragen_jax.starpo import gradient_analysis as ga
from ragen_jax.starpo import update as U
from ragen_jax.config import FilterConfig, StarPOConfig
from ragen_jax.starpo.logprobs import positions_for
from tests.starpo import numpy_reference as ref
from tests.starpo.test_update import GROUP_SIZE, MODEL_CFG, make_traj


def test_quantile_buckets_hand_worked():
    """Seven considered groups into 3 buckets of 7 // 3 = 2 by std, the remainder to the last."""
    std = jnp.asarray([0.5, 0.1, 0.9, 0.0, 0.3, 0.7, 0.2, 9.0])
    considered = jnp.asarray([True] * 7 + [False])
    got = ga.quantile_buckets(std, considered, 3)
    # ranks by std: 0.0 (g3), 0.1 (g1) | 0.2 (g6), 0.3 (g4) | 0.5 (g0), 0.7 (g5), 0.9 (g2)
    np.testing.assert_array_equal(got, [2, 0, 2, 0, 1, 2, 1, -1])
    # Fewer groups than buckets: one each, in std order.
    np.testing.assert_array_equal(ga.quantile_buckets(jnp.asarray([0.4, 0.2]), jnp.ones(2, bool), 6), [1, 0])


def test_fixed_rv_buckets_hand_worked():
    std = jnp.asarray([0.0, 0.99, 1.0, 2.5, 5.0, 12.0])
    np.testing.assert_array_equal(ga.fixed_rv_buckets(std, jnp.ones(6, bool), 6), [0, 0, 1, 2, 5, 5])
    assert ga.bucket_names("fixed_rv", 3) == ("rv0-1", "rv1-2", "rv2+")
    assert ga.bucket_names("quantile", 2) == ("q1", "q2")


def _batch():
    """4 groups of 4 one-turn episodes: group 0 all scored 1 (no spread), the others spread more
    and more."""
    rng = np.random.default_rng(0)
    reasoning = [rng.integers(4, 16, 2).tolist() for _ in range(16)]
    rewards = [1, 1, 1, 1, 0, 0, 0, 0.5, 0, 1, 0, 1, 0, 3, 0, 3]
    return make_traj(reasoning, rewards), np.asarray(rewards, float)


def _independent_norms(policy, traj, rows, advantages, entropy_coeff):
    """Gradient norms of the token-mean policy-gradient term (ratio 1) and of the entropy bonus
    over ``rows``, written from the definitions with the model called directly."""
    tokens = traj.tokens
    mask = np.asarray(traj.loss_mask) & rows[:, None]
    n = mask.sum()
    params = nnx.state(policy, nnx.Param)
    graphdef, _, rest = nnx.split(policy, nnx.Param, ...)

    def logits_of(p):
        model = nnx.merge(graphdef, p, rest)
        logits, _ = model(tokens, positions_for(tokens))
        return jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)  # predicts tokens[:, 1:]

    def task(p):
        lp = logits_of(p)
        tok_lp = jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
        ratio = jnp.exp(tok_lp - jax.lax.stop_gradient(tok_lp))
        return jnp.sum(-advantages[:, 1:] * ratio * mask[:, 1:]) / n

    def bonus(p):
        lp = logits_of(p)
        ent = -jnp.sum(jnp.exp(lp) * lp, -1)
        return -entropy_coeff * jnp.sum(ent * mask[:, 1:]) / n

    return float(optax.global_norm(jax.grad(task)(params))), float(optax.global_norm(jax.grad(bonus)(params)))


def test_bucket_gradient_norms_match_the_objective_written_out():
    cfg = StarPOConfig(adv_estimator="grpo", mini_batch_size=16, entropy_coeff=0.01, logprob_chunk_size=8)
    filt = FilterConfig(include_zero=False)  # drops group 0 (zero spread)
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    analyse = ga.make_gradient_analysis(graphdefs, cfg, filt, group_size=GROUP_SIZE, bucketing="quantile",
                                        num_buckets=2)
    traj, rewards = _batch()
    before = jax.tree.map(np.asarray, state.params)
    m = {k: float(v) for k, v in analyse(state, traj).items()}
    after = jax.tree.map(np.asarray, state.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

    adv, _ = ref.grpo(np.asarray(traj.token_rewards, float), np.asarray(traj.loss_mask), GROUP_SIZE)
    adv = jnp.asarray(adv, jnp.float32)
    group = np.arange(16) // GROUP_SIZE
    # Pre-filter, quantile buckets of 2 groups: q1 = groups 0 (std 0) and 1 (std 0.25), q2 = 2 and 3.
    for name, rows in (("q1", group < 2), ("q2", group >= 2), ("all", np.ones(16, bool))):
        task, bonus = _independent_norms(policy, traj, rows, adv, 0.01)
        np.testing.assert_allclose(m[f"grad_norm_prefilter/{name}/task"], task, rtol=2e-4, err_msg=name)
        np.testing.assert_allclose(m[f"grad_norm_prefilter/{name}/entropy"], bonus, rtol=2e-4, err_msg=name)
        assert m[f"grad_norm_prefilter/{name}/sample_count"] == rows.sum()
        tokens = float((np.asarray(traj.loss_mask) & rows[:, None]).sum())
        np.testing.assert_allclose(m[f"grad_norm_prefilter/{name}/per_token/task"], task / tokens, rtol=2e-4)
        np.testing.assert_allclose(m[f"grad_norm_prefilter/{name}/per_sample/task"], task / rows.sum(), rtol=2e-4)
    stds = [np.std(rewards[g * 4:(g + 1) * 4], ddof=1) for g in range(4)]
    np.testing.assert_allclose(m["grad_norm_prefilter/q1/reward_std_min"], stds[0], atol=1e-6)
    np.testing.assert_allclose(m["grad_norm_prefilter/q2/reward_std_max"], stds[3], atol=1e-5)
    # After the filter (group 0 dropped): three groups, q1 = group 1, q2 = groups 2 and 3.
    assert m["grad_norm/q1/sample_count"] == 4 and m["grad_norm/q2/sample_count"] == 8
    np.testing.assert_allclose(m["grad_norm/all/sample_pct"], 1.0)
    np.testing.assert_allclose(m["grad_norm_prefilter/q1/sample_pct"], 0.5)


def test_a_group_without_reward_spread_has_no_task_gradient_only_regulariser():
    """RAGEN-2's point in its purest form: group 0 scored alike, so its GRPO advantage is 0 and its
    task gradient vanishes, while the entropy bonus still pulls."""
    cfg = StarPOConfig(adv_estimator="grpo", mini_batch_size=16, entropy_coeff=0.01, logprob_chunk_size=8)
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    analyse = ga.make_gradient_analysis(graphdefs, cfg, FilterConfig(), group_size=GROUP_SIZE, bucketing="fixed_rv",
                                        num_buckets=2)
    traj, _ = _batch()
    m = {k: float(v) for k, v in analyse(state, traj).items()}
    # fixed_rv: std in [0, 1) -> rv0-1 holds groups 0, 1, 2 (std 0, 0.25, 0.58); group 3 (1.73) -> rv1+.
    assert m["grad_norm/rv0-1/sample_count"] == 12 and m["grad_norm/rv1+/sample_count"] == 4
    assert m["grad_norm/rv0-1/entropy"] > 0 and m["grad_norm/rv1+/task"] > 0
    traj0 = make_traj([[5, 6]] * 16, [1.0] * 16)  # every group without spread
    m0 = {k: float(v) for k, v in analyse(state, traj0).items()}
    assert m0["grad_norm/all/task"] == 0.0 and m0["grad_norm/all/entropy"] > 0


def test_unknown_bucketing_is_refused():
    with pytest.raises(ValueError, match="quantile"):
        ga.make_gradient_analysis(None, StarPOConfig(adv_estimator="grpo"), FilterConfig(), group_size=4,
                                  bucketing="deciles")
