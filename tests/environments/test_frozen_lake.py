"""FrozenLake against the NumPy reference (tests/environments/reference_frozen_lake.py) and RAGEN's texts.

Every random input comes from fixed seeds (PRNGKey / default_rng constants), so failures reproduce.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from environments import make, render, text_match
from environments.frozen_lake.env import FrozenLake, FrozenLakeParams, FrozenLakeState, check_params, goal_distance
from tests.environments import reference_frozen_lake as ref


def _params(p=0.9, success_rate=0.8, max_steps=100):
    return FrozenLakeParams(p=jnp.float32(p), success_rate=jnp.float32(success_rate),
                            max_steps_in_episode=jnp.int32(max_steps))


def _state(holes, start, goal, pos=None, time=0):
    holes = np.zeros((len(holes), len(holes[0])), bool) | np.asarray(holes, bool)
    return FrozenLakeState(time=jnp.int32(time), pos=jnp.asarray(start if pos is None else pos, jnp.int32),
                           start=jnp.asarray(start, jnp.int32), goal=jnp.asarray(goal, jnp.int32),
                           holes=jnp.asarray(holes))


def _desc(state, i=None):
    pick = (lambda x: np.asarray(x)) if i is None else (lambda x: np.asarray(x)[i])
    return ref.make_desc(pick(state.holes), pick(state.start), pick(state.goal))


# --- dynamics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("is_slippery", [True, False])
def test_dynamics_match_reference_on_random_action_sequences(is_slippery):
    """1,024 random maps x 24 random actions (some invalid), success_rate varied per env: the JAX env
    and the NumPy reference, fed the same uniform draw per step, agree on every state and flag."""
    n_env, horizon = 1024, 24
    env = FrozenLake(size=4, is_slippery=is_slippery)
    rng = np.random.default_rng(0)
    success = rng.choice(np.float32([1.0, 0.8, 0.5, 1 / 3, 0.0]), n_env)
    params = FrozenLakeParams(p=jnp.full(n_env, 0.75, jnp.float32), success_rate=jnp.asarray(success),
                              max_steps_in_episode=jnp.full(n_env, 20, jnp.int32),
                              description_reward=jnp.zeros(n_env, jnp.float32),
                              distance_shaping=jnp.zeros(n_env, jnp.float32))  # batched: every field
    _, state0 = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(1), n_env), params)
    actions = rng.integers(-1, 5, size=(horizon, n_env))  # -1 and 4 are invalid
    step_keys = jax.random.split(jax.random.PRNGKey(2), horizon * n_env).reshape(horizon, n_env, -1)

    def rollout(state, xs):
        keys, acts = xs
        obs, state, reward, term, trunc, info = jax.vmap(env.step_env)(keys, state, acts, params)
        return state, (state.pos, obs, reward, term, trunc, info)

    _, (pos, obs, reward, term, trunc, info) = jax.jit(lambda s: jax.lax.scan(
        rollout, s, (step_keys, jnp.asarray(actions, jnp.int32))))(state0)
    uniforms = np.asarray(jax.vmap(jax.vmap(jax.random.uniform))(step_keys))
    pos, obs, reward, term, trunc = map(np.asarray, (pos, obs, reward, term, trunc))
    info = {k: np.asarray(v) for k, v in info.items()}

    codes = {"P": 0, "F": 1, "S": 1, "H": 2, "G": 3}
    for i in range(n_env):
        desc = _desc(state0, i)
        lake = ref.ReferenceFrozenLake(desc, success[i], is_slippery, max_steps=20)
        for t in range(horizon):
            if lake.time >= 20:
                break  # the reference episode is over (truncated); the JAX env keeps counting
            r, te, tr, inf = lake.step(int(actions[t, i]), float(uniforms[t, i]))
            ctx = f"env {i} step {t}"
            assert tuple(pos[t, i]) == lake.pos, ctx
            assert reward[t, i] == r and term[t, i] == te and trunc[t, i] == tr, ctx
            for k, v in inf.items():
                assert info[k][t, i] == v, (ctx, k)
            expected_obs = np.array([[codes[ch] for ch in row] for row in desc])
            tile = desc[lake.pos]
            expected_obs[lake.pos] = 4 if tile == "H" else 5 if tile == "G" else 0
            np.testing.assert_array_equal(obs[t, i], expected_obs, err_msg=ctx)


def test_hand_worked_moves():
    """RAGEN's dynamics by hand: clamping at the border, +1 on the goal, holes absorb with reward 0."""
    env = FrozenLake(size=4, is_slippery=False)
    params = _params(success_rate=1.0)
    holes = np.zeros((4, 4), bool)
    holes[1, 1] = True
    s = _state(holes, start=(0, 0), goal=(0, 2))
    key = jax.random.PRNGKey(0)
    _, s1, r, term, trunc, info = env.step_env(key, s, 3, params)  # Up at the top border
    assert tuple(np.asarray(s1.pos)) == (0, 0) and not bool(info["action_is_effective"]) and r == 0
    _, s2, r, term, _, info = env.step_env(key, s1, 2, params)  # Right
    assert tuple(np.asarray(s2.pos)) == (0, 1) and r == 0 and not term and bool(info["action_is_effective"])
    _, s3, r, term, _, info = env.step_env(key, s2, 2, params)  # Right onto the goal
    assert r == 1.0 and bool(term) and bool(info["success"])
    _, s4, r, term, _, info = env.step_env(key, s3, 0, params)  # the goal absorbs, no second reward
    assert tuple(np.asarray(s4.pos)) == (0, 2) and r == 0 and bool(term) and not bool(info["action_is_effective"])
    _, h, r, term, _, info = env.step_env(key, s2, 1, params)  # Down into the hole
    assert tuple(np.asarray(h.pos)) == (1, 1) and r == 0 and bool(term) and not bool(info["success"])
    _, _, _, _, _, info = env.step_env(key, s, 7, params)
    assert not bool(info["action_is_valid"]) and not bool(info["action_is_effective"])


