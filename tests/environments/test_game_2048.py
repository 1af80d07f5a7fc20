"""2048 on device vs the plain-Python reference of the original's rules (tests/environments/reference_2048.py).

Random boards and random action sequences from fixed seeds: moves and merge rewards equal the
reference's; the only other change of a step is one spawned 2 or 4 on a cell the move left empty;
termination, score and text follow. The spawn rule's statistics and the expert's strength are
measured on fixed seeds too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments.game_2048 import expert as solvers
from environments.game_2048.env import Game2048, slide
from tests.environments import reference_2048 as ref

ENV = Game2048()
PARAMS = ENV.default_params()


def values(board) -> np.ndarray:
    b = np.asarray(board)
    return np.where(b == 0, 0, 2 ** b.astype(np.int64))


def random_board(rng) -> np.ndarray:
    b = rng.integers(0, 6, (4, 4))
    b[rng.random((4, 4)) < 0.4] = 0
    return b.astype(np.int32)


def test_moves_equal_the_reference_on_random_boards():
    rng = np.random.default_rng(0)
    boards = np.stack([random_board(rng) for _ in range(300)])
    moved, gains = jax.jit(jax.vmap(slide))(jnp.asarray(boards))
    for i, b in enumerate(boards):
        for a in range(4):
            want, reward, _ = ref.move(values(b), a)
            np.testing.assert_array_equal(values(moved[i, a]), want, err_msg=f"board {i} action {a}")
            assert int(gains[i, a]) == reward
            np.testing.assert_array_equal(solvers.slide_2048(b, a)[0], np.asarray(moved[i, a]))


def test_random_action_sequences_follow_the_reference():
    step = jax.jit(ENV.step_env)
    render_pieces = jax.jit(lambda s: ENV.render_pieces(s, PARAMS))
    rng = np.random.default_rng(1)
    for episode in range(6):
        _, state = ENV.reset(jax.random.key(episode), PARAMS)
        assert np.sum(np.asarray(state.board) > 0) == 2
        score = 0
        for t in range(60):
            grid = values(state.board)
            a = int(rng.integers(4))
            want, merged, moved = ref.move(grid, a)
            _, nxt, reward, term, trunc, info = step(jax.random.key(1000 * episode + t), state, a, PARAMS)
            got = values(nxt.board)
            if moved:
                diff = np.argwhere(got != want)
                assert len(diff) == 1 and want[tuple(diff[0])] == 0 and got[tuple(diff[0])] in (2, 4)
                score += merged
                expect = 0.1 * np.log2(merged + 1) if merged else 0.0
            else:
                np.testing.assert_array_equal(got, grid)
                expect = -0.1  # the invalid-move penalty (the original's log reward dropped it)
            np.testing.assert_allclose(float(reward), expect, rtol=1e-6, atol=1e-7)
            assert bool(info["action_is_valid"]) == moved
            assert int(nxt.score) == score
            assert bool(term) == (moved and not ref.valid_moves(got))
            text = ENV.render_text(nxt)
            assert text == ref.render(got, score)
            pieces, n = render_pieces(nxt)
            assert render.join(ENV.piece_table, pieces, n) == text
            state = nxt
            if bool(term):
                break


def test_raw_reward_pays_the_merge_sum():
    params = ENV.default_params(use_log_reward=False)
    board = jnp.asarray([[1, 1, 2, 2], [0] * 4, [0] * 4, [0] * 4], jnp.int32)
    state = ENV.reset(jax.random.key(0), params)[1].replace(board=board, score=jnp.int32(0))
    _, nxt, reward, *_ = ENV.step_env(jax.random.key(1), state, 3, params)  # Left: 2+2 -> 4, 4+4 -> 8
    assert float(reward) == 12.0 and int(nxt.score) == 12


def test_spawn_rule_statistics():
    """Reset spawns two tiles: a 2 with probability two_prob (0.9) and otherwise a 4, on uniform cells."""
    _, states = jax.jit(jax.vmap(ENV.reset, in_axes=(0, None)))(jax.random.split(jax.random.key(3), 4000), PARAMS)
    boards = np.asarray(states.board)
    tiles = boards[boards > 0]
    assert len(tiles) == 8000
    frac_two = np.mean(tiles == 1)
    assert abs(frac_two - 0.9) < 4 * np.sqrt(0.09 / 8000)
    per_cell = np.sum(boards > 0, axis=0).reshape(-1)
    expected = 8000 / 16
    chi2 = np.sum((per_cell - expected) ** 2 / expected)
    assert chi2 < 45, per_cell  # 15 degrees of freedom: p < 1e-4 beyond 45


def test_hand_worked_render():
    state = ENV.reset(jax.random.key(0), PARAMS)[1].replace(
        board=jnp.asarray([[1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 3, 4], [4, 3, 2, 1]], jnp.int32), score=jnp.int32(36))
    assert ENV.render_text(state) == (
        "Current 2048 Grid:\nRow 1: [2, 4, 8, 16]\nRow 2: [16, 8, 4, 2]\nRow 3: [2, 4, 8, 16]\nRow 4: [16, 8, 4, 2]\n\n"
        "Valid Actions: None.\nGoal: Merge same numbers to reach 2048.\nCurrent Score: 36\nWhat is your next move?")


def test_expert_outplays_random_moves():
    """Whole games (capped at 600 moves): the expectimax expert scores at least twice what random
    valid moves score (measured: ~4,000 and a 256 tile vs ~1,300)."""
    def play(policy, game):
        rng = np.random.default_rng(game)
        _, state = ENV.reset(jax.random.key(game), PARAMS)
        step = jax.jit(ENV.step_env)
        for t in range(600):
            board = np.asarray(state.board)
            a = policy(board, rng)
            if a is None:
                break
            _, state, _, term, *_ = step(jax.random.key(10_000 * game + t), state, a, PARAMS)
            if bool(term):
                break
        return int(state.score)

    expert = [play(lambda b, r: solvers.best_2048_move(b), g) for g in range(2)]
    randomly = [play(lambda b, r: (lambda v: int(r.choice(v)) if v else None)(
        [a for a in range(4) if not np.array_equal(solvers.slide_2048(b, a)[0], b)]), g) for g in range(2)]
    assert np.mean(expert) > 2 * np.mean(randomly), (expert, randomly)
