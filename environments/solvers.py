"""Shortest-path experts (NumPy / Python, host): optimal action sequences for Sokoban and FrozenLake.

They check that generated levels are solvable and provide demonstrations for behaviour cloning.
Action indices are the environments' own: Sokoban 0 Up, 1 Down, 2 Left, 3 Right; FrozenLake
0 Left, 1 Down, 2 Right, 3 Up.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

# Sokoban action index -> (d_row, d_col), as ``environments.sokoban.MOVES``.
SOKOBAN_MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))
# FrozenLake action index -> (d_row, d_col), Gymnasium's order Left, Down, Right, Up.
FROZEN_LAKE_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))


def _sokoban_cells(room_fixed, room_state):
    fixed = np.asarray(room_fixed)
    state = np.asarray(room_state)
    if fixed.ndim != 2 or fixed.shape != state.shape:
        raise ValueError(
            f"solve_sokoban: room_fixed {fixed.shape} and room_state {state.shape} must be equal 2-D grids"
        )
    # Player: gym-sokoban code 5, or render code 6 (player on target) as stored by the JAX env.
    players = np.argwhere((state == 5) | (state == 6))
    if len(players) != 1:
        raise ValueError(f"solve_sokoban: expected exactly one player (code 5 or 6), found {len(players)}")
    boxes = [tuple(b) for b in np.argwhere((state == 3) | (state == 4))]
    targets = {tuple(t) for t in np.argwhere(fixed == 2)}
    if len(boxes) != len(targets):
        raise ValueError(f"solve_sokoban: {len(boxes)} boxes but {len(targets)} targets")
    return fixed != 0, tuple(players[0]), boxes, targets


def _live_cells(floor: np.ndarray, targets: set) -> set:
    """Cells from which a lone box can still be pushed onto some target (pulled back from targets).

    A box anywhere else can never be solved, whatever the other boxes do, so such pushes are cut.
    """
    rows, cols = floor.shape

    def free(r, c):
        return 0 <= r < rows and 0 <= c < cols and floor[r, c]

    live = set(targets)
    frontier = list(targets)
    while frontier:
        r, c = frontier.pop()
        for dr, dc in SOKOBAN_MOVES:
            # The box came from (r - dr, c - dc), pushed by a player standing at (r - 2dr, c - 2dc).
            src = (r - dr, c - dc)
            if src not in live and free(*src) and free(r - 2 * dr, c - 2 * dc):
                live.add(src)
                frontier.append(src)
    return live


def solve_sokoban(room_fixed, room_state, max_states: int = 5_000_000) -> list[int] | None:
    """An optimal (fewest actions) solution by breadth-first search over push/move actions.

    Args:
      room_fixed: int [rows, cols] 0 wall, 1 floor, 2 target.
      room_state: int [rows, cols] gym-sokoban codes (1 floor, 2 target, 3 box on target, 4 box,
        5 player) or the JAX env's render codes (which add 6 = player on target).
      max_states: search budget; a ``RuntimeError`` names it when exceeded.
    Returns:
      Action indices (0 Up, 1 Down, 2 Left, 3 Right), ``[]`` if already solved, ``None`` if the
      level cannot be solved.
    """
    floor, player, boxes, targets = _sokoban_cells(room_fixed, room_state)
    rows, cols = floor.shape
    live = _live_cells(floor, targets)
    start = (player, frozenset(boxes))
    if start[1] == targets:
        return []
    parent: dict = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        (pr, pc), bxs = state
        for a, (dr, dc) in enumerate(SOKOBAN_MOVES):
            q = (pr + dr, pc + dc)
            if not (0 <= q[0] < rows and 0 <= q[1] < cols) or not floor[q]:
                continue
            if q in bxs:
                q2 = (q[0] + dr, q[1] + dc)
                if not (0 <= q2[0] < rows and 0 <= q2[1] < cols) or not floor[q2] or q2 in bxs or q2 not in live:
                    continue
                nxt = (q, (bxs - {q}) | {q2})
            else:
                nxt = (q, bxs)
            if nxt in parent:
                continue
            parent[nxt] = (state, a)
            if nxt[1] == targets:
                return _backtrack(parent, nxt)
            if len(parent) > max_states:
                raise RuntimeError(f"solve_sokoban: more than max_states={max_states} states; raise the budget")
            queue.append(nxt)
    return None


def _holes(desc_or_grid) -> np.ndarray:
    """bool [rows, cols] hole mask from the many ways a FrozenLake map is written."""
    if isinstance(desc_or_grid, (list, tuple)) and desc_or_grid and isinstance(desc_or_grid[0], (str, bytes)):
        rows = [r.decode() if isinstance(r, bytes) else r for r in desc_or_grid]
        if len({len(r) for r in rows}) != 1:
            raise ValueError("frozen_lake_shortest_path: map rows have different lengths")
        return np.array([[ch == "H" for ch in r] for r in rows], bool)
    grid = np.asarray(desc_or_grid)
    if grid.ndim != 2:
        raise ValueError(f"frozen_lake_shortest_path: expected a 2-D map, got shape {grid.shape}")
    if grid.dtype == bool:
        return grid
    if grid.dtype.kind == "S":
        return grid == b"H"
    if grid.dtype.kind == "U":
        return grid == "H"
    if grid.dtype.kind in "iu":
        # FrozenLake render codes: 2 hole, 4 player in hole.
        return (grid == 2) | (grid == 4)
    raise ValueError(
        f"frozen_lake_shortest_path: unsupported map dtype {grid.dtype}; pass rows of 'SFHG' text, a char "
        "array, a bool hole mask or FrozenLake render codes"
    )


def frozen_lake_shortest_path(desc_or_grid, start: Sequence[int], goal: Sequence[int]) -> list[int] | None:
    """Shortest deterministic path from ``start`` to ``goal`` avoiding holes.

    Args:
      desc_or_grid: the map — rows of text (``"SFFH"``, str or bytes; ``H`` is a hole), a char
        array, a bool hole mask, or an int grid of FrozenLake render codes (2/4 mark holes).
      start, goal: (row, col).
    Returns:
      FrozenLake action indices (0 Left, 1 Down, 2 Right, 3 Up), ``[]`` when start == goal,
      ``None`` when the goal cannot be reached.
    """
    holes = _holes(desc_or_grid)
    rows, cols = holes.shape
    start, goal = tuple(int(v) for v in start), tuple(int(v) for v in goal)
    for name, cell in (("start", start), ("goal", goal)):
        if not (0 <= cell[0] < rows and 0 <= cell[1] < cols):
            raise ValueError(f"frozen_lake_shortest_path: {name} {cell} is outside the {rows}x{cols} map")
    if start == goal:
        return []
    if holes[start]:
        return None  # a hole is absorbing
    parent = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        for a, (dr, dc) in enumerate(FROZEN_LAKE_MOVES):
            nxt = (cell[0] + dr, cell[1] + dc)
            if not (0 <= nxt[0] < rows and 0 <= nxt[1] < cols) or holes[nxt] or nxt in parent:
                continue
            parent[nxt] = (cell, a)
            if nxt == goal:
                return _backtrack(parent, nxt)
            queue.append(nxt)
    return None


__all__ = ["FROZEN_LAKE_MOVES", "SOKOBAN_MOVES", "frozen_lake_shortest_path", "solve_sokoban"]


def _backtrack(parent: dict, node) -> list[int]:
    """The actions leading from the BFS root to ``node`` (``parent[n] = (previous, action)``)."""
    actions = []
    while parent[node] is not None:
        node, act = parent[node]
        actions.append(act)
    return actions[::-1]