def test_truncation_at_max_steps():
    env = FrozenLake(size=4, is_slippery=False)
    params = _params(max_steps=3)
    s = _state(np.zeros((4, 4)), start=(0, 0), goal=(3, 3))
    flags = []
    for _ in range(3):
        _, s, _, term, trunc, _ = env.step_env(jax.random.PRNGKey(0), s, 0, params)
        flags.append((bool(term), bool(trunc)))
    assert flags == [(False, False), (False, False), (False, True)]


def test_step_auto_resets_to_a_fresh_level():
    env = FrozenLake(size=4, is_slippery=False)
    params = _params(success_rate=1.0)
    s = _state(np.zeros((4, 4)), start=(0, 0), goal=(0, 1), time=5)
    obs, s2, r, term, trunc, info = jax.jit(env.step)(jax.random.PRNGKey(3), s, 2, params)
    assert r == 1.0 and bool(term) and bool(info["success"])
    assert int(s2.time) == 0 and np.array_equal(s2.pos, s2.start)  # a new episode at its start
    assert ref.reachable(_desc(s2))
    np.testing.assert_array_equal(obs, env.observation(s2))
    # not done -> no reset
    s = _state(np.zeros((4, 4)), start=(0, 0), goal=(3, 3))
    _, s3, _, term, trunc, _ = jax.jit(env.step)(jax.random.PRNGKey(3), s, 2, params)
    assert not bool(term) and int(s3.time) == 1 and tuple(np.asarray(s3.pos)) == (0, 1)


def _slip_counts(outcomes, start):
    moved = {tuple(np.asarray(start) + d) for d in ((0, 1), (-1, 0), (1, 0))}
    right, up, down = (tuple(np.asarray(start) + d) for d in ((0, 1), (-1, 0), (1, 0)))
    counts = {k: int(np.sum(np.all(outcomes == np.asarray(v), axis=1))) for k, v in
              (("right", right), ("up", up), ("down", down))}
    assert sum(counts.values()) == len(outcomes), moved
    return counts


