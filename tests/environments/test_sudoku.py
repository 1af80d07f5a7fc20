"""Sudoku on device vs Python references of the original: its regex action parser, its step rules,
its generator's guarantees and its render formats.

The references are written from the original's behaviour with Python's ``re`` and NumPy; random
and adversarial answer strings come from Hypothesis (seed derived from the test name) and random
play from fixed NumPy seeds.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from environments import render
from environments.sudoku import expert as solvers
from environments.sudoku import text as sd
from environments.sudoku import Sudoku

ENV = Sudoku()
PARAMS = ENV.default_params()
PATTERNS = [
    r"place\s+(\d+)\s+at\s+row\s+(\d+)\s+col\s+(\d+)",
    r"place\s+(\d+)\s+at\s+\((\d+),\s*(\d+)\)",
    r"place\s+(\d+)\s+at\s+(\d+),\s*(\d+)",
    r"(\d+)\s+at\s+(\d+),\s*(\d+)",
    r"\((\d+),\s*(\d+),\s*(\d+)\)",
    r"(\d+),\s*(\d+),\s*(\d+)",
]


def reference_parse(text: str, n: int = 9):
    """The original's ``parse_action`` -> (kind, row, col, num) in our kinds (ASCII input)."""
    action = text.strip().lower()
    for pattern in PATTERNS:
        m = re.search(pattern, action, flags=re.ASCII)
        if m:
            # Documented difference: a number of more than 9 digits reads as 999999999.
            a, b, c = (int(g) if len(g) <= 9 else 999_999_999 for g in m.groups())
            num, row, col = (a, b, c) if ("place" in action or "at" in action) else (c, a, b)
            if not 1 <= row <= n:
                return sd.ROW_RANGE, row, col, num
            if not 1 <= col <= n:
                return sd.COL_RANGE, row, col, num
            if not 1 <= num <= n:
                return sd.NUM_RANGE, row, col, num
            return 0, row - 1, col - 1, num
    return sd.PARSE_ERROR, None, None, None


_parse = jax.jit(jax.vmap(ENV.parse_action))


def device_parse(texts):
    buf = np.zeros((len(texts), ENV.max_action_bytes), np.uint8)
    n = np.zeros((len(texts),), np.int32)
    for i, t in enumerate(texts):
        data = t.encode()
        buf[i, : len(data)] = np.frombuffer(data, np.uint8)
        n[i] = len(data)
    action, _ = _parse(jnp.asarray(buf), jnp.asarray(n))
    return [{k: int(v[i]) for k, v in action.items()} for i in range(len(texts))]


def _check(texts):
    for text, got in zip(texts, device_parse(texts)):
        kind, row, col, num = reference_parse(text)
        assert got["kind"] == kind, (text, got)
        if kind != sd.PARSE_ERROR:
            assert (got["row"], got["col"], got["num"]) == (row, col, num), (text, got)


def test_parser_on_the_documented_forms():
    _check(["place 5 at row 2 col 3", "PLACE 5 AT ROW 2 COL 3", "place 5 at (2,3)", "place 5 at 2, 3", "5 at 2,3",
            "(2,3,5)", "2,3,5", "2, 3,5", "  9,9,9  ", "place 10 at row 1 col 1", "10,1,1", "1,10,1", "1,1,10",
            "0,1,1", "hello", "", "place 5 at row 2", "(2,3,5) that", "what about 2,3,5", "012,003,005",
            "place 1 at row 1 col 1 or 2,2,2", "x(1,2,3)y", "1,2", "place5 at row 2 col 3", "1 ,2,3",
            "place 5 at row 2 col 3 place 6 at row 1 col 1", "1,2,3,4", "place 12345678901 at row 1 col 1"])


ALPHABET = st.sampled_from(list("0123456789,() \t\n") + ["place", "at", "row", "col", " ", "PLACE", "x", "10"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(ALPHABET, max_size=14).map("".join), min_size=16, max_size=16))
def test_parser_matches_the_regex_reference(texts):
    _check(texts)


