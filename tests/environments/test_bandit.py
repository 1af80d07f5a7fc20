"""Bandit against RAGEN's definition: arm names, payouts, same-prompt groups, invalid answers.

Random inputs come from fixed PRNGKeys, so every run is the same.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from environments import make, render
from environments.bandit import Bandit, BanditParams, BanditState

# RAGEN's payouts: (low-risk, high-risk).
SPEC_TRAIN = [("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
              ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
              ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
              ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer")]
SPEC_TEST = [("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
             ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
             ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator")]


def _shown(env, state):
    """The two names in prompt order, from the state (reference: RAGEN's pair list)."""
    pairs = SPEC_TRAIN if env.split == "train" else SPEC_TEST
    lo, hi = pairs[int(state.pair)]
    return (hi, lo) if bool(state.hi_first) else (lo, hi)


def test_splits_match_spec_and_are_disjoint():
    train, test = Bandit("train"), Bandit("test")
    assert train.action_names == tuple(n for p in SPEC_TRAIN for n in p) and train.num_actions == 24
    assert test.action_names == tuple(n for p in SPEC_TEST for n in p) and test.num_actions == 16
    assert not set(train.action_names) & set(test.action_names)
    assert len({n.lower() for n in train.action_names}) == 24  # names map to actions case-insensitively


def test_payout_statistics():
    """High-risk arm: 1.0 w.p. 0.25 else 0.0 (mean within 3 sigma over 20,000 pulls); low arm: 0.1."""
    env = Bandit()
    params = env.default_params()
    n = 20000
    _, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(0), n), params)
    hi = 2 * s.pair + 1
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    _, _, r, term, trunc, info = step(keys, s, hi, params)
    r = np.asarray(r)
    assert set(np.unique(r)) <= {0.0, 1.0}
    assert abs(r.mean() - 0.25) <= 3 * np.sqrt(0.25 * 0.75 / n), r.mean()
    assert np.asarray(term).all() and not np.asarray(trunc).any()
    assert np.asarray(info["success"]).all() and np.asarray(info["action_is_valid"]).all()
    _, _, r, term, _, info = step(keys, s, hi - 1, params)
    np.testing.assert_allclose(np.asarray(r), 0.1)
    assert np.asarray(term).all() and not np.asarray(info["success"]).any()
    # traced parameters: a different hit probability and scores, no recompilation needed
    p2 = env.default_params(lo_arm_score=0.15, hi_arm_hiscore=2.0, hi_arm_hiscore_prob=0.5)
    _, _, r, *_ = step(keys, s, hi, p2)
    assert set(np.unique(np.asarray(r))) <= {0.0, 2.0}
    assert abs(np.asarray(r).mean() - 1.0) <= 3 * 2.0 * np.sqrt(0.25 / n)


def test_same_key_same_prompt_and_all_pairs_and_orders_drawn():
    env = Bandit()
    params = env.default_params()
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    _, group = reset(jnp.stack([jax.random.PRNGKey(7)] * 16), params)
    texts = {env.render_text(jax.tree.map(lambda x: np.asarray(x)[i], group)) for i in range(16)}
    assert len(texts) == 1
    n = 12000
    _, s = reset(jax.random.split(jax.random.PRNGKey(8), n), params)
    counts = np.bincount(np.asarray(s.pair) * 2 + np.asarray(s.hi_first), minlength=24)
    expected = n / 24
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert counts.min() > 0 and chi2 < 23 + 5 * np.sqrt(46), counts


