"""Sudoku's host text: the original's render formats, written over a state's NumPy arrays.

This is the reference ``Sudoku.render_text`` returns and the device render must equal: plain
Python string building, one function per format of the original (``format_grid_simple``,
``format_grid_with_conflicts``, the feedback line and the ``with_feedback`` extras).
"""
from __future__ import annotations

import numpy as np

EXPECTED = "Expected format: 'place 5 at row 2 col 3' or '2,3,5'"
RULE = "=" * 50
LEGEND = "Legend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty"
# Feedback kinds (``SudokuState.feedback``) and action kinds (``action["kind"]``).
NONE, PARSE_ERROR, ROW_RANGE, COL_RANGE, NUM_RANGE, GIVEN, CONFLICT, CORRECT, LEGAL = range(9)


def conflict_cells(grid: np.ndarray) -> set[tuple[int, int]]:
    """Filled cells sharing their number with another cell of their row, column or box."""
    n = grid.shape[0]
    k = int(round(n ** 0.5))
    out = set()
    for r in range(n):
        for c in range(n):
            v = grid[r, c]
            if not v:
                continue
            br, bc = (r // k) * k, (c // k) * k
            if (np.sum(grid[r, :] == v) > 1 or np.sum(grid[:, c] == v) > 1
                    or np.sum(grid[br:br + k, bc:bc + k] == v) > 1):
                out.add((r, c))
    return out


def valid_numbers(grid: np.ndarray, r: int, c: int) -> list[int]:
    n = grid.shape[0]
    k = int(round(n ** 0.5))
    if grid[r, c]:
        return []
    br, bc = (r // k) * k, (c // k) * k
    used = set(grid[r, :]) | set(grid[:, c]) | set(grid[br:br + k, bc:bc + k].reshape(-1))
    return [v for v in range(1, n + 1) if v not in used]


def _layout(grid: np.ndarray, cell, cell_width: int) -> str:
    """Rows of ``cell(i, j)`` strings, ``| `` between boxes, dashed lines between bands, each row
    right-stripped (the original's two grid formatters)."""
    n = grid.shape[0]
    k = int(round(n ** 0.5))
    lines = []
    for i in range(n):
        if i and i % k == 0:
            lines.append("-" * (n * cell_width + k - 1))
        lines.append("".join(("| " if j and j % k == 0 else "") + cell(i, j) for j in range(n)).rstrip())
    return "\n".join(lines)


def grid_simple(grid: np.ndarray) -> str:
    return _layout(grid, lambda i, j: (str(int(grid[i, j])) if grid[i, j] else ".") + " ", 2)


def grid_marked(grid: np.ndarray, initial: np.ndarray) -> str:
    bad = conflict_cells(grid)

    def cell(i, j):
        v = int(grid[i, j])
        return " . " if not v else f"[{v}]" if initial[i, j] else f"*{v}*" if (i, j) in bad else f" {v} "

    return _layout(grid, cell, 3)


def feedback(state, n: int) -> str:
    """The last action's feedback line(s) (``""`` before the first action)."""
    fb, r, c, v = (int(np.asarray(x)) for x in (state.feedback, state.row, state.col, state.num))
    k = int(round(n ** 0.5))
    grid = np.asarray(state.grid)
    cell = f"({r + 1},{c + 1})"
    if fb == NONE:
        return ""
    if fb == PARSE_ERROR:
        return "❌ Invalid action format: Could not parse action. " + EXPECTED
    if fb in (ROW_RANGE, COL_RANGE, NUM_RANGE):
        what, value = {ROW_RANGE: ("Row", r), COL_RANGE: ("Column", c), NUM_RANGE: ("Number", v)}[fb]
        return f"❌ Invalid action format: {what} {value} is out of range (1-{n})"
    if fb == GIVEN:
        return f"❌ Cannot modify initial cell at {cell}"
    if fb == CONFLICT:
        clash = np.asarray(state.clash)
        parts = ([f"row {r + 1}"] if clash[0] else []) + ([f"column {c + 1}"] if clash[1] else []) + \
                ([f"box ({r // k + 1},{c // k + 1})"] if clash[2] else [])
        text = f"❌ Invalid placement: {v} conflicts with {', '.join(parts)}"
        valid = valid_numbers(grid, r, c)
        if valid:
            text += f"\n   Valid numbers for {cell}: {valid}"
        return text
    text = f"✓ Correct! Placed {v} at {cell}" if fb == CORRECT else f"⚠ Placed {v} at {cell} - Valid but not optimal"
    if np.all(grid > 0) and not conflict_cells(grid):
        text += "\n🎉 Congratulations! Puzzle solved!"
    return text


def render(state, fmt: str, n: int, show_conflicts: bool, show_valid_numbers: bool) -> str:
    grid, initial = np.asarray(state.grid), np.asarray(state.initial)
    if fmt == "simple":
        return grid_simple(grid)
    out = [RULE, "SUDOKU PUZZLE", RULE, grid_marked(grid, initial), "", LEGEND]
    last = feedback(state, n)
    if last:
        out += ["", last]
    if fmt == "detailed":
        return "\n".join(out)
    if show_conflicts:
        bad = sorted(conflict_cells(grid))
        if bad:
            out += ["", "⚠ CONFLICTS DETECTED:"] + [f"  - Cell ({r + 1},{c + 1}): {int(grid[r, c])}" for r, c in bad]
    if show_valid_numbers:
        empty = [tuple(int(x) for x in rc) for rc in np.argwhere(grid == 0)]
        if empty and len(empty) <= 10:
            out += ["", "💡 VALID NUMBERS FOR EMPTY CELLS:"]
            for r, c in empty[:10]:
                valid = valid_numbers(grid, r, c) if initial[r, c] == 0 else []
                if valid:
                    out.append(f"  - ({r + 1},{c + 1}): {valid}")
    filled, given = int(np.count_nonzero(grid)), int(np.count_nonzero(initial))
    out += ["", f"Progress: {filled}/{n * n} cells filled ({given} initial, {filled - given} placed)",
            f"Steps: {int(np.asarray(state.time))}/{int(np.asarray(state.max_steps))}"]
    return "\n".join(out)
