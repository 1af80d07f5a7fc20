"""The 2×2 cube's expert: an optimal-length bidirectional search (up to 8 moves), and the
warm-up's plan. Action indices are the env's: 0 U, 1 U', ... 11 B'.
"""
from __future__ import annotations

import functools

import numpy as np

from environments.core import Plan, backtrack
from environments.rubiks_cube.cube import SOLVED, move_table



def _cube_tables(moves: str):
    perms = [tuple(int(i) for i in p) for p in move_table(moves)]
    inverse = [a ^ 1 for a in range(12)]  # U <-> U', ... (a prime follows its face)
    return perms, inverse, tuple(int(v) for v in SOLVED)


@functools.lru_cache(maxsize=2)
def _cube_backward(moves: str, depth: int = 4) -> dict:
    """Every state within ``depth`` moves of the solved cube -> the moves that solve it."""
    perms, inverse, solved = _cube_tables(moves)
    table = {solved: []}
    frontier = [solved]
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for a, p in enumerate(perms):
                t = tuple(s[i] for i in p)
                if t not in table:
                    table[t] = [inverse[a]] + table[s]
                    nxt.append(t)
        frontier = nxt
    return table


def _cube_solved(s) -> bool:
    return all(len(set(s[4 * f:4 * f + 4])) == 1 for f in range(6))


def solve_cube(stickers, moves: str = "physical", max_forward: int = 4) -> list[int] | None:
    """A move sequence to a cube with one colour per face: the shortest one when that is at most
    ``max_forward`` moves, else the shortest through the standard orientation (up to
    ``max_forward + 4`` moves); None beyond that range.

    Forward breadth-first search from ``stickers`` (any solved orientation ends it) meets a table of
    the states within 4 moves of the standard solved cube.
    """
    perms, _, _ = _cube_tables(moves)
    back = _cube_backward(moves)
    start = tuple(int(v) for v in np.asarray(stickers).reshape(-1))
    parent = {start: None}
    frontier = [start]
    best = None
    for depth in range(max_forward + 1):
        if best is not None and depth >= len(best):
            break  # nothing found deeper can be shorter
        for s in frontier:
            if _cube_solved(s):
                found = backtrack(parent, s)
            elif s in back:
                found = backtrack(parent, s) + back[s]
            else:
                continue
            if best is None or len(found) < len(best):
                best = found
        nxt = []
        for s in frontier:
            for a, p in enumerate(perms):
                t = tuple(s[i] for i in p)
                if t not in parent:
                    parent[t] = (s, a)
                    nxt.append(t)
        frontier = nxt
    return best


def plan(env, s, params) -> Plan:
    """The shortest turn sequence from host state ``s`` and how far from solved it is."""
    moves = solve_cube(np.asarray(s.stickers), env.moves) or []
    answers = [env.action_names[int(a)] for a in moves]

    def reasoning(given):
        if not moves:
            return "The cube is already solved."
        return f"The cube is {len(moves)} moves from solved; I turn {' then '.join(given)}."

    return Plan(answers, reasoning)
