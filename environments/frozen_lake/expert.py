"""FrozenLake's expert: the shortest path around the holes (BFS), and the warm-up's plan (its
moves, a sentence naming the player's and the goal's cells and the holes around the player).
Action indices are the env's (Gymnasium's order): 0 Left, 1 Down, 2 Right, 3 Up.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from environments.core import Plan, backtrack, cell_text


# Action index -> (d_row, d_col).
FROZEN_LAKE_MOVES = ((0, -1), (1, 0), (0, 1), (-1, 0))


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
                return backtrack(parent, nxt)
            queue.append(nxt)
    return None


EXPERT_REASONING = ("after_move", "before_move")


def frozen_lake_reasoning(pos, goal, holes: np.ndarray, first: str | None, style: str = "after_move") -> str:
    """The expert's reasoning for one turn: where the player and goal are, and the holes around the player.

    ``after_move``: "...; moving Down avoids the hole at (1, 2)." when a hole is next to the player,
    else "...; moving Down gets closer." The hole comes after the move, so a policy that imitates it
    has chosen its move before it names the hole.
    ``before_move``: "..., hole at (1, 2); moving Down." / "..., holes at (1, 2), (2, 3); moving Down." /
    "..., no hole near; moving Down.": every hole next to the player, named before the move, and a
    clause in every reply (so RL can make it right or wrong, not drop it). The holes are part of the
    description before the first ``;``, so the warm-up's reading check (``make_reading_check``)
    also waits for the model to read them off the board.
    """
    if style not in EXPERT_REASONING:
        raise ValueError(f"frozen_lake_reasoning: style {style!r} is not one of {EXPERT_REASONING}")
    pos, goal = np.asarray(pos), np.asarray(goal)
    moves = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]])  # FrozenLake: Left, Down, Right, Up
    text = f"The player is at {cell_text(pos)} and the goal at {cell_text(goal)}"
    if first is None:
        return text + "."
    size = holes.shape[0]
    near = [pos + d for d in moves if 0 <= (pos + d)[0] < size and 0 <= (pos + d)[1] < size and holes[tuple(pos + d)]]
    if style == "before_move":
        if not near:
            return text + f", no hole near; moving {first}."
        cells = ", ".join(cell_text(c) for c in near)
        return text + f", {'hole' if len(near) == 1 else 'holes'} at {cells}; moving {first}."
    if near:
        return text + f"; moving {first} avoids the hole at {cell_text(near[0])}."
    return text + f"; moving {first} gets closer."


def plan(env, s, params) -> Plan:
    """The shortest path from host state ``s`` and the sentence about the cells around it."""
    answers = [env.action_names[int(a)] for a in frozen_lake_shortest_path(s.holes, tuple(s.pos), tuple(s.goal)) or []]
    return Plan(answers, lambda given: frozen_lake_reasoning(s.pos, s.goal, s.holes, given[0] if given else None,
                                                             env.expert_reasoning))