@pytest.mark.parametrize("via_step", [False, True])
@pytest.mark.parametrize("success_rate", [0.8, 1 / 3])
def test_slip_frequencies_match_success_rate(success_rate, via_step):
    """Intended move w.p. success_rate, each perpendicular w.p. (1-s)/2: counts within 3 sigma.
    Checked through step_env and through the single-draw auto-resetting step."""
    env = FrozenLake(size=4, is_slippery=True)
    params = _params(success_rate=success_rate)
    n = 20000
    s = _state(np.zeros((4, 4)), start=(1, 1), goal=(3, 3))
    fn = env.step if via_step else env.step_env
    keys = jax.random.split(jax.random.PRNGKey(11), n)
    _, out, *_ = jax.jit(jax.vmap(fn, in_axes=(0, None, None, None)))(keys, s, 2, params)  # Right
    counts = _slip_counts(np.asarray(out.pos), (1, 1))
    for k, prob in (("right", success_rate), ("up", (1 - success_rate) / 2), ("down", (1 - success_rate) / 2)):
        sigma = np.sqrt(n * prob * (1 - prob))
        assert abs(counts[k] - n * prob) <= 3 * sigma, (k, counts)


# --- maps -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_map_has_a_path(size):
    """1,024 keys per size (and a low frozen probability that forces rejections): independent BFS."""
    env = FrozenLake(size=size)
    for p in (0.9, 0.6):
        _, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(
            jax.random.split(jax.random.PRNGKey(size), 1024), _params(p=p))
        assert np.array_equal(np.asarray(s.pos), np.asarray(s.start))
        for i in range(1024):
            desc = _desc(s, i)
            assert (desc == "S").sum() == 1 and (desc == "G").sum() == 1
            assert ref.reachable(desc), (size, p, i, desc)


def test_fallback_when_every_candidate_fails():
    """p=0 makes every cell but S and G a hole: the carved fallback path keeps the map solvable."""
    env = FrozenLake(size=5, map_candidates=2)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))  # p is traced: one compilation
    _, s = reset(jax.random.split(jax.random.PRNGKey(5), 256), _params(p=0.0))
    for i in range(256):
        assert ref.reachable(_desc(s, i))
    _, s = reset(jax.random.split(jax.random.PRNGKey(6), 256), _params(p=1.0))
    assert not np.asarray(s.holes).any()


@pytest.mark.parametrize("size,p", [(4, 0.8), (4, 0.6)])
def test_map_distribution_matches_rejection_sampling(size, p):
    """The first valid of K candidates has the rejection loop's distribution: hole count, start→goal
    distance and start-cell frequencies of 8,192 JAX maps agree with 8,192 NumPy rejection-loop maps."""
    n = 8192
    env = FrozenLake(size=size, map_candidates=8)
    _, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(7), n),
                                                          _params(p=p))
    holes_j = np.asarray(s.holes).sum(axis=(1, 2))
    dist_j = np.abs(np.asarray(s.start) - np.asarray(s.goal)).sum(axis=1)
    rng = np.random.default_rng(7)
    maps = [ref.rejection_map(rng, size, p) for _ in range(n)]
    holes_r = np.array([(m == "H").sum() for m in maps])
    dist_r = np.array([np.abs(np.argwhere(m == "S")[0] - np.argwhere(m == "G")[0]).sum() for m in maps])
    for a, b in ((holes_j, holes_r), (dist_j, dist_r)):
        se = np.sqrt(a.var() / n + b.var() / n)
        assert abs(a.mean() - b.mean()) <= 3 * se, (a.mean(), b.mean(), se)
    # Validity favours fewer holes, so the frozen fraction of the drawn cells is at least p.
    assert 1 - holes_j.mean() / (size * size - 2) >= p
    # Start cells: validity favours the centre (corners are easier to wall in), so compare the two
    # samples' cell histograms with a two-sample chi-square rather than against uniform.
    cells = size * size
    count_j = np.bincount(np.asarray(s.start)[:, 0] * size + np.asarray(s.start)[:, 1], minlength=cells)
    count_r = np.bincount([int(np.argwhere(m == "S")[0] @ [size, 1]) for m in maps], minlength=cells)
    chi2 = ((count_j - count_r) ** 2 / np.maximum(count_j + count_r, 1)).sum()
    assert chi2 < (cells - 1) + 5 * np.sqrt(2 * (cells - 1)), chi2


