"""Sokoban: renders against hand-written strings of RAGEN's texts, dynamics against a plain-Python reference,
generated levels against the BFS solver, device pieces against the host render.

All randomness is seeded (``jax.random.PRNGKey`` / ``np.random.default_rng`` with fixed seeds), so
every run checks the same levels and action sequences.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from environments import render, text_match
from environments.sokoban import Sokoban, SokobanState
from environments.sokoban.levels import fallback_room
from environments.sokoban.expert import solve_sokoban
from tests.environments.reference_sokoban import ReferenceSokoban

UP, DOWN, LEFT, RIGHT = range(4)

# RAGEN, CoordSokoban seed 10000.
SPEC_GRID = "######\n#O####\n#__###\n#X_###\n#_P_##\n######"
SPEC_COORD = (
    "Board size: 6 rows x 6 cols (zero-indexed).\n"
    "Targets: (1, 1)\n"
    "Boxes: (3, 1)\n"
    "Player: (4, 2)"
)
SPEC_SOLVED_GRID = "######\n#√####\n#P_###\n#__###\n#___##\n######"


def spec_state() -> SokobanState:
    fixed = np.zeros((6, 6), np.int8)
    for r, c in [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3)]:
        fixed[r, c] = 1
    fixed[1, 1] = 2
    grid = fixed.copy()
    grid[3, 1] = 4
    grid[4, 2] = 5
    return SokobanState(
        time=jnp.int32(0),
        room_fixed=jnp.asarray(fixed),
        grid=jnp.asarray(grid),
        player=jnp.array([4, 2], jnp.int32),
        boxes_on_target=jnp.int32(0),
    )


@functools.lru_cache(maxsize=None)
def _render_fn(env, fmt):
    return jax.jit(functools.partial(env.render_pieces, params=None, fmt=fmt))


def joined(env, state, fmt):
    pieces, n = _render_fn(env, fmt)(state)
    return render.join(env.piece_table, pieces, n)


@pytest.fixture(scope="module")
def env():
    return Sokoban()


@pytest.fixture(scope="module")
def levels(env):
    """4,096 reset states of the default env (6x6, one box), seeded; also checks vmap at 4,096."""
    keys = jax.random.split(jax.random.PRNGKey(2024), 4096)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(keys, env.default_params())
    return jax.tree.map(np.asarray, states)


@pytest.fixture(scope="module")
def gen(env):
    return jax.jit(env.generate)


N_SEQ, T_SEQ, CAP = 1000, 30, 25


@pytest.fixture(scope="module")
def rollout(env, levels):
    """1,000 seeded action sequences of 30 steps (truncation cap 25) from the first 1,000 levels.

    Half the sequences start with the optimal solution, so solving, the +10 bonus and pushing a
    box back off its target (after the solve) are exercised, not only random wandering.
    """
    rng = np.random.default_rng(7)
    actions = rng.integers(0, 4, size=(N_SEQ, T_SEQ))
    for i in range(0, N_SEQ, 2):
        sol = solve_sokoban(levels.room_fixed[i], levels.grid[i])
        actions[i, : len(sol)] = sol[:T_SEQ]
    params = env.default_params().replace(max_steps_in_episode=jnp.int32(CAP))
    states = jax.tree.map(lambda x: jnp.asarray(x[:N_SEQ]), levels)
    out = jax.tree.map(np.asarray, _rollout_jax(env, states, jnp.asarray(actions), params))
    return actions, out


# --- renders -------------------------------------------------------------------------------------


def test_spec_example_renders(env):
    s = spec_state()
    assert env.render_text(s, "grid") == SPEC_GRID
    assert env.render_text(s, "coord") == SPEC_COORD
    assert env.render_text(s, "grid_coord") == "Coordinates: \n" + SPEC_COORD + "\nGrid Map: \n" + SPEC_GRID
    for fmt in ("grid", "coord", "grid_coord"):
        assert joined(env, s, fmt) == env.render_text(s, fmt)
    assert env.legend() == "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target"


def test_spec_example_solution_rewards_and_final_grid(env):
    # Spec: optimal solution Left, Up, Up; step rewards -0.1, -0.1, 10.9; final grid shows √.
    s, p = spec_state(), env.default_params()
    rewards, flags = [], []
    step = jax.jit(env.step_env)
    for a in (LEFT, UP, UP):
        _, s, r, term, trunc, info = step(jax.random.PRNGKey(0), s, a, p)
        rewards.append(float(r))
        flags.append((bool(term), bool(trunc), bool(info["success"]), bool(info["action_is_effective"])))
    np.testing.assert_allclose(rewards, [-0.1, -0.1, 10.9], atol=1e-6)
    assert flags == [(False, False, False, True), (False, False, False, True), (True, False, True, True)]
    assert env.render_text(s, "grid") == SPEC_SOLVED_GRID
    assert joined(env, s, "grid") == SPEC_SOLVED_GRID
    assert env.render_text(s, "coord") == (
        "Board size: 6 rows x 6 cols (zero-indexed).\nTargets: (1, 1)\nBoxes on target: (1, 1)\nPlayer: (2, 1)"
    )
    assert solve_sokoban(spec_state().room_fixed, spec_state().grid) == [LEFT, UP, UP]


def test_player_on_target_and_custom_symbol_table():
    lookup = {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}  # SokobanDifferentGridVocab
    env = Sokoban(grid_lookup=lookup, observation_format="grid_coord")
    s = spec_state()
    assert env.render_text(s, "grid") == "WWWWWW\nWGWWWW\nW..WWW\nWB.WWW\nW.A.WW\nWWWWWW"
    assert env.legend() == "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target"
    # The player standing on the target: rendered with code 6's symbol and listed as such.
    s2 = spec_state().replace(
        grid=spec_state().grid.at[4, 2].set(1).at[1, 1].set(6), player=jnp.array([1, 1], jnp.int32)
    )
    text = env.render_text(s2, "grid_coord")
    assert text == (
        "Coordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\nTargets: (1, 1)\nBoxes: (3, 1)\n"
        "Player on target: (1, 1)\nGrid Map: \nWWWWWW\nW@WWWW\nW..WWW\nWB.WWW\nW...WW\nWWWWWW"
    )
    assert joined(env, s2, None) == text
    # Default symbols: the player on a target is "S".
    assert Sokoban().render_text(s2, "grid").splitlines()[1] == "#S####"


def test_custom_vocab_is_used_verbatim():
    env = Sokoban(grid_vocab={"#": "wall", "_": "floor"})
    assert env.legend() == "#: wall, _: floor"


# --- dynamics vs the reference --------------------------------------------------------------------


def _rollout_jax(env, states, actions, params):
    """vmap over envs, scan over time: step_env on [B] states with actions [B, T]."""

    def one(state, acts):
        def body(s, a):
            _, s, r, term, trunc, info = env.step_env(jax.random.PRNGKey(0), s, a, params)
            return s, (s.grid, s.player, r, term, trunc, info["action_is_effective"], info["success"],
                       info["action_is_valid"])

        return jax.lax.scan(body, state, acts)[1]

    return jax.jit(jax.vmap(one))(states, actions)


def test_dynamics_match_reference_on_1000_random_sequences(levels, rollout):
    actions, (grid, player, reward, term, trunc, eff, succ, valid) = rollout
    n, t = actions.shape
    assert valid.all()
    solved_any = 0
    for i in range(n):
        ref = ReferenceSokoban(levels.room_fixed[i], levels.grid[i], max_steps=CAP)
        for k in range(t):
            r, te, tr, info = ref.step(int(actions[i, k]))
            np.testing.assert_array_equal(grid[i, k], ref.render_codes(), err_msg=f"seq {i} step {k}")
            np.testing.assert_array_equal(player[i, k], ref.player)
            assert abs(reward[i, k] - r) < 1e-5, (i, k, reward[i, k], r)
            assert (term[i, k], trunc[i, k]) == (te, tr), (i, k)
            assert eff[i, k] == info["action_is_effective"] and succ[i, k] == info["success"], (i, k)
            solved_any += te
    assert solved_any >= n // 2  # every solution-prefixed sequence solves its level


def test_invalid_action_index_is_a_noop_step(env):
    s, p = spec_state(), env.default_params()
    _, s2, r, term, trunc, info = env.step_env(jax.random.PRNGKey(0), s, 7, p)
    assert not bool(info["action_is_valid"]) and not bool(info["action_is_effective"])
    np.testing.assert_array_equal(s2.grid, s.grid)
    assert abs(float(r) + 0.1) < 1e-6 and int(s2.time) == 1
    # Bumping a wall is valid but ineffective.
    _, _, _, _, _, info = env.step_env(jax.random.PRNGKey(0), s, DOWN, p)
    assert bool(info["action_is_valid"]) and not bool(info["action_is_effective"])


# --- generated levels -----------------------------------------------------------------------------


def _check_structure(levels, num_boxes):
    fixed, grid = levels.room_fixed, levels.grid
    assert (fixed[:, 0, :] == 0).all() and (fixed[:, -1, :] == 0).all()
    assert (fixed[:, :, 0] == 0).all() and (fixed[:, :, -1] == 0).all()
    assert ((fixed == 2).sum((1, 2)) == num_boxes).all()
    assert ((grid == 4).sum((1, 2)) == num_boxes).all()  # boxes, none on a target
    assert ((grid == 3).sum((1, 2)) == 0).all()
    assert (((grid == 5) | (grid == 6)).sum((1, 2)) == 1).all()
    rows = np.arange(len(grid))
    assert np.isin(grid[rows, levels.player[:, 0], levels.player[:, 1]], [5, 6]).all()
    assert ((grid == 0) == (fixed == 0)).all()


def test_generated_levels_solvable_and_distribution_like_ragen(env, levels):
    _check_structure(levels, 1)
    assert (levels.boxes_on_target == 0).all() and (levels.time == 0).all()
    lengths = []
    for i in range(1000):
        sol = solve_sokoban(levels.room_fixed[i], levels.grid[i])
        assert sol is not None and len(sol) > 0, f"level {i} unsolvable or already solved"
        lengths.append(len(sol))
    lengths = np.array(lengths)
    hist = np.bincount(lengths)
    print("6x6/1 optimal solution lengths: median", np.median(lengths), "histogram", hist.tolist())
    # RAGEN (200 seeds): lengths 1..14, median ~4, 99 % within 10, ~10 % single push.
    assert 3 <= np.median(lengths) <= 5
    assert np.mean(lengths <= 10) >= 0.97
    assert 0.04 <= np.mean(lengths == 1) <= 0.2
    assert lengths.max() <= 20
    # Levels are diverse. Small rooms repeat in the original too: gym-sokoban's generate_room gave
    # 793 distinct rooms for seeds 0..999 (6x6, one box; before RAGEN's player jitter).
    flat = {(f.tobytes(), g.tobytes()) for f, g in zip(levels.room_fixed[:1000], levels.grid[:1000])}
    assert len(flat) >= 850


@pytest.mark.slow
@pytest.mark.parametrize("dim,boxes", [((6, 6), 1), ((8, 8), 2), ((10, 10), 3)])
def test_generated_levels_solvable_1000_keys(dim, boxes):
    env = Sokoban(dim_room=dim, num_boxes=boxes)
    keys = jax.random.split(jax.random.PRNGKey(11), 1000)
    levels = jax.tree.map(np.asarray, jax.jit(jax.vmap(env.generate))(keys))
    _check_structure(levels, boxes)
    lengths = []
    for i in range(1000):
        sol = solve_sokoban(levels.room_fixed[i], levels.grid[i])
        assert sol is not None and len(sol) > 0, f"{dim}/{boxes}: level {i} unsolvable"
        lengths.append(len(sol))
    print(f"{dim}/{boxes} optimal lengths: median {np.median(lengths)}, hist {np.bincount(lengths).tolist()}")


def test_fallback_room_is_solvable():
    for dim, boxes in [((6, 6), 1), ((8, 8), 2), ((10, 10), 3), ((7, 4), 2), ((5, 3), 1)]:
        fixed, grid, player = fallback_room(*dim, boxes)
        assert tuple(np.argwhere(grid == 5)[0]) == tuple(player)
        assert solve_sokoban(fixed, grid), (dim, boxes)


def test_generation_is_deterministic_per_key(env, gen):
    a, b = gen(jax.random.PRNGKey(5)), gen(jax.random.PRNGKey(5))
    c = gen(jax.random.PRNGKey(6))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert any((np.asarray(x) != np.asarray(y)).any() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)))
    # Batched generation gives each key the level it gets alone.
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    batched = jax.jit(jax.vmap(env.generate))(keys)
    single = gen(keys[1])
    for x, y in zip(jax.tree.leaves(batched), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(x)[1], y)


# --- auto-reset -----------------------------------------------------------------------------------


def test_auto_reset_generates_fresh_levels_for_finished_lanes_only(levels, gen):
    b = 4096  # also: vmap over 4,096 envs runs
    # Same generator as the default env; chunks of 4 and 16 (two compiled sizes keep the test quick)
    # so the 203 finished lanes below take several trips of both sizes.
    env = Sokoban(reset_chunk=16)
    assert env.generator._chunks_for(b) == (4, 16)
    params = env.default_params()
    states = jax.tree.map(jnp.asarray, levels)
    # Lanes 0, 5, 9 are one step from truncation; lanes 100..299 too (a chunk-sized group).
    time = np.zeros(b, np.int32)
    time[[0, 5, 9]] = env.max_steps - 1
    time[100:300] = env.max_steps - 1
    states = states.replace(time=jnp.asarray(time))
    keys = jax.random.split(jax.random.PRNGKey(3), b)
    actions = jax.random.randint(jax.random.PRNGKey(8), (b,), 0, 4)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    obs, new, reward, term, trunc, _ = step(keys, states, actions, params)
    assert obs.shape == (b, 6, 6) and reward.shape == (b,)
    _, plain, *_ = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))(keys, states, actions, params)
    new, plain = jax.tree.map(np.asarray, new), jax.tree.map(np.asarray, plain)
    done = np.asarray(term | trunc)
    assert done[time > 0].all()
    np.testing.assert_array_equal(np.asarray(obs), new.grid)
    for i in np.flatnonzero(done)[:40]:
        level = gen(jax.random.split(keys[i])[1])
        np.testing.assert_array_equal(new.grid[i], level.grid)
        np.testing.assert_array_equal(new.room_fixed[i], level.room_fixed)
        np.testing.assert_array_equal(new.player[i], level.player)
        assert new.time[i] == 0 and new.boxes_on_target[i] == 0
    assert (new.grid[done] != 0).any(axis=(1, 2)).all()  # every finished lane got a real room
    live = ~done
    for name in ("grid", "room_fixed", "player", "time", "boxes_on_target"):
        np.testing.assert_array_equal(getattr(new, name)[live], getattr(plain, name)[live])
    # The unbatched step (the lax.cond path) agrees with the batched one.
    one = jax.jit(env.step)
    for i in (0, 1):
        _, s1, *_ = one(keys[i], jax.tree.map(lambda x: x[i], states), actions[i], params)
        np.testing.assert_array_equal(s1.grid, new.grid[i])


# --- device pieces == host text ------------------------------------------------------------------


@pytest.mark.parametrize("lookup", [None, {0: "W", 1: ".", 2: "G", 3: "C", 4: "B", 5: "A", 6: "@"}])
def test_device_pieces_equal_host_text_on_random_states(levels, rollout, lookup):
    renv = Sokoban(grid_lookup=lookup)
    n, t = 64, T_SEQ  # the first 64 sequences: half solve their level, then wander on
    _, (grids, players, *_) = rollout
    flat = SokobanState(
        grid=jnp.asarray(grids[:n].reshape(n * t, 6, 6)),
        player=jnp.asarray(players[:n].reshape(n * t, 2)),
        room_fixed=jnp.asarray(np.repeat(levels.room_fixed[:n], t, axis=0)),
        time=jnp.zeros(n * t, jnp.int32),
        boxes_on_target=jnp.zeros(n * t, jnp.int32),
    )
    for fmt in ("grid", "coord", "grid_coord"):
        pieces, counts = jax.jit(jax.vmap(functools.partial(renv.render_pieces, params=None, fmt=fmt)))(flat)
        assert pieces.shape[1] == renv.max_pieces(fmt)
        pieces, counts = np.asarray(pieces), np.asarray(counts)
        host = jax.tree.map(np.asarray, flat)
        for i in range(n * t):
            s = jax.tree.map(lambda x: x[i], host)
            assert render.join(renv.piece_table, pieces[i], counts[i]) == renv.render_text(s, fmt), (fmt, i)


# --- bad parameters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim_room=(2, 6)), "too small"),
        (dict(dim_room=(3, 3)), "cannot hold"),
        (dict(dim_room=(6, 6), num_boxes=5), "cannot hold"),
        (dict(num_boxes=0), "num_boxes"),
        (dict(observation_format="image"), "observation_format"),
        (dict(grid_lookup={0: "#", 1: "_"}), "lacks codes"),
        (dict(max_steps=0), "max_steps"),
        (dict(dim_room=(6, 40)), "32 columns"),
        (dict(dim_room=6), "pair"),
        (dict(num_candidates=0), "generator settings"),
    ],
)
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sokoban(**kwargs)


def test_unknown_render_format_raises(env):
    with pytest.raises(ValueError, match="observation_format"):
        env.render_text(spec_state(), "ascii")


def test_reward_shaping_hand_worked():
    """Level of ``reset(key(0))``: player (4, 2), box (3, 3), target (1, 3). Off by default (the
    original's rewards); with distance shaping 0.5 a push that brings the box one cell closer earns
    +0.5, with a no-op penalty 0.2 walking into a wall costs 0.2 more."""
    import environments

    env = environments.make("sokoban")
    _, st = env.reset(jax.random.key(0), env.default_params())
    assert env.render_text(st).splitlines()[3:5] == ["#_#X_#", "#_P__#"]
    up, right = 0, 3
    plain = env.default_params()
    shaped = env.default_params(distance_shaping=0.5, noop_penalty=0.2)
    key = jax.random.key(1)
    _, s_plain, r, *_ = env.step_env(key, st, up, plain)  # wall above the player: nothing moves
    assert float(r) == pytest.approx(-0.1)
    _, _, r, *_ = env.step_env(key, st, up, shaped)
    assert float(r) == pytest.approx(-0.3)
    _, st2, r, *_ = env.step_env(key, st, right, shaped)  # a step, no push: no shaping
    assert float(r) == pytest.approx(-0.1)
    _, _, r, *_ = env.step_env(key, st2, up, shaped)  # push the box from (3, 3) to (2, 3): 2 -> 1
    assert float(r) == pytest.approx(-0.1 + 0.5)
    _, _, r, *_ = env.step_env(key, st2, up, plain)
    assert float(r) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="noop_penalty"):
        env.default_params(noop_penalty=-1.0)


# --- a reward for reading the board right ----------------------------------------------------------

def _host_description(state) -> str:
    """The expert's host-side sentence (Python formatting, NumPy's row-major argwhere) up to its first ``;``."""
    from environments.sokoban.expert import sokoban_reasoning
    from environments.sokoban.levels import BOX, BOX_ON_TARGET, TARGET

    s = jax.tree.map(np.asarray, state)
    boxes = np.argwhere((s.grid == BOX) | (s.grid == BOX_ON_TARGET))
    return sokoban_reasoning(s.player, boxes, np.argwhere(s.room_fixed == TARGET), "Up").split(";")[0] + ";"


@pytest.mark.parametrize("dim, boxes", [((6, 6), 1), ((7, 7), 2)])
def test_description_bytes_spell_the_experts_description(dim, boxes):
    """On device, the board's description equals the expert's sentence up to its first ``;`` on 32
    generated levels; with two boxes it names the first box and target in row-major order, as the expert."""
    env = Sokoban(dim_room=dim, num_boxes=boxes)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.key(5), 32),
                                                                 env.default_params())
    text, n = jax.jit(jax.vmap(env.description_bytes))(states)
    for b in range(32):
        state = jax.tree.map(lambda x: x[b], states)
        assert bytes(np.asarray(text[b])[: int(n[b])].tolist()).decode() == _host_description(state)
    assert int(n.max()) <= env.description_width


def test_description_of_a_hand_made_room_with_two_digit_cells_and_a_box_on_target():
    """12×12 with targets at (1, 1) and (10, 10): a box on the first (code 3), a second box at (5, 5),
    the player on the second (code 6) — cells of two digits, and codes 3 / 6 read as box / player."""
    env = Sokoban(dim_room=(12, 12), num_boxes=2)
    fixed = np.ones((12, 12), np.int8)
    fixed[0, :] = fixed[-1, :] = fixed[:, 0] = fixed[:, -1] = 0
    fixed[1, 1] = fixed[10, 10] = 2
    grid = fixed.copy()
    grid[1, 1], grid[5, 5], grid[10, 10] = 3, 4, 6
    state = SokobanState(time=jnp.int32(0), room_fixed=jnp.asarray(fixed), grid=jnp.asarray(grid),
                         player=jnp.array([10, 10], jnp.int32), boxes_on_target=jnp.int32(1))
    text, n = env.description_bytes(state)
    expected = "The player is at (10, 10), the box at (1, 1) and the target at (1, 1);"
    assert _host_description(state) == expected
    assert bytes(np.asarray(text)[: int(n)].tolist()).decode() == expected
    assert int(n) <= env.description_width


def test_reasoning_reward_pays_only_an_exact_description(env):
    _, s = env.reset(jax.random.key(0), env.default_params())
    paid = env.default_params(description_reward=0.5)
    right = _host_description(s)[:-1] + "; I move Up.</think><answer>Up</answer>"
    assert right.startswith("The player is at (4, 2), the box at (3, 3) and the target at (1, 3);")
    wrong_box = right.replace("box at (3, 3)", "box at (3, 2)")
    longer = right.split(";")[0] + ", (9, 9);"  # a prefix of the description is not the description

    def reward(text, n=None, params=paid):
        data, size = text_match.encode(text, 96)
        return float(env.reasoning_reward(s, jnp.asarray(data), jnp.int32(size if n is None else n), params))

    assert reward(right) == 0.5
    assert reward(wrong_box) == 0.0 and reward(longer) == 0.0
    assert reward(right, n=30) == 0.0  # the reply ends inside the description
    assert reward(right, params=env.default_params()) == 0.0  # off by default (RAGEN's rewards)
    assert env.gives_reasoning_reward(paid) and not env.gives_reasoning_reward(env.default_params())
    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="description_reward"):
            env.default_params(description_reward=bad)
