"""The original 2048 rules, written plainly on tile *values* (not exponents), for the tests.

Moves: 0 Up, 1 Right, 2 Down, 3 Left. Each line is read in the direction of travel, the non-zero
tiles are merged pairwise from the front (a merged tile does not merge again in the same move),
and the line is refilled with zeros at the back; the merge reward is the sum of the new tiles.
"""
from __future__ import annotations

import numpy as np


def _line(vals: list[int]) -> tuple[list[int], int]:
    tiles = [v for v in vals if v]
    out, reward, i = [], 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(2 * tiles[i])
            reward += 2 * tiles[i]
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(vals) - len(out)), reward


def move(grid: np.ndarray, action: int) -> tuple[np.ndarray, int, bool]:
    """-> (new grid, merge reward, whether anything moved)."""
    g = np.array(grid, dtype=np.int64)
    n = g.shape[0]
    total = 0
    for k in range(n):
        if action in (0, 2):  # columns
            line = list(g[:, k]) if action == 0 else list(g[::-1, k])
        else:                 # rows
            line = list(g[k, :]) if action == 3 else list(g[k, ::-1])
        new, r = _line(line)
        total += r
        if action == 0:
            g[:, k] = new
        elif action == 2:
            g[::-1, k] = new
        elif action == 3:
            g[k, :] = new
        else:
            g[k, ::-1] = new
    return g, total, not np.array_equal(g, grid)


def valid_moves(grid: np.ndarray) -> list[int]:
    return [a for a in range(4) if move(grid, a)[2]]


def render(grid: np.ndarray, score: int) -> str:
    names = {0: "Up", 1: "Right", 2: "Down", 3: "Left"}
    rows = [f"Row {i + 1}: [{', '.join(str(int(v)) for v in grid[i])}]" for i in range(grid.shape[0])]
    valid = valid_moves(grid)
    actions = ", ".join(f"{a}({names[a]})" for a in valid) if valid else "None"
    return "\n".join(["Current 2048 Grid:", *rows, "", f"Valid Actions: {actions}.",
                      "Goal: Merge same numbers to reach 2048.", f"Current Score: {score}", "What is your next move?"])
