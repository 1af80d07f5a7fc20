"""Sudoku's expert: backtracking with the fewest-candidates rule, and the warm-up's plan (the
cells a person would fill next, with the sentence saying why).
"""
from __future__ import annotations

import numpy as np

from environments.core import Plan



def sudoku_candidates(grid: np.ndarray, r: int, c: int) -> list[int]:
    n = grid.shape[0]
    k = int(round(n ** 0.5))
    br, bc = (r // k) * k, (c // k) * k
    used = set(grid[r, :].tolist()) | set(grid[:, c].tolist()) | set(grid[br:br + k, bc:bc + k].reshape(-1).tolist())
    return [v for v in range(1, n + 1) if v not in used]


def solve_sudoku(grid, max_nodes: int = 200_000) -> np.ndarray | None:
    """A completion of ``grid`` (0 = empty) by backtracking, always branching on the empty cell with
    the fewest candidates. None when there is none (or the node budget runs out)."""
    g = np.array(grid, dtype=np.int64)
    budget = [max_nodes]

    def rec():
        empties = np.argwhere(g == 0)
        if not len(empties):
            return True
        best, best_c = None, None
        for r, c in empties:
            cand = sudoku_candidates(g, r, c)
            if best is None or len(cand) < len(best_c):
                best, best_c = (r, c), cand
                if len(cand) <= 1:
                    break
        for v in best_c:
            budget[0] -= 1
            if budget[0] < 0:
                return False
            g[best] = v
            if rec():
                return True
        g[best] = 0
        return False

    return g if rec() else None


def plan(env, s, params) -> Plan:
    """Every empty cell, fewest candidates first, with its value in the solution."""
    grid = np.asarray(s.grid)
    solved = solve_sudoku(grid)
    target = solved if solved is not None else np.asarray(s.solution)
    # Fewest candidates first: the cells a person would fill next.
    cells = sorted((len(sudoku_candidates(grid, r, c)), r, c) for r, c in np.argwhere(grid == 0))
    answers, notes = [], []
    for _, r, c in cells:
        answers.append(env.answer_text(int(r), int(c), int(target[r, c])))
        notes.append((int(r), int(c), sudoku_candidates(grid, r, c), int(target[r, c])))

    def reasoning(given):
        if not given or not notes:
            return "The grid is full."
        if given[0] != answers[0]:
            return f"I try {given[0]}."
        r, c, cand, v = notes[0]
        only = "can only be" if len(cand) == 1 else f"has candidates {cand} and must be"
        return f"The cell at row {r + 1} col {c + 1} {only} {v}."

    return Plan(answers, reasoning)
