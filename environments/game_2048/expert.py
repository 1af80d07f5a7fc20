"""2048's expert: expectimax over the next spawn with a standard board heuristic (empty cells,
monotone rows, merges), and the warm-up's plan. Action indices are the env's: 0 Up, 1 Right, 2 Down,
3 Left.
"""
from __future__ import annotations

import numpy as np

from environments.core import Plan
from environments.game_2048.rules import merge_line



def slide_2048(board: np.ndarray, action: int) -> tuple[np.ndarray, int]:
    """One move on a board of tile exponents (0 empty): ``(new board, merged value)``, no spawn.
    0 Up, 1 Right, 2 Down, 3 Left; lines merge in the direction of travel, each tile once."""
    b = np.array(board, dtype=np.int64)
    lines = {0: b.T, 1: b[:, ::-1], 2: b[::-1, :].T, 3: b}[action].copy()
    gained = 0
    for i, line in enumerate(lines):
        lines[i], g = merge_line(line)
        gained += g
    new = {0: lines.T, 1: lines[:, ::-1], 2: lines.T[::-1, :], 3: lines}[action]
    return np.ascontiguousarray(new), gained


def _board_value(b: np.ndarray) -> float:
    """Heuristic: many empty cells, rows and columns monotone, neighbours mergeable."""
    empty = np.sum(b == 0)
    mono = 0.0
    for lines in (b, b.T):  # penalise the smaller of the rises and the falls along each axis
        d = np.diff(lines.astype(np.float64), axis=1)
        mono -= min(np.sum(np.maximum(d, 0)), np.sum(np.maximum(-d, 0)))
    merges = np.sum((b[:, 1:] == b[:, :-1]) & (b[:, 1:] > 0)) + np.sum((b[1:] == b[:-1]) & (b[1:] > 0))
    return 2.7 * empty + 1.0 * mono + 0.7 * merges + 1.0 * b.max()


def best_2048_move(board: np.ndarray, two_prob: float = 0.9) -> int | None:
    """The move maximising the expected heuristic value after the next spawn (expectimax, one
    move deep, averaging over every empty cell and both tile values). None when no move changes
    the board."""
    best, best_value = None, -np.inf
    for a in range(4):
        new, gained = slide_2048(board, a)
        if np.array_equal(new, board):
            continue
        empties = np.argwhere(new == 0)
        value = 0.0
        for r, c in empties:
            for tile, p in ((1, two_prob), (2, 1 - two_prob)):
                nb = new.copy()
                nb[r, c] = tile
                value += p * _board_value(nb)
        value = value / max(len(empties), 1) + 0.1 * np.log2(gained + 1)
        if value > best_value:
            best, best_value = a, value
    return best


def plan(env, s, params) -> Plan:
    """The expectimax move from host state ``s`` and a sentence about the board."""
    board = np.asarray(s.board)
    move = best_2048_move(board, float(np.asarray(params.two_prob)))
    answers = [] if move is None else [env.action_names[move]]
    top = int(2 ** board.max()) if board.max() else 0

    def reasoning(given):
        text = f"The largest tile is {top} and {int(np.sum(board == 0))} cells are empty"
        return text + (f"; {given[0]} keeps the board open." if given else ".")

    return Plan(answers, reasoning)