class ReferenceSudoku:
    """The original's ``step`` on NumPy grids, with the step cap applied to every step (documented)."""

    def __init__(self, initial, solution, max_steps=81):
        self.grid, self.initial, self.solution = initial.copy(), initial.copy(), solution
        self.steps, self.max_steps = 0, max_steps

    def step(self, text):
        self.steps += 1
        kind, r, c, v = reference_parse(text)
        capped = self.steps >= self.max_steps
        if kind != 0 or self.initial[r, c] != 0:
            return -0.1, False, capped, False
        if v not in solvers.sudoku_candidates(self.grid, r, c) and True:
            k = 3
            br, bc = (r // k) * k, (c // k) * k
            if v in self.grid[r, :] or v in self.grid[:, c] or v in self.grid[br:br + k, bc:bc + k]:
                return -0.1, False, capped, False
        self.grid[r, c] = v
        reward = 1.0 if v == self.solution[r, c] else 0.5
        solved = bool(np.all(self.grid > 0))
        return reward + (10.0 if solved else 0.0), True, capped and not solved, solved


def test_generated_puzzles_are_valid_and_keep_the_difficulty():
    for difficulty, blanks in (("easy", 32), ("medium", 40), ("hard", 48)):
        env = Sudoku(difficulty=difficulty)
        _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.key(0), 50),
                                                                     env.default_params())
        for sol, ini in zip(np.asarray(states.solution), np.asarray(states.initial)):
            for i in range(9):
                assert sorted(sol[i]) == list(range(1, 10)) and sorted(sol[:, i]) == list(range(1, 10))
                b = sol[3 * (i // 3):3 * (i // 3) + 3, 3 * (i % 3):3 * (i % 3) + 3]
                assert sorted(b.reshape(-1)) == list(range(1, 10))
            assert np.sum(ini == 0) == blanks
            assert np.all((ini == 0) | (ini == sol))
    small = Sudoku(grid_size=4)
    _, s = small.reset(jax.random.key(1), small.default_params())
    assert sorted(np.asarray(s.solution)[0]) == [1, 2, 3, 4] and np.sum(np.asarray(s.initial) == 0) == 6


def test_random_play_follows_the_reference_and_renders_exactly():
    step = jax.jit(ENV.step_env)
    rng = np.random.default_rng(0)
    renders = {fmt: jax.jit(lambda s, fmt=fmt: ENV.render_pieces(s, PARAMS, fmt)) for fmt in ENV.observation_formats}
    for episode in range(3):
        _, state = ENV.reset(jax.random.key(episode), PARAMS)
        ref = ReferenceSudoku(np.asarray(state.initial), np.asarray(state.solution))
        sol = np.asarray(state.solution)
        for t in range(40):
            r, c = (int(x) for x in rng.integers(0, 9, 2))
            choice = rng.random()
            v = int(sol[r, c]) if choice < 0.5 else int(rng.integers(1, 10))
            text = [f"place {v} at row {r + 1} col {c + 1}", f"{r + 1},{c + 1},{v}", "nonsense",
                    f"{r + 1},{c + 1},{v + 10}"][int(rng.integers(4)) if choice > 0.8 else int(choice < 0.65)]
            (action,) = [{k: jnp.asarray(x) for k, x in a.items()} for a in device_parse([text])]
            _, state, reward, term, trunc, info = step(jax.random.key(t), state, action, PARAMS)
            want_r, legal, capped, solved = ref.step(text)
            np.testing.assert_allclose(float(reward), want_r, rtol=1e-6)
            assert bool(info["action_is_valid"]) == legal and bool(term) == solved
            np.testing.assert_array_equal(np.asarray(state.grid), ref.grid)
            for fmt, fn in renders.items():
                pieces, n = fn(state)
                assert render.join(ENV.piece_table, pieces, n) == ENV.render_text(state, fmt), (fmt, text)


def test_feedback_texts_are_the_originals():
    _, state = ENV.reset(jax.random.key(4), PARAMS)
    ini, sol = np.asarray(state.initial), np.asarray(state.solution)
    given_rc = tuple(np.argwhere(ini > 0)[0])
    empty_rc = tuple(np.argwhere(ini == 0)[0])
    r, c = empty_rc
    wrong = next(v for v in range(1, 10) if v in ini[r, :])
    cases = [
        ("hello", "❌ Invalid action format: Could not parse action. Expected format: 'place 5 at row 2 col 3' or '2,3,5'"),
        ("12,1,1", "❌ Invalid action format: Row 12 is out of range (1-9)"),
        (f"{given_rc[0] + 1},{given_rc[1] + 1},1", f"❌ Cannot modify initial cell at ({given_rc[0] + 1},{given_rc[1] + 1})"),
        (f"place {sol[r, c]} at row {r + 1} col {c + 1}", f"✓ Correct! Placed {sol[r, c]} at ({r + 1},{c + 1})"),
    ]
    step = jax.jit(ENV.step_env)
    for text, line in cases:
        (action,) = [{k: jnp.asarray(x) for k, x in a.items()} for a in device_parse([text])]
        _, nxt, *_ = step(jax.random.key(0), state, action, PARAMS)
        assert "\n\n" + line + "\n\n" in ENV.render_text(nxt), ENV.render_text(nxt)
    (action,) = [{k: jnp.asarray(x) for k, x in a.items()} for a in device_parse([f"{r + 1},{c + 1},{wrong}"])]
    _, nxt, *_ = step(jax.random.key(0), state, action, PARAMS)
    text = ENV.render_text(nxt)
    assert f"❌ Invalid placement: {wrong} conflicts with row {r + 1}" in text
    assert f"\n   Valid numbers for ({r + 1},{c + 1}): {solvers.sudoku_candidates(ini, r, c)}" in text


def test_solver_completes_every_generated_puzzle_through_the_env():
    for difficulty in ("easy", "hard"):
        env = Sudoku(difficulty=difficulty)
        params = env.default_params()
        step = jax.jit(env.step_env)
        _, state = env.reset(jax.random.key(7), params)
        done = np.asarray(solvers.solve_sudoku(np.asarray(state.initial)))
        for r, c in np.argwhere(np.asarray(state.initial) == 0):
            (action,) = [{k: jnp.asarray(x) for k, x in a.items()}
                         for a in device_parse([env.answer_text(int(r), int(c), int(done[r, c]))])]
            _, state, reward, term, *_ = step(jax.random.key(0), state, action, params)
            assert float(reward) >= 0.5
        assert bool(term)
