"""DAPO's overlong shaping / filtering and dynamic sampling, against hand-worked values.

Batches come from ``traj_factory`` with fixed token lists; the fake rollout of the dynamic-sampling
test replays a fixed list of batches, so every run is identical.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import overlong
from ragen_jax.starpo import dynamic_sampling as ds
from tests.starpo.traj_factory import Conversation, Turn, build_trajectory


def test_overlong_penalty_is_dapos_piecewise_rule():
    """L_max = 20, L_cache = 5: free up to 15 tokens, then -1/5 per token, -1 beyond 20."""
    got = overlong.overlong_penalty(jnp.asarray([0, 15, 16, 18, 20, 21, 40]), max_len=20, buffer_len=5, factor=1.0)
    np.testing.assert_allclose(got, [0, 0, -0.2, -0.6, -1.0, -1.0, -1.0], atol=1e-6)
    got = overlong.overlong_penalty(jnp.asarray([18]), max_len=20, buffer_len=5, factor=0.5)
    np.testing.assert_allclose(got, [-0.3], atol=1e-6)
    with pytest.raises(ValueError, match="buffer"):
        overlong.overlong_penalty(jnp.asarray([1]), max_len=20, buffer_len=0)


def _two_turn_batch():
    """Row 0: replies of 3 and 6 sampled tokens (reasoning + answer + close); row 1: 2 and 2."""
    convs = [Conversation(preamble=[7], turns=[Turn(obs=[4], reasoning=[5, 6], reward=1.0),
                                               Turn(obs=[4], reasoning=[5, 6, 7, 8, 9], reward=0.5)]),
             Conversation(preamble=[7], turns=[Turn(obs=[4], reasoning=[5], reward=0.0),
                                               Turn(obs=[4], reasoning=[6], reward=0.0)])]
    return build_trajectory(convs, [0, 0], seq_len=24, max_turns=2)


def test_shape_overlong_moves_each_turns_reward_by_its_reply_length():
    traj = _two_turn_batch()
    lengths = np.asarray(overlong.turn_reply_lengths(traj.loss_mask, traj.turn_ids, 2))
    # Each reply is reasoning + END_THINK + answer token (traj_factory's layout).
    np.testing.assert_array_equal(lengths, [[4, 7], [3, 3]])
    shaped, penalty = overlong.shape_overlong(traj, max_len=8, buffer_len=4, factor=1.0)
    # Free up to 4 tokens: 7 tokens cost 3/4.
    np.testing.assert_allclose(penalty, [[0, -0.75], [0, 0]], atol=1e-6)
    np.testing.assert_allclose(shaped.turn_rewards, [[1.0, -0.25], [0, 0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(shaped.token_rewards).sum(1), [0.75, 0.0], atol=1e-6)
    last = int(traj.turn_last_token[0, 1])
    assert float(shaped.token_rewards[0, last]) == pytest.approx(-0.25)


def test_cut_episodes_are_replies_without_a_stop_or_a_full_transcript():
    traj = _two_turn_batch().replace(turn_reply_cut=jnp.asarray([[False, False], [False, True]]),
                                     truncated=jnp.asarray([True, False]))
    np.testing.assert_array_equal(overlong.cut_episodes(traj), [True, True])
    traj = traj.replace(turn_reply_cut=jnp.zeros((2, 2), bool), truncated=jnp.zeros(2, bool))
    np.testing.assert_array_equal(overlong.cut_episodes(traj), [False, False])


# --- dynamic sampling ---------------------------------------------------------------------------


def _batch(scores, tag):
    """Groups of two one-turn episodes with the given scores; ``tag`` marks the batch in the tokens."""
    convs = [Conversation(preamble=[tag], turns=[Turn(obs=[4], reasoning=[5], reward=float(s))]) for s in scores]
    return build_trajectory(convs, [i // 2 for i in range(len(scores))], seq_len=8, max_turns=1)


def test_choose_groups_takes_informative_groups_in_order_then_fills():
    masks = [np.array([True, False, False]), np.array([False, True, True])]
    assert ds.choose_groups(masks, 3) == [(0, 0), (1, 1), (1, 2)]
    masks = [np.array([False, True, False]), np.array([False, False, False])]
    assert ds.choose_groups(masks, 3) == [(0, 1), (0, 0), (0, 2)]


def test_refill_plays_rounds_until_the_batch_is_informative():
    first = _batch([1, 1, 0, 1, 0, 0], tag=10)  # groups: equal, mixed, equal
    extra = [_batch([0, 0, 1, 0, 2, 2], tag=11), _batch([3, 1, 0, 0, 5, 4], tag=12)]
    calls = []

    def rollout(params, key):
        calls.append(key)
        return extra[len(calls) - 1]

    import jax

    traj, metrics = ds.refill(rollout, None, jax.random.key(0), first, group_size=2, max_rounds=5)
    # Round 1 adds one informative group (its second), round 2 is needed for the third.
    assert len(calls) == 2
    assert metrics == {"rollout/dynamic_sampling_rounds": 2.0, "rollout/informative_groups_first": 1.0,
                       "rollout/informative_groups": 3.0}
    np.testing.assert_array_equal(np.asarray(traj.tokens)[:, 0], [10, 10, 11, 11, 12, 12])
    np.testing.assert_allclose(traj.episode_return, [0, 1, 1, 0, 3, 1])
    np.testing.assert_array_equal(traj.group_ids, [0, 0, 1, 1, 2, 2])


def test_refill_stops_at_the_round_limit_and_fills_with_the_first_rollouts_groups():
    first = _batch([1, 1, 0, 1, 0, 0], tag=10)

    def rollout(params, key):
        return _batch([2, 2, 2, 2, 2, 2], tag=11)

    import jax

    traj, metrics = ds.refill(rollout, None, jax.random.key(0), first, group_size=2, max_rounds=1)
    assert metrics["rollout/dynamic_sampling_rounds"] == 1.0 and metrics["rollout/informative_groups"] == 1.0
    np.testing.assert_array_equal(np.asarray(traj.tokens)[:, 0], [10] * 6)
    np.testing.assert_allclose(traj.episode_return, [0, 1, 1, 1, 0, 0])  # mixed group first, then the rest
