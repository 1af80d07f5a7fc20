"""Slow, obviously-correct NumPy FrozenLake, written from RAGEN's FrozenLake rules, for tests only.

The map is a Gymnasium-style ``desc`` of characters ``S F H G``; dynamics follow Gymnasium's
transition list for an intended direction ``d``: directions ``[(d-1)%4, d, (d+1)%4]`` with
probabilities ``[(1-s)/2, s, (1-s)/2]``, sampled as "first index whose cumulative probability
exceeds ``u``". The uniform ``u`` is an input, so a test can feed this reference and the JAX env the
same draw and demand identical trajectories. Nothing here imports the JAX environment.
"""
from __future__ import annotations

from collections import deque

import numpy as np

# Gymnasium's action order and its clamped moves.
LEFT, DOWN, RIGHT, UP = 0, 1, 2, 3
DEFAULT_SYMBOLS = {"P": "P", "F": "_", "H": "O", "G": "G", "X": "X", "V": "√"}


def make_desc(holes, start, goal) -> np.ndarray:
    """bool [n, n] holes, (r, c) start, (r, c) goal -> desc array of one-char strings."""
    desc = np.where(np.asarray(holes, bool), "H", "F").astype("<U1")
    desc[tuple(start)] = "S"
    desc[tuple(goal)] = "G"
    return desc


def reachable(desc: np.ndarray) -> bool:
    """Breadth-first search from S to G through non-hole cells."""
    n_rows, n_cols = desc.shape
    start = tuple(int(v) for v in np.argwhere(desc == "S")[0])
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r, c] == "G":
            return True
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < n_rows and 0 <= nc < n_cols and (nr, nc) not in seen and desc[nr, nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def rejection_map(rng: np.random.Generator, size: int, p: float) -> np.ndarray:
    """RAGEN's generator loop: redraw board, start and goal until start != goal and S reaches G."""
    while True:
        board = rng.choice(np.array(["F", "H"]), (size, size), p=[p, 1 - p])
        start = tuple(rng.integers(size, size=2))
        goal = tuple(rng.integers(size, size=2))
        if start == goal:
            continue
        board[start], board[goal] = "S", "G"
        if reachable(board):
            return board


def _move(r: int, c: int, direction: int, n: int) -> tuple[int, int]:
    if direction == LEFT:
        return r, max(c - 1, 0)
    if direction == DOWN:
        return min(r + 1, n - 1), c
    if direction == RIGHT:
        return r, min(c + 1, n - 1)
    return max(r - 1, 0), c


class ReferenceFrozenLake:
    """One FrozenLake episode on a fixed ``desc``; ``step(action, u)`` mirrors Gymnasium + RAGEN info."""

    def __init__(self, desc: np.ndarray, success_rate: float, is_slippery: bool, max_steps: int):
        self.desc = desc
        self.n = desc.shape[0]
        self.pos = tuple(int(v) for v in np.argwhere(desc == "S")[0])
        self.success_rate = np.float32(success_rate)
        self.is_slippery = is_slippery
        self.max_steps = max_steps
        self.time = 0

    def step(self, action: int, u: float):
        """-> reward, terminated, truncated, info (dict with RAGEN's three flags)."""
        valid = 0 <= action < 4
        before = self.pos
        if valid and self.desc[before] not in ("G", "H"):  # G and H are absorbing
            if self.is_slippery:
                s = self.success_rate
                slip = (np.float32(1) - s) / np.float32(2)
                cumulative = [slip, slip + s, np.float32(2)]  # the last entry always exceeds u
                k = next(i for i, c in enumerate(cumulative) if c > np.float32(u))
                direction = [(action - 1) % 4, action, (action + 1) % 4][k]
            else:
                direction = action
            self.pos = _move(*before, direction, self.n)
            reward = 1.0 if self.desc[self.pos] == "G" else 0.0
        else:
            reward = 0.0
        self.time += 1
        terminated = self.desc[self.pos] in ("G", "H")
        truncated = (self.time >= self.max_steps) and not terminated
        info = {
            "action_is_valid": valid,
            "action_is_effective": self.pos != before,
            "success": self.desc[self.pos] == "G",
        }
        return reward, terminated, truncated, info


def render(desc: np.ndarray, pos, fmt: str, symbols: dict[str, str] = DEFAULT_SYMBOLS) -> str:
    """RAGEN's text of the board. ``symbols`` keys: P, F (frozen), H, G, X (player in hole), V (on goal)."""
    pos = tuple(int(v) for v in pos)
    n = desc.shape[0]
    rows = []
    for r in range(n):
        row = ""
        for c in range(n):
            tile = desc[r, c]
            if (r, c) == pos:
                row += symbols["X"] if tile == "H" else symbols["V"] if tile == "G" else symbols["P"]
            else:
                row += symbols["H"] if tile == "H" else symbols["G"] if tile == "G" else symbols["F"]
        rows.append(row)
    grid = "\n".join(rows)
    if fmt == "grid":
        return grid

    def where(ch):
        return [f"({r}, {c})" for r, c in zip(*np.nonzero(desc == ch))]

    lines = [f"Board size: {n} rows x {n} cols (zero-indexed).",
             "Start: " + ", ".join(where("S")), "Goal: " + ", ".join(where("G"))]
    tile = desc[pos]
    label = "Player on goal" if tile == "G" else "Player in hole" if tile == "H" else "Player"
    lines.append(f"{label}: ({pos[0]}, {pos[1]})")
    if where("H"):
        lines.append("Holes: " + ", ".join(where("H")))
    coord = "\n".join(lines)
    if fmt == "coord":
        return coord
    return "Coordinates: \n" + coord + "\nGrid Map: \n" + grid
