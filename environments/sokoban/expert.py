"""Sokoban's expert: optimal BFS over (player, boxes) states with dead-cell pruning, and the
warm-up's plan (the solution's moves, a sentence naming the player's, the box's and the target's
cells). Action indices are the env's: 0 Up, 1 Down, 2 Left, 3 Right.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from environments.core import Plan, backtrack, cell_text
from environments.sokoban.levels import BOX, BOX_ON_TARGET, PLAYER_ON_TARGET, TARGET, WALL
from environments.sokoban.render import DEFAULT_GRID_LOOKUP


# Action index -> (d_row, d_col), as ``environments.sokoban.levels.MOVES``.
SOKOBAN_MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))


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
                return backtrack(parent, nxt)
            if len(parent) > max_states:
                raise RuntimeError(f"solve_sokoban: more than max_states={max_states} states; raise the budget")
            queue.append(nxt)
    return None


def parse_grid(rows: list[str], grid_lookup=None) -> tuple[np.ndarray, np.ndarray]:
    """``(room_fixed, room_state)`` int [rows, cols] of a board shown in the ``grid`` format (one
    symbol per cell, ``grid_lookup`` code -> symbol, RAGEN's by default): the render read back, for
    analyses of transcripts. ``room_state`` uses the render codes (6 = player on target)."""
    codes = {symbol: code for code, symbol in (grid_lookup or DEFAULT_GRID_LOOKUP).items()}
    if any(len(symbol) != 1 for symbol in codes):
        raise ValueError("parse_grid: needs one character per symbol")
    if not rows or len({len(row) for row in rows}) != 1:
        raise ValueError(f"parse_grid: rows of unequal lengths or none: {rows!r}")
    unknown = sorted({ch for row in rows for ch in row} - set(codes))
    if unknown:
        raise ValueError(f"parse_grid: symbols {unknown} are not in the grid lookup {sorted(codes)}")
    state = np.array([[codes[ch] for ch in row] for row in rows], np.int32)
    on_target = np.isin(state, (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET))
    fixed = np.where(state == WALL, 0, np.where(on_target, 2, 1)).astype(np.int32)  # solve_sokoban's room_fixed
    return fixed, state


def shortest_solution_length(rows: list[str], grid_lookup=None) -> int | None:
    """The fewest actions that solve the board shown in ``rows`` (``grid`` format), ``None`` if
    it cannot be solved: how hard an evaluation's level is, for ``eval_analysis --by_length``."""
    solution = solve_sokoban(*parse_grid(rows, grid_lookup))
    return None if solution is None else len(solution)


def sokoban_reasoning(player, boxes, targets, first: str | None) -> str:
    text = f"The player is at {cell_text(player)}"
    if len(boxes):
        text += f", the box at {cell_text(boxes[0])}"
    if len(targets):
        text += f" and the target at {cell_text(targets[0])}"
    return text + (f"; I move {first}." if first is not None else ".")


def plan(env, s, params) -> Plan:
    """The BFS solution from host state ``s`` and the sentence about the cells it starts from."""
    answers = [env.action_names[int(a)] for a in solve_sokoban(s.room_fixed, s.grid) or []]
    boxes = np.argwhere((s.grid == BOX) | (s.grid == BOX_ON_TARGET))
    targets = np.argwhere(s.room_fixed == TARGET)
    return Plan(answers, lambda given: sokoban_reasoning(s.player, boxes, targets, given[0] if given else None))