def test_same_key_same_level_and_determinism():
    """A group shares one reset key -> one level; a rerun with the same keys gives the same bits."""
    env = FrozenLake(size=4)
    params = env.default_params()
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    group_keys = jnp.stack([jax.random.PRNGKey(42)] * 16)
    _, s = reset(group_keys, params)
    for leaf in jax.tree.leaves(s):
        assert (np.asarray(leaf) == np.asarray(leaf)[0]).all()
    keys = jax.random.split(jax.random.PRNGKey(3), 64)
    a = reset(keys, params)
    for i in (0, 17, 63):  # batched == one at a time
        single = jax.jit(env.reset)(keys[i], params)
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x)[i], y), a, single)
    assert len({np.asarray(h).tobytes() for h in a[1].holes}) > 1  # different keys, different maps


def test_vmap_4096_envs_reset_and_step():
    env = make("frozen_lake", size=4)
    params = env.default_params()
    n = 4096
    obs, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(0), n), params)
    assert obs.shape == (n, 4, 4) and obs.dtype == jnp.int32
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    obs, s, r, term, trunc, info = step(keys, s, jnp.zeros(n, jnp.int32), params)
    assert obs.shape == (n, 4, 4) and r.shape == (n,) and info["success"].shape == (n,)
    assert set(np.unique(np.asarray(obs))) <= set(range(6))


# --- renders ----------------------------------------------------------------------------------

SPEC_EXAMPLE_GRID = "____\n__OP\nG___\n____"
SPEC_EXAMPLE_COORD = (
    "Board size: 4 rows x 4 cols (zero-indexed).\n"
    "Start: (1, 3)\n"
    "Goal: (2, 0)\n"
    "Player: (1, 3)\n"
    "Holes: (1, 2)"
)


def _spec_example():
    holes = np.zeros((4, 4), bool)
    holes[1, 2] = True
    return _state(holes, start=(1, 3), goal=(2, 0))


@pytest.mark.parametrize("fmt,expected", [
    ("grid", SPEC_EXAMPLE_GRID),
    ("coord", SPEC_EXAMPLE_COORD),
    ("grid_coord", "Coordinates: \n" + SPEC_EXAMPLE_COORD + "\nGrid Map: \n" + SPEC_EXAMPLE_GRID),
])
def test_spec_worked_example_renders(fmt, expected):
    """RAGEN, CoordFrozenLake seed 123, as a hand-built state: host and device texts."""
    env = FrozenLake(size=4, observation_format=fmt)
    s = _spec_example()
    assert env.render_text(s) == expected
    pieces, n = jax.jit(env.render_pieces)(s, env.default_params())
    assert render.join(env.piece_table, pieces, n) == expected


def test_player_on_goal_in_hole_and_custom_symbols():
    holes = np.zeros((3, 3), bool)
    holes[0, 0] = True
    lookup = {0: "@", 1: ".", 2: "#", 3: "$", 4: "x", 5: "*"}
    env = FrozenLake(size=3, grid_lookup=lookup, observation_format="grid_coord")
    in_hole = _state(holes, start=(2, 2), goal=(1, 0), pos=(0, 0))
    assert env.render_text(in_hole, "grid") == "x..\n$..\n..."
    assert env.render_text(in_hole, "coord") == (
        "Board size: 3 rows x 3 cols (zero-indexed).\nStart: (2, 2)\nGoal: (1, 0)\n"
        "Player in hole: (0, 0)\nHoles: (0, 0)")
    on_goal = _state(holes, start=(2, 2), goal=(1, 0), pos=(1, 0))
    assert env.render_text(on_goal, "grid") == "#..\n*..\n..."
    assert "Player on goal: (1, 0)" in env.render_text(on_goal, "coord")
    assert env.legend() == "@: player, .: empty, #: hole, $: goal, x: player in hole, *: player on goal"
    assert FrozenLake().legend() == "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal"
    render_pieces = jax.jit(env.render_pieces, static_argnums=2)
    for s in (in_hole, on_goal):
        for fmt in ("grid", "coord", "grid_coord"):
            pieces, n = render_pieces(s, env.default_params(), fmt)
            assert render.join(env.piece_table, pieces, n) == env.render_text(s, fmt)
    no_holes = _state(np.zeros((3, 3)), start=(0, 0), goal=(2, 2))
    assert "Holes" not in env.render_text(no_holes, "coord")
    vocab_env = FrozenLake(grid_lookup=lookup, grid_vocab={"@": "you", ".": "ice", "#": "pit", "$": "gift",
                                                           "x": "you in a pit", "*": "you on the gift"})
    assert vocab_env.legend().startswith("@: you, .: ice, #: pit")


