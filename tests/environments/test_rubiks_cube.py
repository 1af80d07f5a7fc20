"""The 2×2 cube against a 3-D model of a cube and against the original's move code.

The 3-D model places every sticker at a corner cubie position with an outward normal and turns a
face by a 90° rotation of the stickers on its side — a reference written from geometry, not from
the permutation tables. The original's moves are transcribed as its sequence of swaps. Then random
action sequences (fixed seeds) compare the env with the reference dynamics, the device render with
the host text, and the solver with breadth-first search.
"""
from __future__ import annotations


import jax
import numpy as np

from environments import render
from environments.rubiks_cube import expert as solvers
from environments.rubiks_cube.env import ACTION_NAMES, SOLVED, RubiksCube, move_table

# Sticker -> (cubie position, outward normal); faces U, L, F, R, B, D in reading order.
_FACES = {
    (0, 1, 0): [(-1, 1, -1), (1, 1, -1), (-1, 1, 1), (1, 1, 1)],
    (-1, 0, 0): [(-1, 1, -1), (-1, 1, 1), (-1, -1, -1), (-1, -1, 1)],
    (0, 0, 1): [(-1, 1, 1), (1, 1, 1), (-1, -1, 1), (1, -1, 1)],
    (1, 0, 0): [(1, 1, 1), (1, 1, -1), (1, -1, 1), (1, -1, -1)],
    (0, 0, -1): [(1, 1, -1), (-1, 1, -1), (1, -1, -1), (-1, -1, -1)],
    (0, -1, 0): [(-1, -1, 1), (1, -1, 1), (-1, -1, -1), (1, -1, -1)],
}
STICKERS = [(np.array(p), np.array(n)) for n, ps in _FACES.items() for p in ps]
AXES = {"U": (0, 1, 0), "D": (0, -1, 0), "L": (-1, 0, 0), "R": (1, 0, 0), "F": (0, 0, 1), "B": (0, 0, -1)}


def physical_perm(face: str) -> list[int]:
    """``new[j] = old[perm[j]]`` for a clockwise quarter turn of ``face`` seen from outside."""
    a = np.array(AXES[face])
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    rot = np.rint(np.eye(3) - k + k @ k).astype(int)  # -90° about the outward axis
    perm = [None] * 24
    for i, (p, n) in enumerate(STICKERS):
        p2, n2 = (rot @ p, rot @ n) if p @ a > 0 else (p, n)
        j = next(j for j, (q, m) in enumerate(STICKERS) if (q == p2).all() and (m == n2).all())
        perm[j] = i
    return perm


def original_move(state: list, face: str) -> list:
    """The original's ``_move_X`` as its swaps (``ragen/env/rubikscube/env.py``)."""
    s = list(state)

    def turn_face(f):
        b = 4 * f
        s[b], s[b + 2], s[b + 3], s[b + 1] = s[b + 2], s[b + 3], s[b + 1], s[b]

    def cycle(*groups):  # s[g0] <- s[g1] <- s[g2] <- s[g3] <- old s[g0]
        old = [[s[i] for i in g] for g in groups]
        for k, g in enumerate(groups):
            for i, v in zip(g, old[(k + 1) % len(groups)]):
                s[i] = v

    if face == "U":
        turn_face(0); cycle((8, 9), (12, 13), (16, 17), (4, 5))
    if face == "D":
        turn_face(5); cycle((10, 11), (6, 7), (18, 19), (14, 15))
    if face == "L":
        turn_face(1); cycle((0, 2), (19, 17), (20, 22), (8, 10))
    if face == "R":
        turn_face(3); cycle((1, 3), (9, 11), (21, 23), (18, 16))
    if face == "F":
        turn_face(2); cycle((2, 3), (7, 5), (21, 20), (12, 14))
    if face == "B":
        turn_face(4); cycle((0, 1), (13, 15), (22, 23), (6, 4))
    return s


