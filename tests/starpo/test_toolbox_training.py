"""Every advantage estimator and policy loss of the registries trains a tiny policy for a few steps.

A tiny Decoder (``test_update``'s) plays a two-turn game whose reward pays for certain reasoning
tokens; each estimator (with what it needs: anchor states, greedy baselines) and each policy loss runs
three StarPO updates on on-policy batches sampled from the current policy. The checks: losses and
gradient norms are finite, parameters move, and the advantages of the hand-made batch have the
expected sign (rewarded rows up, unrewarded rows down). Seeds are fixed, so every run is identical.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Decoder
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo import losses
from ragen_jax.starpo import update as U
from ragen_jax.config import CollapseConfig, FilterConfig, StarPOConfig
from tests.starpo.test_update import MODEL_CFG
from tests.starpo.traj_factory import Conversation, Turn, build_trajectory

GROUPS, GROUP_SIZE, TURNS, SEQ_LEN = 2, 4, 2, 16
BATCH = GROUPS * GROUP_SIZE
REWARDED = (10, 11)


def hand_made_batch(reasoning, sampler_logprobs=None):
    """Two turns per row; a turn pays 1 when its one reasoning token is rewarded. The first turn's
    observation is the group's start state; the second's depends on the first move (so some turns of
    a group share an anchor state and some do not)."""
    convs, anchors = [], []
    for row, (z1, z2) in enumerate(reasoning):
        g = row // GROUP_SIZE
        r1, r2 = float(z1 in REWARDED), float(z2 in REWARDED)
        convs.append(Conversation(preamble=[7, 8], turns=[Turn(obs=[4, 5 + g], reasoning=[z1], reward=r1),
                                                          Turn(obs=[6, z1], reasoning=[z2], reward=r2)]))
        anchors.append([100 + g, 1000 * g + z1])
    traj = build_trajectory(convs, [b // GROUP_SIZE for b in range(BATCH)], seq_len=SEQ_LEN, max_turns=TURNS,
                            sampler_logprobs=sampler_logprobs)
    observations = [[[4, 5 + row // GROUP_SIZE], [6, z1]] for row, (z1, _) in enumerate(reasoning)]
    return traj.replace(turn_state_hash=jnp.asarray(anchors, jnp.uint32),
                        reward_baseline=jnp.full((BATCH,), 0.5, jnp.float32),
                        turn_observation=jnp.asarray(observations, jnp.int32),
                        turn_observation_len=jnp.full((BATCH, TURNS), 2, jnp.int32))


ROWS = [(10, 11), (10, 3), (4, 11), (4, 5), (11, 11), (5, 10), (6, 6), (3, 4)]


def _config(**over):
    base = dict(mini_batch_size=BATCH, actor_lr=0.02, entropy_coeff=0.001, logprob_chunk_size=8, critic="none")
    base.update(over)
    return StarPOConfig(**base)


def _train_three_steps(cfg):
    policy = Decoder(MODEL_CFG, rngs=nnx.Rngs(0))
    graphdefs, state = U.init_train_state(policy, cfg, key=jax.random.key(0))
    update = U.make_update_step(graphdefs, cfg, FilterConfig(), CollapseConfig(first_turn_enabled=False,
                                                                              trajectory_enabled=False),
                                group_size=GROUP_SIZE, donate=False)
    start = state.params
    rng = np.random.default_rng(0)
    for _ in range(3):
        rows = [ROWS[i] for i in rng.permutation(BATCH)]
        state, metrics = update(state, hand_made_batch(rows))
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert np.isfinite(float(metrics[k])), (k, metrics[k])
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start)))
    assert moved > 0
    return metrics


ESTIMATORS = [n for n in adv_lib.ADVANTAGE_ESTIMATORS.names() if not adv_lib.ADVANTAGE_ESTIMATORS.get(n).uses_critic]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_critic_free_estimator_trains_and_signs_the_hand_made_batch(estimator):
    cfg = _config(adv_estimator=estimator, use_turn_scores=estimator in ("gigpo", "remax", "reinforce_plus_plus"))
    metrics = _train_three_steps(cfg)
    traj = hand_made_batch(ROWS)
    adv, _ = adv_lib.compute_advantages(cfg.estimator, traj.token_rewards, None, traj.loss_mask, traj.turn_ids,
                                        group_size=GROUP_SIZE, extras=U.advantage_extras(cfg, traj))
    adv = np.asarray(adv)
    scores = np.asarray(traj.episode_return)
    best = [int(np.argmax(scores[g * GROUP_SIZE:(g + 1) * GROUP_SIZE])) + g * GROUP_SIZE for g in range(GROUPS)]
    worst = [int(np.argmin(scores[g * GROUP_SIZE:(g + 1) * GROUP_SIZE])) + g * GROUP_SIZE for g in range(GROUPS)]
    mask = np.asarray(traj.loss_mask)
    for b in best:  # the group's best episode is pushed up on average over its tokens
        assert adv[b][mask[b]].mean() > 0, (estimator, b, adv[b][mask[b]])
    if estimator != "grpo_passk":
        for b in worst:
            assert adv[b][mask[b]].mean() < 0, (estimator, b, adv[b][mask[b]])
    if estimator == "gigpo":
        assert float(metrics["critic/gigpo_shared_turn_fraction"]) > 0


@pytest.mark.parametrize("loss", [n for n in losses.POLICY_LOSSES.names() if n != "vanilla"])
def test_every_policy_loss_trains(loss):
    metrics = _train_three_steps(_config(adv_estimator="grpo", policy_loss=loss, clip_cov_ratio=0.1,
                                         kl_cov_ratio=0.1))
    assert np.isfinite(float(metrics["actor/ppo_kl"]))


@pytest.mark.parametrize("mode", ["seq-mean-token-sum-norm", "drgrpo-token-sum-norm"])
def test_sum_norm_aggregations_train(mode):
    _train_three_steps(_config(adv_estimator="drgrpo", loss_agg_mode=mode))


def test_gigpo_with_similarity_grouping_trains_and_shares_more_turns():
    """verl-agent's similarity grouping in the jitted update: second-turn observations [6, z] that
    differ in one of two pieces (ratio 0.5) share an anchor group at threshold 0.5, so more turns
    get a step-level signal than with identical observations only."""
    exact = _train_three_steps(_config(adv_estimator="gigpo", use_turn_scores=True))
    similar = _train_three_steps(_config(adv_estimator="gigpo", use_turn_scores=True, gigpo_enable_similarity=True,
                                         gigpo_similarity_thresh=0.5))
    assert float(similar["critic/gigpo_shared_turn_fraction"]) > float(exact["critic/gigpo_shared_turn_fraction"])
