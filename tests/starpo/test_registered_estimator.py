"""Adding an advantage estimator is one function, its registration and this test: an estimator and
the new input it reads are registered from this file alone, and the update builds that input,
runs the estimator and reports its diagnostics without naming it anywhere in the package.

The reference is a NumPy re-derivation from the conversations themselves (episode score = sum of
the turn rewards, turns = the conversation's turns). Fixed seeds (``nnx.Rngs(0)``,
``jax.random.key(0)``, ``np.random.default_rng(3)``), so every run sees the same numbers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.config import CollapseConfig, FilterConfig, StarPOConfig
from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo import update as U
from tests.starpo.traj_factory import Conversation, Turn, build_trajectory

VOCAB, GROUP_SIZE, NUM_GROUPS = 16, 4, 2
BATCH = GROUP_SIZE * NUM_GROUPS


def turns_taken(cfg, traj, group_size):
    """The new input: turns each episode took, ``[B]``."""
    return jnp.sum(traj.turn_mask, axis=1).astype(jnp.float32)


def turn_scaled_baseline(token_rewards, values, loss_mask, turn_ids=None, *, group_size, turns_taken, scale, **_):
    """``A_i = scale * (s_i - mean_g s) / turns_i``, broadcast over the sampled tokens."""
    scores = adv_lib.episode_scores(token_rewards)
    mean, _ = adv_lib.group_mean_std(scores, group_size)
    adv = scale * (scores - jnp.repeat(mean, group_size)) / jnp.maximum(turns_taken, 1.0)
    adv = adv[:, None] * loss_mask.astype(jnp.float32)
    return adv, adv


def diagnostics(inputs, kept, group_size):
    return {"critic/turns_taken_mean": jnp.mean(inputs["turns_taken"])}


@pytest.fixture
def registered():
    adv_lib.ADVANTAGE_INPUTS.add("turns_taken", adv_lib.AdvantageInput(turns_taken))
    adv_lib.ADVANTAGE_ESTIMATORS.add("turn_scaled_baseline", adv_lib.AdvantageEstimator(
        turn_scaled_baseline, uses_critic=False, whiten_default=False, group_relative=True,
        needs=("turns_taken",), settings=lambda cfg: {"scale": 2.0}, diagnostics=diagnostics))
    yield
    adv_lib.ADVANTAGE_ESTIMATORS.remove("turn_scaled_baseline")
    adv_lib.ADVANTAGE_INPUTS.remove("turns_taken")


def conversations(seed):
    """Groups of GROUP_SIZE episodes from one start; each takes 1 or 2 turns with random rewards."""
    rng = np.random.default_rng(seed)
    convs = []
    for row in range(BATCH):
        obs = [4, 5 + row // GROUP_SIZE]
        turns = [Turn(obs=obs, reasoning=rng.integers(4, VOCAB, rng.integers(1, 4)).tolist(),
                      reward=float(rng.normal()))]
        if rng.random() < 0.5:
            turns.append(Turn(obs=[6, 4 + int(rng.integers(0, 3))], reasoning=rng.integers(4, VOCAB, 2).tolist(),
                              reward=float(rng.normal())))
        convs.append(Conversation(preamble=[7, 8], turns=turns))
    return convs


def test_an_estimator_registered_outside_the_package_runs_in_the_update(registered):
    convs = conversations(3)
    traj = build_trajectory(convs, [b // GROUP_SIZE for b in range(BATCH)], seq_len=24, max_turns=2)

    # NumPy reference from the conversations.
    scores = np.array([sum(t.reward for t in c.turns) for c in convs])
    turns = np.array([len(c.turns) for c in convs], np.float64)
    group_mean = scores.reshape(NUM_GROUPS, GROUP_SIZE).mean(axis=1).repeat(GROUP_SIZE)
    expected = 2.0 * (scores - group_mean) / turns
    assert len(set(turns)) == 2  # both kinds of episode are in the batch

    cfg = StarPOConfig(adv_estimator="turn_scaled_baseline", mini_batch_size=BATCH, micro_batch_size=4,
                       actor_lr=0.01, entropy_coeff=0.0)
    filt = FilterConfig(value=1.0, include_zero=True)  # every group trains
    policy = Decoder(ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=8), rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    update = U.make_update_step(graphdefs, cfg, filt, CollapseConfig(compute_freq=100), group_size=GROUP_SIZE)
    before = jax.tree.map(np.asarray, state.params)  # the update donates the state
    new_state, metrics = update(state, traj)

    assert float(metrics["critic/turns_taken_mean"]) == pytest.approx(turns.mean())
    np.testing.assert_allclose(float(metrics["critic/advantages/max"]), expected.max(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["critic/advantages/min"]), expected.min(), rtol=1e-5)
    tokens = np.asarray(traj.loss_mask).sum(axis=1)
    np.testing.assert_allclose(float(metrics["critic/advantages/mean"]), (expected * tokens).sum() / tokens.sum(),
                               rtol=1e-5, atol=1e-6)
    assert float(metrics["train/optimizer_steps"]) == 1.0
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.any(np.asarray(a) != b), new_state.params, before))
    assert any(bool(m) for m in moved)


def test_the_configuration_knows_an_estimator_once_it_is_registered():
    with pytest.raises(ValueError, match="turn_scaled_baseline"):
        StarPOConfig(adv_estimator="turn_scaled_baseline")
    adv_lib.ADVANTAGE_INPUTS.add("turns_taken", adv_lib.AdvantageInput(turns_taken))
    adv_lib.ADVANTAGE_ESTIMATORS.add("turn_scaled_baseline", adv_lib.AdvantageEstimator(
        turn_scaled_baseline, uses_critic=False, whiten_default=False, needs=("turns_taken",)))
    try:
        cfg = StarPOConfig(adv_estimator="turn_scaled_baseline")
        assert cfg.estimator == "turn_scaled_baseline" and cfg.critic_mode == "none"
    finally:
        adv_lib.ADVANTAGE_ESTIMATORS.remove("turn_scaled_baseline")
        adv_lib.ADVANTAGE_INPUTS.remove("turns_taken")


def test_an_input_the_rollout_must_switch_on_is_checked_at_configuration(registered):
    """An input declaring its rollout switch fails the configuration when the switch is off, naming it."""
    from ragen_jax.config import ConfigError, resolve
    from configs import frozen_lake

    adv_lib.ADVANTAGE_INPUTS.remove("turns_taken")
    adv_lib.ADVANTAGE_INPUTS.add("turns_taken", adv_lib.AdvantageInput(
        turns_taken, rollout_switch="greedy_baseline", missing="set rollout.greedy_baseline=True (test)"))
    c = frozen_lake.get_config()
    c.starpo.adv_estimator = "turn_scaled_baseline"
    with pytest.raises(ConfigError, match=r"turns_taken.*rollout\.greedy_baseline=True"):
        resolve(c)