@pytest.mark.parametrize("size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_device_pieces_equal_reference_text_on_random_states(size):
    """1,024 random states (random maps, the player on any cell incl. holes and the goal) per format:
    device pieces joined == NumPy reference text == host render_text."""
    n = 1024
    env = FrozenLake(size=size)
    params = env.default_params(p=0.7)
    _, s = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(jax.random.PRNGKey(9), n), params)
    rng = np.random.default_rng(9)
    pos = rng.integers(0, size, size=(n, 2)).astype(np.int32)
    pos[: n // 8] = np.asarray(s.goal)[: n // 8]  # make sure "on goal" is well represented
    s = s.replace(pos=jnp.asarray(pos))
    for fmt in ("grid", "coord", "grid_coord"):
        pieces, lengths = jax.jit(jax.vmap(lambda st: env.render_pieces(st, params, fmt)))(s)
        pieces, lengths = np.asarray(pieces), np.asarray(lengths)
        for i in range(n):
            expected = ref.render(_desc(s, i), pos[i], fmt)
            assert render.join(env.piece_table, pieces[i], lengths[i]) == expected, (fmt, i)
            if i % 16 == 0:
                one = jax.tree.map(lambda x: np.asarray(x)[i], s)
                assert env.render_text(one, fmt) == expected


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"size": 1}, "size"),
    ({"size": "4"}, "size"),
    ({"observation_format": "pixels"}, "observation_format"),
    ({"grid_lookup": {0: "P", 1: "_"}}, "grid_lookup"),
    ({"grid_lookup": {0: "P", 1: "P", 2: "O", 3: "G", 4: "X", 5: "V"}}, "distinct"),
    ({"grid_lookup": {0: "P", 1: "\n", 2: "O", 3: "G", 4: "X", 5: "V"}}, "newline"),
    ({"grid_vocab": {"P": "player"}}, "grid_vocab"),
    ({"map_candidates": 0}, "map_candidates"),
])
def test_bad_constructor_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrozenLake(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"p": 1.5}, "p="), ({"p": -0.1}, "p="), ({"success_rate": 1.2}, "success_rate"),
    ({"max_steps_in_episode": 0}, "max_steps"),
])
def test_bad_params_raise(kwargs, match):
    env = FrozenLake()
    with pytest.raises(ValueError, match=match):
        env.default_params(**kwargs)
    full = {"p": 0.9, "success_rate": 0.8, "max_steps": 10}
    full.update({("max_steps" if k == "max_steps_in_episode" else k): v for k, v in kwargs.items()})
    with pytest.raises(ValueError, match=match):
        env.reset(jax.random.PRNGKey(0), _params(**full))
    with pytest.raises(ValueError, match=match):
        check_params(_params(**full))
    with pytest.raises(ValueError, match="observation_format"):
        env.render_text(_spec_example(), "ascii")


def test_bernoulli_words_bit_frequencies():
    """Bit-parallel Bernoulli: every bit position is 1 with probability p16 / 2**16 (3 sigma), the
    bits of a word are uncorrelated, and the two ends are exact."""
    from environments.frozen_lake.env import bernoulli_words

    n = 4096
    words = jax.random.bits(jax.random.PRNGKey(4), (16, n), jnp.uint32)
    for p in (0.3, 0.9):
        p16 = jnp.uint32(round(p * 65536))
        out = np.asarray(bernoulli_words(p16, words))
        bits = (out[:, None] >> np.arange(32, dtype=np.uint32)) & 1                   # [n, 32]
        assert np.all(np.abs(bits.mean(axis=0) - p) <= 3 * np.sqrt(p * (1 - p) / n)), bits.mean(axis=0)
        both = (bits[:, :-1] & bits[:, 1:]).mean()  # neighbouring bits: P(both) = p^2
        assert abs(both - p * p) <= 3 * np.sqrt(p * p * (1 - p * p) / (n * 31)) * 2
    assert not np.asarray(bernoulli_words(jnp.uint32(0), words)).any()
    assert (np.asarray(bernoulli_words(jnp.uint32(65536), words)) == 0xFFFFFFFF).all()


