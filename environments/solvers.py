"""Experts (NumPy / Python, host): solvers and strong heuristics for every on-device environment.

They check that generated puzzles are solvable and provide demonstrations for behaviour cloning.
Sokoban: optimal BFS; FrozenLake: shortest path avoiding holes; 2×2 cube: optimal-length search
(bidirectional, up to 8 moves); Sudoku: backtracking with the fewest-candidates rule; Countdown:
exhaustive search over every way of combining the numbers; 2048: expectimax over the next spawn with
a standard board heuristic (empty cells, monotone rows, merges). Action indices are the
environments' own: Sokoban 0 Up, 1 Down, 2 Left, 3 Right; FrozenLake 0 Left, 1 Down, 2 Right, 3 Up;
2048 0 Up, 1 Right, 2 Down, 3 Left; cube 0 U, 1 U', ... 11 B'.
"""
from __future__ import annotations

import functools
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


__all__ = ["FROZEN_LAKE_MOVES", "SOKOBAN_MOVES", "best_2048_move", "frozen_lake_shortest_path", "slide_2048",
           "solve_countdown", "solve_cube", "solve_sokoban", "solve_sudoku"]


def _backtrack(parent: dict, node) -> list[int]:
    """The actions leading from the BFS root to ``node`` (``parent[n] = (previous, action)``)."""
    actions = []
    while parent[node] is not None:
        node, act = parent[node]
        actions.append(act)
    return actions[::-1]


# --- 2048 -------------------------------------------------------------------------------------


def slide_2048(board: np.ndarray, action: int) -> tuple[np.ndarray, int]:
    """One move on a board of tile exponents (0 empty): ``(new board, merged value)``, no spawn.
    0 Up, 1 Right, 2 Down, 3 Left; lines merge in the direction of travel, each tile once."""
    from environments.game_2048 import merge_line

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


# --- 2×2 cube ---------------------------------------------------------------------------------


def _cube_tables(moves: str):
    from environments.rubiks_cube import SOLVED, move_table

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
                found = _backtrack(parent, s)
            elif s in back:
                found = _backtrack(parent, s) + back[s]
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


# --- Sudoku -----------------------------------------------------------------------------------


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


# --- Countdown --------------------------------------------------------------------------------


def solve_countdown(numbers: Sequence[int], target: int, operators: str = "+-*/") -> str | None:
    """An expression using every number once whose exact value is ``target`` (None if none exists).

    Exhaustive: repeatedly combine two of the remaining (value, text) pairs with every operator in
    both orders, in exact fractions; sub-expressions are parenthesised, so the text evaluates the
    same under Python's and our parser's precedence.
    """
    from fractions import Fraction

    seen = set()

    def rec(items):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ta), (b, tb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                outs = []
                if "+" in operators and i < j:
                    outs.append((a + b, f"{ta} + {tb}"))
                if "*" in operators and i < j:
                    outs.append((a * b, f"{ta} * {tb}"))
                if "-" in operators:
                    outs.append((a - b, f"{ta} - {tb}"))
                if "/" in operators and b != 0:
                    outs.append((a / b, f"{ta} / {tb}"))
                for v, text in outs:
                    wrapped = text if not rest else f"({text})"
                    found = rec(rest + [(v, wrapped)])
                    if found is not None:
                        return found
        return None

    return rec([(Fraction(int(n)), str(int(n))) for n in numbers])