def test_moves_are_the_physical_rotations_and_the_original_ones():
    phys, rag = move_table("physical"), move_table("ragen")
    for i, face in enumerate("UDLRFB"):
        assert list(phys[2 * i]) == physical_perm(face), face
        assert list(rag[2 * i]) == original_move(list(range(24)), face), face
        p = phys[2 * i]
        assert list(phys[2 * i + 1]) == list(p[p[p]])  # the prime is three quarter turns
    # The original's back turn is the only move that is not a rotation.
    assert [f for i, f in enumerate("UDLRFB") if list(rag[2 * i]) != physical_perm(f)] == ["B"]


def reference_step(stickers: list, action: int, moves: str) -> list:
    face = "UDLRFB"[action // 2]
    turns = 3 if action % 2 else 1
    for _ in range(turns):
        if moves == "ragen":
            stickers = original_move(stickers, face)
        else:
            perm = physical_perm(face)
            stickers = [stickers[perm[j]] for j in range(24)]
    return stickers


def test_random_sequences_follow_the_reference():
    for moves in ("physical", "ragen"):
        env = RubiksCube(moves=moves)
        params = env.default_params(scramble_depth=4, max_steps_in_episode=20)
        step = jax.jit(env.step_env)
        pieces = jax.jit(lambda s: env.render_pieces(s, params))
        rng = np.random.default_rng(0)
        for episode in range(4):
            _, state = env.reset(jax.random.key(episode), params)
            ref = [int(v) for v in np.asarray(state.stickers)]
            for t in range(20):
                a = int(rng.integers(12))
                _, state, reward, term, trunc, info = step(jax.random.key(t), state, a, params)
                ref = reference_step(ref, a, moves)
                assert [int(v) for v in np.asarray(state.stickers)] == ref
                solved = all(len(set(ref[4 * f:4 * f + 4])) == 1 for f in range(6))
                assert bool(term) == solved and float(reward) == float(solved)
                assert bool(trunc) == (not solved and t + 1 >= 20)
                p, n = pieces(state)
                assert render.join(env.piece_table, p, n) == env.render_text(state)
                if solved or bool(trunc):
                    break


def test_scramble_depth_and_render_text():
    env = RubiksCube()
    params = env.default_params(scramble_depth=0)
    _, state = env.reset(jax.random.key(0), params)
    np.testing.assert_array_equal(np.asarray(state.stickers), SOLVED)
    text = env.render_text(state)
    assert text.startswith("=== Rubik's Cube 2x2 State ===\nStep: 0/20\n\nUp (U):    [W, W]\n [W, W]\nLeft (L):  [O, O]")
    assert text.endswith("Available Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?")
    _, one = env.reset(jax.random.key(5), env.default_params(scramble_depth=1))
    assert not np.array_equal(np.asarray(one.stickers), SOLVED)


def _bfs_distance(stickers, moves: str, limit: int = 5) -> int:
    table = move_table(moves)
    start = tuple(int(v) for v in stickers)
    seen, frontier = {start}, [start]
    for d in range(limit + 1):
        if any(all(len(set(s[4 * f:4 * f + 4])) == 1 for f in range(6)) for s in frontier):
            return d
        nxt = []
        for s in frontier:
            for p in table:
                t = tuple(s[i] for i in p)
                if t not in seen:
                    seen.add(t)
                    nxt.append(t)
        frontier = nxt
    return limit + 1


def test_solver_is_optimal_and_solves():
    env = RubiksCube()
    params = env.default_params(scramble_depth=3)
    step = jax.jit(env.step_env)
    for seed in range(6):
        _, state = env.reset(jax.random.key(seed), params)
        plan = solvers.solve_cube(np.asarray(state.stickers))
        assert len(plan) == _bfs_distance(np.asarray(state.stickers), "physical")
        for a in plan:
            _, state, _, term, *_ = step(jax.random.key(0), state, a, params)
        assert not plan or bool(term)
    assert [ACTION_NAMES[a ^ 1] for a in range(2)] == ["U'", "U"]