@pytest.mark.parametrize("size", [2, 3, 6])
def test_other_sizes_have_paths_and_render(size):
    """Odd layouts of the bitboard (several boards per word, rows split across words)."""
    env = FrozenLake(size=size, map_candidates=3)
    params = env.default_params(p=0.6)
    _, s = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(size), 128), params)
    pieces, lengths = jax.jit(jax.vmap(lambda st: env.render_pieces(st, params, "grid_coord")))(s)
    for i in range(128):
        desc = _desc(s, i)
        assert ref.reachable(desc)
        assert render.join(env.piece_table, np.asarray(pieces)[i], lengths[i]) == ref.render(
            desc, np.asarray(s.pos)[i], "grid_coord")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_flood_steps_bound_is_the_exhaustive_worst_case(size):
    """For every free-cell mask and every seed cell, BFS eccentricity <= FLOOD_STEPS[size], with
    equality somewhere (so the bound is tight). Exhaustive: 2**(size*size) masks."""
    from environments.frozen_lake.env import FLOOD_STEPS

    cells = size * size
    masks = np.arange(1 << cells, dtype=np.int64)
    # Neighbours as index arrays; the search below is a plain BFS layer count over all masks at once.
    free = ((masks[:, None] >> np.arange(cells)) & 1).astype(bool)          # [masks, cells]
    nbrs = [[r * size + c for r, c in ((i // size + dr, i % size + dc) for dr, dc in
             ((1, 0), (-1, 0), (0, 1), (0, -1))) if 0 <= r < size and 0 <= c < size] for i in range(cells)]
    worst = 0
    for s in range(cells):
        fr = free.copy()
        fr[:, s] = True
        reach = np.zeros_like(fr)
        reach[:, s] = True
        layers = 0
        while True:
            grown = reach.copy()
            for i in range(cells):
                grown[:, i] |= np.any(reach[:, nbrs[i]], axis=1)
            grown &= fr
            if (grown == reach).all():
                break
            reach, layers = grown, layers + 1
        worst = max(worst, layers)
    assert worst == FLOOD_STEPS[size]


@pytest.mark.parametrize("size, style", [(4, "before_move"), (4, "after_move"), (12, "before_move")])
def test_description_bytes_spell_the_experts_description(size, style):
    """On device, the board's description equals the expert's host-side sentence up to its first ``;``
    (Python string formatting as the reference), two-digit cells included."""
    from environments.frozen_lake.expert import frozen_lake_reasoning

    env = FrozenLake(size=size, expert_reasoning=style)
    ep = env.default_params(p=0.5 if size == 4 else 0.6)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.key(3), 64), ep)
    text, n = jax.jit(jax.vmap(env.description_bytes))(states)
    counts = set()
    for b in range(64):
        s = jax.tree.map(lambda x: np.asarray(x[b]), states)
        expected = frozen_lake_reasoning(s.pos, s.goal, s.holes, "Down", style).split(";")[0] + ";"
        assert bytes(np.asarray(text[b])[: int(n[b])].tolist()).decode() == expected
        counts.add(expected.count("("))
    assert int(n.max()) <= env.description_width
    if style == "before_move":
        assert {2, 3, 4} <= counts  # boards with no, one and two holes next to the player were checked