def test_invalid_names_do_not_step_the_game():
    env = Bandit()
    params = env.default_params()
    state = BanditState(time=jnp.int32(0), pair=jnp.int32(3), hi_first=jnp.bool_(False))  # Accountant/StockBroker
    key = jax.random.PRNGKey(0)
    for action in (env.action_names.index("Teacher"), env.action_names.index("Cryptominer"), -1, 24):
        _, s, r, term, trunc, info = env.step_env(key, state, action, params)
        assert r == 0 and not bool(term) and not bool(info["action_is_valid"]) and not bool(info["success"])
        assert bool(trunc)  # default cap of one step: an unusable answer ends the episode as a failure
        assert int(s.pair) == 3 and not bool(s.hi_first)
    retry = env.default_params(max_steps_in_episode=3)
    _, s, r, term, trunc, _ = env.step_env(key, state, 0, retry)
    assert not bool(term) and not bool(trunc) and int(s.time) == 1
    _, _, r, term, _, info = env.step_env(key, s, env.action_names.index("StockBroker"), retry)
    assert bool(term) and bool(info["success"]) and float(r) in (0.0, 1.0)


def test_prompt_text_device_equals_host_for_every_pair_and_order():
    for split in ("train", "test"):
        env = Bandit(split)
        pairs = SPEC_TRAIN if split == "train" else SPEC_TEST
        render_pieces = jax.jit(env.render_pieces)
        for k in range(len(pairs)):
            for hi_first in (False, True):
                s = BanditState(time=jnp.int32(0), pair=jnp.int32(k), hi_first=jnp.bool_(hi_first))
                a, b = _shown(env, s)
                text = env.render_text(s)
                assert f"named {a} and {b}." in text
                assert f"<answer> {a} </answer> or <answer> {b} </answer>" in text
                assert text.count(a) == 2 + (a in b) and text.count(b) == 2 + (b in a)
                pieces, n = render_pieces(s, env.default_params())
                assert render.join(env.piece_table, pieces, n) == text
                np.testing.assert_array_equal(env.observation(s)[0],
                                              [env.action_names.index(a), env.action_names.index(b)])
    assert Bandit().legend() == ""


def test_hand_written_prompt():
    env = Bandit("test")
    s = BanditState(time=jnp.int32(0), pair=jnp.int32(0), hi_first=jnp.bool_(True))
    assert env.render_text(s) == (
        "You are playing a bandit game: pull one of two slot-machine arms and collect its reward.\n"
        "Rules:\n"
        "1. The two arms are named Explorer and Receptionist.\n"
        "2. Each arm pays out from its own reward distribution, and its name hints at that distribution.\n"
        "3. Think about what each name suggests about how risky and how rewarding the arm is.\n"
        "4. Choose the arm you expect to give the higher reward on average, and answer with its name, "
        "either <answer> Explorer </answer> or <answer> Receptionist </answer>.\n"
    )


def test_vmap_4096_and_auto_reset():
    env = make("bandit")
    params = env.default_params()
    n = 4096
    obs, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(2), n), params)
    assert obs.shape == (n, 1, 2)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    obs2, s2, r, term, trunc, info = step(jax.random.split(jax.random.PRNGKey(3), n), s, obs[:, 0, 0], params)
    assert np.asarray(term).all() and (np.asarray(s2.time) == 0).all()  # every episode ended and restarted
    assert r.shape == (n,) and obs2.shape == (n, 1, 2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="split"):
        Bandit("validation")
    with pytest.raises(ValueError, match="observation_format"):
        Bandit(observation_format="grid")
    env = Bandit()
    with pytest.raises(ValueError, match="hi_arm_hiscore_prob"):
        env.default_params(hi_arm_hiscore_prob=1.5)
    with pytest.raises(ValueError, match="max_steps"):
        env.default_params(max_steps_in_episode=0)
    bad = BanditParams(lo_arm_score=jnp.float32(0.1), hi_arm_loscore=jnp.float32(0), hi_arm_hiscore=jnp.float32(1),
                       hi_arm_hiscore_prob=jnp.float32(-0.5), max_steps_in_episode=jnp.int32(1))
    with pytest.raises(ValueError, match="hi_arm_hiscore_prob"):
        env.reset(jax.random.PRNGKey(0), bad)
