"""Sudoku (RAGEN's ``sudoku``: SimpleSudoku / MediumSudoku), puzzles generated inside jit.

Generator. The original fills a grid by randomised backtracking and then blanks
``int(n² · {easy 0.4, medium 0.5, hard 0.6})`` random cells. Backtracking has no fixed cost, so here
a solved grid is drawn by applying the Sudoku symmetries to the pattern grid
``(k·(r mod k) + r div k + c) mod n + 1`` (``k = √n``): a random relabelling of the digits, random
orders of the bands and of the rows inside each band, the same for stacks and columns, and a random
transpose. Every result is a valid solution; the distribution differs from the backtracker's (which
is not uniform either). The blanking rule, and so the difficulty, is the original's.

Actions are free text (``parse_action``), read with the original's six patterns in its order
(``place 5 at row 2 col 3``, ``place 5 at (2,3)``, ``place 5 at 2,3``, ``5 at 2,3``, ``(2,3,5)``,
``2,3,5``; lower-cased, leftmost match, the first pattern that matches decides), numbers 1-based.
As in the original the positional forms read ``row, col, number`` unless the text contains
``place`` or ``at`` anywhere, in which case the first number is the value. The six searches are
fixed sequences of gathers over the answer's bytes (``environments.text_match``): ~6 ms for a batch
of 128 answers on a 2-core CPU.

Rewards (the original's): a parse failure, a given cell, or a placement that repeats a number in
its row, column or box: ``invalid_action_score`` (-0.1), nothing placed, ``action_is_valid`` False.
A legal placement: ``correct_placement_score`` (1.0) when it matches the stored solution, half of it
otherwise — puzzles are often not unique, so a value from another valid completion earns half credit
(kept: it is what the original's numbers mean). Filling the grid adds ``completion_bonus`` (10).
A user-placed cell may be overwritten with another legal number.

Differences from the original, on purpose:
  * the step cap ``max_steps_in_episode`` (its ``max_steps``, 81) ends the episode on any step; the
    original only checked it after legal placements, so invalid actions could run forever;
  * the feedback for unreadable text does not quote the text back (the device cannot turn
    arbitrary bytes into tokens): ``Could not parse action. Expected format: ...``;
  * digits and spaces are ASCII, and a number of more than 9 digits is read as 999999999.

Render formats (``observation_format``): ``with_feedback`` (the SimpleSudoku / MediumSudoku tags),
``detailed`` (the original's class default) and ``simple``; each is the original's text.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments import text_match as tm
from environments.core import EnvParams, EnvState, Environment
from environments.sudoku import expert as sudoku_expert
from environments.sudoku import text as sudoku_text
from environments.sudoku.text import (CONFLICT, CORRECT, EXPECTED, GIVEN, LEGAL, LEGEND, NONE, NUM_RANGE, PARSE_ERROR,  # noqa: F401
                                      ROW_RANGE, RULE, COL_RANGE)

REMOVED_FRACTION = {"easy": 0.4, "medium": 0.5, "hard": 0.6}

# The original's patterns, in its order: (elements, the value comes first).
PATTERNS = (
    (b"place", tm.WS, tm.NUM, tm.WS, b"at", tm.WS, b"row", tm.WS, tm.NUM, tm.WS, b"col", tm.WS, tm.NUM),
    (b"place", tm.WS, tm.NUM, tm.WS, b"at", tm.WS, b"(", tm.NUM, b",", tm.OPT_WS, tm.NUM, b")"),
    (b"place", tm.WS, tm.NUM, tm.WS, b"at", tm.WS, tm.NUM, b",", tm.OPT_WS, tm.NUM),
    (tm.NUM, tm.WS, b"at", tm.WS, tm.NUM, b",", tm.OPT_WS, tm.NUM),
    (b"(", tm.NUM, b",", tm.OPT_WS, tm.NUM, b",", tm.OPT_WS, tm.NUM, b")"),
    (tm.NUM, b",", tm.OPT_WS, tm.NUM, b",", tm.OPT_WS, tm.NUM),
)

# Feedback kinds (``SudokuState.feedback``) and action kinds (``action["kind"]``): sudoku.text.


@chex.dataclass(frozen=True)
class SudokuState(EnvState):
    grid: chex.Array      # int32 [n, n] current numbers (0 empty)
    initial: chex.Array   # int32 [n, n] the givens
    solution: chex.Array  # int32 [n, n] the stored solution
    feedback: chex.Array  # int32 [] what the last action did (NONE .. LEGAL)
    row: chex.Array       # int32 [] the last action's row, 0-based (raw number for range errors)
    col: chex.Array       # int32 []
    num: chex.Array       # int32 []
    clash: chex.Array     # bool [3] the last rejected number was in its row / column / box
    max_steps: chex.Array  # int32 [] printed by the render


@chex.dataclass(frozen=True)
class SudokuParams(EnvParams):
    correct_placement_score: chex.Array  # float32 []
    invalid_action_score: chex.Array     # float32 []
    completion_bonus: chex.Array         # float32 []


def pattern_grid(n: int) -> np.ndarray:
    k = int(round(n ** 0.5))
    r, c = np.arange(n)[:, None], np.arange(n)[None, :]
    return ((k * (r % k) + r // k + c) % n + 1).astype(np.int32)


def _ranks(words: chex.Array) -> chex.Array:
    """The rank of each of ``words`` (uint32 [m]) among them, ties broken by position: a uniformly
    random permutation of ``0..m-1`` for i.i.d. words (m² compares, no sort: cheap for m <= 256)."""
    i = jnp.arange(words.shape[0])
    below = (words[None, :] < words[:, None]) | ((words[None, :] == words[:, None]) & (i[None, :] < i[:, None]))
    return jnp.sum(below, axis=1).astype(jnp.int32)


def words_needed(n: int) -> int:
    k = int(round(n ** 0.5))
    return n + 2 * (k + k * k) + 1 + n * n


def random_solution(words: chex.Array, n: int) -> chex.Array:
    """A valid solved grid: the pattern grid under random Sudoku symmetries. int32 [n, n].

    words: uint32 [words_needed(n) - n*n] random words (digit relabelling, band/row and
    stack/column orders, transpose).
    """
    k = int(round(n ** 0.5))
    digits = jnp.concatenate([jnp.zeros((1,), jnp.int32), 1 + _ranks(words[:n])])
    at = n

    def line_order(at):
        bands = _ranks(words[at:at + k])
        inner = jax.vmap(_ranks)(words[at + k:at + k + k * k].reshape(k, k))
        return (bands[:, None] * k + inner[bands]).reshape(-1), at + k + k * k

    rows, at = line_order(at)
    cols, at = line_order(at)
    grid = jnp.asarray(pattern_grid(n))[rows][:, cols]
    grid = jnp.where((words[at] & 1) == 1, grid.T, grid)
    return digits[grid].astype(jnp.int32)


def candidates(grid: chex.Array, k: int) -> chex.Array:
    """bool [n, n, n]: number ``v + 1`` is absent from the row, column and box of each cell."""
    n = grid.shape[0]
    onehot = grid[..., None] == jnp.arange(1, n + 1)                          # [n, n, n]
    in_row = jnp.any(onehot, axis=1, keepdims=True)
    in_col = jnp.any(onehot, axis=0, keepdims=True)
    boxes = onehot.reshape(k, k, k, k, n).any(axis=(1, 3))                    # [k, k, n]
    in_box = jnp.repeat(jnp.repeat(boxes, k, axis=0), k, axis=1)
    return ~(in_row | in_col | in_box)


def conflicts(grid: chex.Array, k: int) -> chex.Array:
    """bool [n, n]: filled cells whose number appears again in their row, column or box."""
    n = grid.shape[0]
    onehot = (grid[..., None] == jnp.arange(1, n + 1)).astype(jnp.int32)
    row = jnp.sum(onehot, axis=1, keepdims=True)
    col = jnp.sum(onehot, axis=0, keepdims=True)
    box = onehot.reshape(k, k, k, k, n).sum(axis=(1, 3))
    box = jnp.repeat(jnp.repeat(box, k, axis=0), k, axis=1)
    many = (row > 1) | (col > 1) | (box > 1)
    return (grid > 0) & jnp.any(onehot.astype(bool) & many, axis=-1)


class Sudoku(Environment):
    """RAGEN's Sudoku. Static: ``grid_size`` (4, 9, 16), ``difficulty``, ``observation_format``,
    ``show_conflicts``, ``show_valid_numbers``. Traced (``SudokuParams``): scores and the step cap."""

    name = "sudoku"
    action_names = ()
    observation_formats = ("with_feedback", "detailed", "simple")
    observation_format = "with_feedback"
    max_action_bytes = 256  # an answer part is read from its first 256 bytes

    def __init__(self, grid_size: int = 9, difficulty: str = "easy", observation_format: str = "with_feedback",
                 show_conflicts: bool = True, show_valid_numbers: bool = True):
        if grid_size not in (4, 9, 16):
            raise ValueError(f"sudoku: grid_size={grid_size!r}; choose 4, 9 or 16")
        if difficulty not in REMOVED_FRACTION:
            raise ValueError(f"sudoku: difficulty={difficulty!r}; choose one of {tuple(REMOVED_FRACTION)}")
        self.n, self.k = int(grid_size), int(round(grid_size ** 0.5))
        self.difficulty = difficulty
        self.num_blanks = int(self.n * self.n * REMOVED_FRACTION[difficulty])
        self.observation_format = self.check_format(observation_format)
        self.show_conflicts, self.show_valid_numbers = bool(show_conflicts), bool(show_valid_numbers)
        n = self.n
        self.instruction = (
            f"You are solving a Sudoku puzzle. Fill the grid so that every row, every column and every "
            f"{self.k}x{self.k} box holds each number from 1 to {n} exactly once.\n"
            "Cells given at the start are shown in [brackets] and cannot be changed; empty cells are dots (.).\n"
            "Place one number per action, written <answer>place 5 at row 2 col 3</answer> or <answer>2,3,5</answer> "
            "(row, column, number; counted from 1).\n"
            "Each move is answered with feedback saying whether it was legal and what it conflicted with.\n"
        )
        self._init_render()

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, correct_placement_score: float = 1.0, invalid_action_score: float = -0.1,
                       completion_bonus: float = 10.0, max_steps_in_episode: int = 81) -> SudokuParams:
        if int(max_steps_in_episode) < 1:
            raise ValueError(f"sudoku: max_steps_in_episode={max_steps_in_episode} must be >= 1")
        return SudokuParams(correct_placement_score=jnp.float32(correct_placement_score),
                            invalid_action_score=jnp.float32(invalid_action_score),
                            completion_bonus=jnp.float32(completion_bonus),
                            max_steps_in_episode=jnp.int32(max_steps_in_episode))

    def reset_env(self, key, params: SudokuParams):
        return self._reset_from(jax.random.bits(key, (words_needed(self.n),), jnp.uint32), params)

    def step(self, key, state: SudokuState, action, params: SudokuParams | None = None):
        """``step_env`` + auto-reset, the new puzzle from one threefry call."""
        params = self.default_params() if params is None else params
        obs, next_state, reward, terminated, truncated, info = self.step_env(key, state, action, params)
        _, fresh = self.reset_env(key, params)
        done = terminated | truncated
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), fresh, next_state)
        return self.observation(next_state), next_state, reward, terminated, truncated, info

    def _reset_from(self, words, params: SudokuParams):
        cells = self.n * self.n
        solution = random_solution(words[:-cells], self.n)
        # A uniformly random subset of num_blanks cells by selection sampling (Knuth's algorithm S:
        # cell t is taken with probability still-needed / cells-left), unrolled: ~4 ops a cell.
        u = (words[-cells:] >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
        taken, picks = jnp.int32(0), []
        for t in range(cells):
            pick = u[t] * (cells - t) < (self.num_blanks - taken)
            picks.append(pick)
            taken = taken + pick.astype(jnp.int32)
        blank = jnp.stack(picks).reshape(self.n, self.n)
        initial = jnp.where(blank, 0, solution)
        z = jnp.int32(0)
        state = SudokuState(time=z, grid=initial, initial=initial, solution=solution, feedback=jnp.int32(NONE),
                            row=z, col=z, num=z, clash=jnp.zeros((3,), bool), max_steps=params.max_steps_in_episode)
        return self.observation(state), state

    def parse_action(self, text: chex.Array, n: chex.Array):
        """Answer bytes ``uint8 [W]`` -> (action dict of int32 [] ``kind``/``row``/``col``/``num``, True).

        ``row``/``col`` are 0-based when ``kind`` is 0 (in range); the raw numbers otherwise.
        Every part reaches the env (the original passes all of them; the env scores bad ones).
        """
        body, length = tm.strip(text, n)
        scan = tm.Scanner(tm.lower(body), length)
        named = scan.contains(b"place") | scan.contains(b"at")
        found, values = jnp.bool_(False), jnp.zeros((3,), jnp.int32)
        for i, pattern in enumerate(PATTERNS):
            hit, nums = scan.search(pattern)
            if i >= 4:  # positional forms: row, col, num unless the text names the value first
                nums = jnp.where(named, nums, nums[jnp.asarray([2, 0, 1])])
            values = jnp.where(found, values, nums)
            found = found | hit
        num, row, col = values[0], values[1], values[2]
        n_ = self.n
        kind = jnp.where(~found, PARSE_ERROR, jnp.where((row < 1) | (row > n_), ROW_RANGE,
                         jnp.where((col < 1) | (col > n_), COL_RANGE,
                                   jnp.where((num < 1) | (num > n_), NUM_RANGE, 0))))
        shift = (kind == 0).astype(jnp.int32)
        action = {"kind": kind.astype(jnp.int32), "row": row - shift, "col": col - shift, "num": num}
        return action, n > 0

    def random_action(self, key):
        """A uniformly random in-range placement (for measuring observation lengths)."""
        r, c, v = jax.random.randint(key, (3,), 0, self.n)
        return {"kind": jnp.int32(0), "row": r, "col": c, "num": v + 1}

    def answer_text(self, row: int, col: int, num: int) -> str:
        """The canonical answer for a placement (0-based row/col): ``place 5 at row 2 col 3``."""
        return f"place {num} at row {row + 1} col {col + 1}"

    def step_env(self, key, state: SudokuState, action, params: SudokuParams):
        kind = jnp.asarray(action["kind"], jnp.int32)
        r = jnp.clip(action["row"], 0, self.n - 1)
        c = jnp.clip(action["col"], 0, self.n - 1)
        v = jnp.asarray(action["num"], jnp.int32)
        in_range = kind == 0
        given = in_range & (state.initial[r, c] != 0)
        grid = state.grid
        in_row = jnp.any(grid[r, :] == v)
        in_col = jnp.any(grid[:, c] == v)
        k = self.k
        box = jax.lax.dynamic_slice(grid, ((r // k) * k, (c // k) * k), (k, k))
        in_box = jnp.any(box == v)
        clash = in_row | in_col | in_box
        legal = in_range & ~given & ~clash
        correct = legal & (v == state.solution[r, c])
        new_grid = jnp.where(legal, grid.at[r, c].set(v), grid)
        # A legal placement keeps the grid free of repeats (the givens have none), so a full grid
        # after one is solved.
        solved = legal & jnp.all(new_grid > 0)
        feedback = jnp.where(~in_range, kind, jnp.where(given, GIVEN, jnp.where(~legal, CONFLICT,
                             jnp.where(correct, CORRECT, LEGAL))))
        reward = jnp.where(legal, jnp.where(correct, 1.0, 0.5) * params.correct_placement_score
                           + jnp.where(solved, params.completion_bonus, 0.0), params.invalid_action_score)
        time = state.time + 1
        truncated = (time >= params.max_steps_in_episode) & ~solved
        next_state = state.replace(
            time=time, grid=new_grid, feedback=feedback.astype(jnp.int32),
            row=jnp.where(in_range, r, action["row"]).astype(jnp.int32),
            col=jnp.where(in_range, c, action["col"]).astype(jnp.int32), num=v,
            clash=jnp.stack([in_row, in_col, in_box]) & (feedback == CONFLICT))
        info = {"action_is_valid": legal, "action_is_effective": legal, "success": solved}
        return self.observation(next_state), next_state, reward.astype(jnp.float32), solved, truncated, info

    def observation(self, state: SudokuState, params=None) -> chex.Array:
        """int32 [n, n] the current grid."""
        return state.grid

    # --- text: one table of fixed strings; numbers are pieces "1".."n" or digit runs ----------
    def _init_render(self):
        n, k = self.n, self.k
        t = render.PieceTable()
        self._digits = render.digit_ids(t)
        nums = [str(v) for v in range(1, n + 1)]
        t.extend(nums)
        self._num_ids = t.ids(nums)
        # Cell spellings: [code, number] with code 0 empty, 1 given, 2 conflict, 3 placed; the last
        # column loses its trailing space (the original rstrips each row).
        cells = lambda v, last: [" ." if last else " . ", f"[{v}]", f"*{v}*", f" {v}" if last else f" {v} "]  # noqa: E731
        for last in (False, True):
            for v in range(1, n + 1):
                t.extend(cells(v, last))
        self._cell_ids = np.stack([np.stack([t.ids(cells(v, last)) for v in range(1, n + 1)])
                                   for last in (False, True)])                    # [2, n, 4]
        coords = [f"({r + 1},{c + 1})" for r in range(n) for c in range(n)]
        t.extend(coords)
        self._coord_ids = t.ids(coords).reshape(n, n)
        t.extend([f"({a},{b})" for a in range(1, k + 1) for b in range(1, k + 1)])
        self._box_ids = t.ids([f"({a},{b})" for a in range(1, k + 1) for b in range(1, k + 1)]).reshape(k, k)
        dash = "-" * (n * 3 + k - 1)
        self._fixed = [RULE + "\nSUDOKU PUZZLE\n" + RULE + "\n", "\n", "| ", "\n" + dash + "\n", "\n\n" + LEGEND,
                       "\n\n", "❌ Invalid action format: ", "Row ", "Column ", "Number ", f" is out of range (1-{n})",
                       "Could not parse action. " + EXPECTED, "❌ Cannot modify initial cell at ", "❌ Invalid placement: ",
                       " conflicts with ", "row ", "column ", "box ", ", ", "\n   Valid numbers for ", ": [", "]",
                       "✓ Correct! Placed ", "⚠ Placed ", " at ", " - Valid but not optimal",
                       "\n🎉 Congratulations! Puzzle solved!", "\n\n⚠ CONFLICTS DETECTED:", "\n  - Cell ", ": ",
                       "\n\n💡 VALID NUMBERS FOR EMPTY CELLS:", "\n  - ", "\n\nProgress: ", f"/{n * n} cells filled (",
                       " initial, ", " placed)\nSteps: ", "/", ""]
        t.extend(self._fixed)
        # format_grid_simple: numbers or dots with one trailing space (none in the last column).
        t.extend([".", ". ", "\n" + "-" * (n * 2 + k - 1) + "\n"] + [f"{v} " for v in range(1, n + 1)])
        self._table = t

    def _id(self, s: str) -> int:
        return self._table.id(s)

    def _const(self, *strings):
        return render.const_section([self._id(s) for s in strings])

    def _int(self, value):
        return render.int_section(value, self._digits)

    def _grid_section(self, state: SudokuState):
        n, k = self.n, self.k
        bad = conflicts(state.grid, k)
        code = jnp.where(state.grid == 0, 0, jnp.where(state.initial != 0, 1, jnp.where(bad, 2, 3)))
        v = jnp.clip(state.grid - 1, 0, n - 1)
        last = (jnp.arange(n) == n - 1)[None, :].astype(jnp.int32)
        cells = jnp.asarray(self._cell_ids)[last, v, code]                        # [n, n]
        return self._layout(cells, cell_width=3)

    def _layout(self, cells: chex.Array, cell_width: int):
        """Cell pieces ``[n, n]`` laid out as the original's grids: ``| `` between boxes, a dashed
        line (``n * cell_width + k - 1`` dashes) between bands, ``\n`` between rows."""
        n, k = self.n, self.k
        dashes = self._id("\n" + "-" * (n * cell_width + k - 1) + "\n")
        pieces = []
        for i in range(n):
            if i > 0:
                pieces.append(jnp.asarray([dashes if i % k == 0 else self._id("\n")]))
            for j in range(n):
                if j > 0 and j % k == 0:
                    pieces.append(jnp.asarray([self._id("| ")]))
                pieces.append(cells[i, j][None])
        p = jnp.concatenate(pieces).astype(jnp.int32)
        return p, jnp.ones(p.shape, bool)

    def _feedback_section(self, state: SudokuState):
        """``"\\n\\n" + last_action_feedback`` (nothing at reset), as ``(pieces, keep)``."""
        fb, n, k = state.feedback, self.n, self.k
        on = lambda cond, *sections: [(p, kk & cond) for p, kk in sections]  # noqa: E731
        coord = jnp.asarray(self._coord_ids)[jnp.clip(state.row, 0, n - 1), jnp.clip(state.col, 0, n - 1)]
        coord_sec = (coord[None], jnp.ones((1,), bool))
        num_sec = self._int(state.num)
        # "row 1, column 2, box (1,1)": each clash with its own number, joined by ", ".
        clash = state.clash
        sep_before_col = clash[0] & clash[1]
        sep_before_box = (clash[0] | clash[1]) & clash[2]
        box = jnp.asarray(self._box_ids)[jnp.clip(state.row, 0, n - 1) // k, jnp.clip(state.col, 0, n - 1) // k]
        clash_secs = [
            *on(clash[0], self._const("row "), self._int(state.row + 1)),
            *on(sep_before_col, self._const(", ")),
            *on(clash[1], self._const("column "), self._int(state.col + 1)),
            *on(sep_before_box, self._const(", ")),
            *on(clash[2], self._const("box "), (box[None], jnp.ones((1,), bool))),
        ]
        # Valid numbers for the rejected cell (empty cells only: the original lists none otherwise).
        cand = candidates(state.grid, k)[jnp.clip(state.row, 0, n - 1), jnp.clip(state.col, 0, n - 1)]
        cand = cand & (state.grid[jnp.clip(state.row, 0, n - 1), jnp.clip(state.col, 0, n - 1)] == 0)
        valid_line = [*on(jnp.any(cand), self._const("\n   Valid numbers for "), coord_sec, self._const(": [")),
                      *on(jnp.any(cand), self._list_section(cand)), *on(jnp.any(cand), self._const("]"))]
        raw_row, raw_col = self._int(state.row), self._int(state.col)
        secs = [
            *on(fb != NONE, self._const("\n\n")),
            *on((fb >= PARSE_ERROR) & (fb <= NUM_RANGE), self._const("❌ Invalid action format: ")),
            *on(fb == PARSE_ERROR, self._const("Could not parse action. " + EXPECTED)),
            *on(fb == ROW_RANGE, self._const("Row "), raw_row),
            *on(fb == COL_RANGE, self._const("Column "), raw_col),
            *on(fb == NUM_RANGE, self._const("Number "), num_sec),
            *on((fb >= ROW_RANGE) & (fb <= NUM_RANGE), self._const(f" is out of range (1-{n})")),
            *on(fb == GIVEN, self._const("❌ Cannot modify initial cell at "), coord_sec),
            *on(fb == CONFLICT, self._const("❌ Invalid placement: "), num_sec, self._const(" conflicts with "),
                *clash_secs, *valid_line),
            *on(fb == CORRECT, self._const("✓ Correct! Placed ")),
            *on(fb == LEGAL, self._const("⚠ Placed ")),
            *on((fb == CORRECT) | (fb == LEGAL), num_sec, self._const(" at "), coord_sec),
            *on(fb == LEGAL, self._const(" - Valid but not optimal")),
            *on(((fb == CORRECT) | (fb == LEGAL)) & jnp.all(state.grid > 0),
                self._const("\n🎉 Congratulations! Puzzle solved!")),
        ]
        return render.cat_sections(*secs)

    def _list_section(self, mask: chex.Array):
        """``"1, 4, 9"`` for mask bool [n] over the numbers 1..n."""
        first = jnp.cumsum(mask) == 1
        p = jnp.stack([jnp.full((self.n,), self._id(", ")), jnp.asarray(self._num_ids)], axis=1).reshape(-1)
        keep = jnp.stack([mask & ~first, mask], axis=1).reshape(-1)
        return p, keep

    def _extras_section(self, state: SudokuState):
        """Conflicts list, valid numbers of the empty cells (when at most 10 are left), progress."""
        n, k = self.n, self.k
        secs = []
        if self.show_conflicts:
            bad = conflicts(state.grid, k).reshape(-1)
            per = jnp.stack([jnp.full((n * n,), self._id("\n  - Cell ")), jnp.asarray(self._coord_ids).reshape(-1),
                             jnp.full((n * n,), self._id(": ")),
                             jnp.asarray(self._num_ids)[jnp.clip(state.grid.reshape(-1) - 1, 0, n - 1)]], axis=1)
            secs += [(jnp.asarray([self._id("\n\n⚠ CONFLICTS DETECTED:")]), jnp.any(bad)[None]),
                     (per.reshape(-1), jnp.repeat(bad, 4))]
        if self.show_valid_numbers:
            empty = (state.grid == 0).reshape(-1)
            n_empty = jnp.sum(empty)
            show = (n_empty > 0) & (n_empty <= 10)
            cand = candidates(state.grid, k).reshape(n * n, n)
            listed = empty & jnp.any(cand, axis=1) & (state.initial.reshape(-1) == 0)
            # The original lists at most 10 cells, and only runs when at most 10 are empty.
            nums = jnp.stack([jnp.full((n * n, n), self._id(", ")), jnp.broadcast_to(jnp.asarray(self._num_ids), (n * n, n))],
                             axis=2).reshape(n * n, 2 * n)
            first = jnp.cumsum(cand, axis=1) == 1
            nkeep = jnp.stack([cand & ~first, cand], axis=2).reshape(n * n, 2 * n)
            head = jnp.stack([jnp.full((n * n,), self._id("\n  - ")), jnp.asarray(self._coord_ids).reshape(-1),
                              jnp.full((n * n,), self._id(": ["))], axis=1)
            line = jnp.concatenate([head, nums, jnp.full((n * n, 1), self._id("]"))], axis=1)
            lkeep = jnp.concatenate([jnp.ones((n * n, 3), bool), nkeep, jnp.ones((n * n, 1), bool)], axis=1)
            lkeep = lkeep & (listed & show)[:, None]
            # At most 10 cells are empty when the section shows: keep only their lines.
            (rows,) = jnp.nonzero(empty, size=10, fill_value=n * n - 1)
            real = jnp.arange(10) < n_empty
            secs += [(jnp.asarray([self._id("\n\n💡 VALID NUMBERS FOR EMPTY CELLS:")]), show[None]),
                     (line[rows].reshape(-1), (lkeep[rows] & real[:, None]).reshape(-1))]
        filled = jnp.sum(state.grid > 0)
        given = jnp.sum(state.initial > 0)
        secs += [self._const("\n\nProgress: "), self._int(filled), self._const(f"/{n * n} cells filled ("),
                 self._int(given), self._const(" initial, "), self._int(filled - given),
                 self._const(" placed)\nSteps: "), self._int(state.time), self._const("/"), self._int(state.max_steps)]
        return render.cat_sections(*secs)

    def render_pieces(self, state: SudokuState, params=None, fmt: str | None = None):
        fmt = self.check_format(fmt)
        if fmt == "simple":
            return render.compact(*self._simple_section(state))
        head = self._const(RULE + "\nSUDOKU PUZZLE\n" + RULE + "\n")
        parts = [head, self._grid_section(state), self._const("\n\n" + LEGEND), self._feedback_section(state)]
        if fmt == "with_feedback":
            parts.append(self._extras_section(state))
        return render.compact(*render.cat_sections(*parts))

    def _simple_section(self, state: SudokuState):
        """The original's ``format_grid_simple``: numbers or dots, ``| `` between boxes, dashed lines."""
        n = self.n
        t = self._table
        last_ids = np.asarray([t.id(".")] + [t.id(str(v)) for v in range(1, n + 1)])
        mid_ids = np.asarray([t.id(". ")] + [t.id(f"{v} ") for v in range(1, n + 1)])
        table = jnp.asarray(np.stack([mid_ids] * (n - 1) + [last_ids]))             # [n cols, n + 1]
        return self._layout(table[jnp.arange(n)[None, :], state.grid], cell_width=2)

    # --- host reference render (the original's formatting functions, NumPy) -----------------
    def render_text(self, state: SudokuState, fmt: str | None = None) -> str:
        fmt = self.check_format(fmt)
        return sudoku_text.render(jax.tree.map(np.asarray, state), fmt, self.n, self.show_conflicts,
                                  self.show_valid_numbers)

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return sudoku_expert.plan(self, state, params)

    def random_answer(self, state, rng) -> str:
        """A random placement, in the env's own answer form."""
        r, c, v = (int(x) for x in rng.integers(0, self.n, 3))
        return self.answer_text(r, c, v + 1)