def test_reasoning_reward_pays_only_an_exact_description():
    env = FrozenLake(size=4, expert_reasoning="before_move")
    ep = env.default_params(p=0.5, description_reward=0.25)
    _, s = env.reset(jax.random.key(1), ep)
    from environments.frozen_lake.expert import frozen_lake_reasoning

    host = jax.tree.map(np.asarray, s)
    right = frozen_lake_reasoning(host.pos, host.goal, host.holes, "Down", "before_move") + "</think><answer>Down</answer>"
    wrong_hole = right.replace("no hole near", "hole at (0, 0)") if "no hole" in right else right.replace(", hole", ", no hole", 1)
    longer = right.split(";")[0] + ", (9, 9);"  # a prefix of the description is not the description

    def reward(text, n=None, params=ep):
        data, size = text_match.encode(text, 80)
        return float(env.reasoning_reward(s, jnp.asarray(data), jnp.int32(size if n is None else n), params))

    assert reward(right) == 0.25
    assert reward(wrong_hole) == 0.0 and reward(longer) == 0.0
    assert reward(right, n=20) == 0.0  # the reply ends inside the description
    assert reward(right, params=env.default_params(p=0.5)) == 0.0  # off by default (RAGEN's rewards)
    with pytest.raises(ValueError, match="description_reward"):
        env.default_params(description_reward=float("nan"))


def _numpy_goal_distance(holes: np.ndarray, goal) -> np.ndarray:
    """Breadth-first search from the goal over the 4-neighbours that are not holes; n * n elsewhere."""
    n = holes.shape[0]
    dist = np.full((n, n), n * n, np.int64)
    dist[tuple(goal)] = 0
    frontier = [tuple(goal)]
    while frontier:
        nxt = []
        for r, c in frontier:
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                rr, cc = r + dr, c + dc
                if 0 <= rr < n and 0 <= cc < n and not holes[rr, cc] and dist[rr, cc] > dist[r, c] + 1:
                    dist[rr, cc] = dist[r, c] + 1
                    nxt.append((rr, cc))
        frontier = nxt
    dist[holes] = n * n
    return dist


@pytest.mark.parametrize("size", [4, 6])
def test_goal_distance_is_the_breadth_first_distance(size):
    """200 random maps (holes with probability 0.3, some cells walled off): equal to a NumPy BFS."""
    rng = np.random.default_rng(7)
    fn = jax.jit(jax.vmap(goal_distance))
    holes = rng.random((200, size, size)) < 0.3
    goals = rng.integers(0, size, (200, 2))
    holes[np.arange(200), goals[:, 0], goals[:, 1]] = False
    got = np.asarray(fn(jnp.asarray(holes), jnp.asarray(goals, jnp.int32)))
    for i in range(200):
        np.testing.assert_array_equal(got[i], _numpy_goal_distance(holes[i], goals[i]))


def test_distance_shaping_hand_worked_and_off_by_default():
    """Goal (0, 2), hole (1, 1): from (0, 0) (distance 2) Right to (0, 1) (1) pays +c; Down to (1, 0)
    (distance 3 around the hole) pays -c; into the hole -c (one move away); onto the goal 1 + c; a bump
    into the border 0. Without the setting every reward is the original's."""
    env = FrozenLake(size=4, is_slippery=False)
    holes = np.zeros((4, 4), bool)
    holes[1, 1] = True
    s = _state(holes, start=(0, 0), goal=(0, 2))
    key = jax.random.PRNGKey(0)
    c = 0.25
    shaped = env.default_params(success_rate=1.0, distance_shaping=c)
    plain = _params(success_rate=1.0)
    np.testing.assert_array_equal(np.asarray(goal_distance(jnp.asarray(holes), jnp.array([0, 2])))[:2],
                                  [[2, 1, 0, 1], [3, 16, 1, 2]])
    cases = [(s, 2, c), (s, 1, -c), (s, 3, 0.0)]
    _, right, _, _, _, _ = env.step_env(key, s, 2, plain)
    cases += [(right, 1, -c), (right, 2, 1.0 + c)]
    for state, action, expected in cases:
        _, _, r, _, _, _ = env.step_env(key, state, action, shaped)
        assert float(r) == pytest.approx(expected)
        _, _, r0, _, _, _ = env.step_env(key, state, action, plain)
        assert float(r0) == (1.0 if expected > 1.0 else 0.0)
    with pytest.raises(ValueError, match="distance_shaping"):
        env.default_params(distance_shaping=float("nan"))
