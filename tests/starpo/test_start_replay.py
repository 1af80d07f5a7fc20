"""Unsolved-start replay (``filter.start_replay_fraction``): the queue against hand-worked examples,
the rollout from chosen starts against the per-row rollout of the same keys, and the trainer (the
first step equals a run without replay, resume is exact). Fixed seeds throughout.
"""

import jax
import numpy as np
import pytest

import environments
from ragen_jax.config import ConfigError, RolloutConfig
from ragen_jax.rollout.loop import make_rollout
from ragen_jax.training.event_log import read_events
from ragen_jax.starpo.start_replay import StartReplay
from tests.rollout.helpers import make_tokenizer
from tests.rollout.test_agent import tiny_model
from tests.training.test_trainer import _logged, _resume_matches, small_config


def _keys(*ids):
    return np.asarray([[i, 100 + i] for i in ids], np.uint32)


def test_queue_replays_oldest_first_counts_uses_and_keeps_the_newest():
    replay = StartReplay.empty(fraction=0.5, max_uses=2, capacity=3)
    key = jax.random.key(7)
    env_key, _ = jax.random.split(key)
    fresh = np.asarray(jax.random.key_data(jax.random.split(env_key, 4)))

    # Empty queue: every start is the one rollout(params, key) draws.
    keys, uses, n = replay.starts(key, 4)
    assert n == 0 and np.array_equal(keys, fresh) and uses.tolist() == [0, 0, 0, 0]
    # Groups 1 and 3 failed some episode: they join the queue in group order.
    replay.record(_keys(10, 11, 12, 13), np.zeros(4, int), np.array([True, False, True, False]))
    assert replay.keys.tolist() == _keys(11, 13).tolist() and replay.uses.tolist() == [0, 0]

    # fraction 0.5 of 4 groups = 2 replayed, oldest first; the other two are the fresh keys 2 and 3.
    keys, uses, n = replay.starts(key, 4)
    assert n == 2 and keys.tolist() == _keys(11, 13).tolist() + fresh[2:].tolist() and uses.tolist() == [1, 1, 0, 0]
    assert len(replay.keys) == 0
    # 11 solved now (leaves); 13 still unsolved after 1 replay (< 2: back in the queue); both fresh fail.
    replay.record(keys, uses, np.array([True, False, False, False]))
    assert replay.keys.tolist() == [[13, 113]] + fresh[2:].tolist() and replay.uses.tolist() == [1, 0, 0]

    # Only 1 of 4 groups (fraction 0.25) replays: 13, its second replay.
    replay.fraction = 0.25
    keys, uses, n = replay.starts(key, 4)
    assert n == 1 and keys[0].tolist() == [13, 113] and uses.tolist() == [2, 0, 0, 0]
    # 13 fails again but has had its 2 replays: dropped. Capacity 3 keeps the newest three.
    replay.record(keys, uses, np.zeros(4, bool))
    assert replay.keys.tolist() == fresh[1:].tolist()
    assert replay.uses.tolist() == [0, 0, 0]

    # A shorter queue than the share: what there is.
    replay.fraction = 1.0
    _, _, n = replay.starts(key, 4)
    assert n == 3 and len(replay.keys) == 0

    state = StartReplay.empty(1.0, 2, 3)
    state.load_state_dict({"keys": [[1, 2], [3, 4]], "uses": [1, 0]})
    assert state.keys.dtype == np.uint32 and state.state_dict() == {"keys": [[1, 2], [3, 4]], "uses": [1, 0]}


def test_rollout_from_starts_plays_each_group_from_its_key():
    """``from_starts`` with the keys ``rollout(params, key)`` draws is that rollout, bit for bit; with
    other keys each group plays the episodes the per-row rollout (``run``) of those keys plays."""
    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    cfg = RolloutConfig(num_groups=3, group_size=2, max_turns=2, max_new_tokens=16, max_seq_len=512,
                        max_obs_tokens=64)
    graphdef, weights = tiny_model(tok, seed=2)
    rollout = make_rollout(graphdef, env, env.default_params(), tok, cfg)
    key = jax.random.key(4)
    env_key, sample_key = jax.random.split(key)
    drawn = jax.random.key_data(jax.random.split(env_key, 3))
    a, b = rollout(weights, key), rollout.from_starts(weights, drawn, sample_key)
    for name in ("tokens", "episode_return", "success", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)

    chosen = jax.random.key_data(jax.random.split(jax.random.key(11), 3))
    traj = rollout.from_starts(weights, chosen, sample_key)
    ref = rollout.run(weights, jax.random.wrap_key_data(np.repeat(np.asarray(chosen), 2, axis=0)), sample_key)
    for name in ("tokens", "episode_return", "success"):
        np.testing.assert_array_equal(np.asarray(getattr(traj, name)), np.asarray(getattr(ref, name)), err_msg=name)
    with pytest.raises(ValueError, match=r"num_groups=3"):
        rollout.from_starts(weights, np.asarray(chosen)[:2], sample_key)


def _first_user_block(transcript: str) -> str:
    """The text of the first turn's user message (its board) in a decoded Qwen-style transcript."""
    user = transcript.split("<|im_start|>user", 1)[1]
    return user.split("<|im_end|>", 1)[0]


def test_trainer_replays_unsolved_starts_and_resumes_exactly(tmp_path):
    """The untrained policy of the small config solves nothing, so every group queues its start:
    step 1 (empty queue) logs what a run without replay logs, steps 2 and 3 replay one of the two
    groups each; and 3 steps straight == 2 + interrupt + resume 1 (the queue is in the checkpoint)."""
    from ragen_jax.training.trainer import train

    replay = {"filter.start_replay_fraction": 0.5}
    train(small_config(tmp_path / "plain", total_steps=2))
    _resume_matches(tmp_path, total=3, interrupt_at=2, **replay)
    with_replay, plain = _logged(tmp_path / "a"), _logged(tmp_path / "plain")
    assert [v for _, v in with_replay["rollout/replayed_groups"]] == [0.0, 1.0, 1.0]
    # Each step takes one start off the front and queues both groups again (replayed once each: < 2).
    assert [v for _, v in with_replay["rollout/start_replay_queue"]] == [2.0, 3.0, 4.0]
    assert [v for _, v in with_replay["rollout/replayed_groups_solved"]] == [0.0, 0.0, 0.0]
    for key, series in plain.items():
        if key.startswith(("train/", "actor/")):
            assert dict(series)[1] == pytest.approx(dict(with_replay[key])[1], rel=1e-6, abs=1e-6), key
    # Row 0 of step 2 replays group 0 of step 1 (the oldest in the queue): its logged transcript shows
    # step 1's first board again, where the run without replay shows a fresh one.
    texts = {name: dict(read_events(tmp_path / name / "tensorboard", text_content=True)["transcripts/train"])
             for name in ("a", "plain")}
    first_board = {name: {step: _first_user_block(text) for step, text in t.items()} for name, t in texts.items()}
    assert first_board["a"][1] == first_board["plain"][1]
    assert first_board["a"][2] == first_board["a"][1] != first_board["plain"][2]


def test_replay_fraction_outside_zero_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="start_replay_fraction"):
        small_config(tmp_path, total_steps=1, **{"filter.start_replay_fraction": 1.5})
