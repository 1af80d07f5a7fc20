"""2048 on a 4×4 board (RAGEN's ``game_2048``), every move and spawn inside jit.

Rules as in the original (``ragen/env/game_2048``): a move slides every tile towards one side and
merges equal neighbours once per move, left to right in the direction of travel; the merge reward is
the sum of the merged tiles; after a move that changed the board one tile spawns on a uniformly
random empty cell, a 2 with probability ``two_prob`` (0.9) else a 4. Two tiles are spawned at reset.
A move that changes nothing is invalid: no spawn, ``action_is_valid=False``, penalty
``invalid_act_score`` (-0.1). The episode terminates when no move changes the board; ``success``
means it ended with a tile of at least 2048.

Reward: with ``use_log_reward`` (the default, as the original) a merge of value ``m`` pays
``0.1 * log2(m + 1)`` and a move without merges 0. Difference from the original, on purpose: its log
reward maps the invalid-move penalty to 0 (it only rewards ``raw > 0``), although its prompt
promises a penalty; here the penalty applies under both rewards. ``use_log_reward=False`` pays the
raw merge sum.

Actions: 0 Up, 1 Right, 2 Down, 3 Left (the original's ids). The state stores tile *exponents*
(0 empty, 1 → 2, 2 → 4, …, 17 → 131072), so the board is small ints and a merge is ``e + 1``.

Text: ``render_text`` is the original's ``render()`` character for character (grid rows, valid
actions with their ids, the running score); ``render_pieces`` builds the same text on device.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments.core import EnvParams, EnvState, Environment
from environments.game_2048 import expert as game_2048_expert
from environments.game_2048.rules import SIZE, merge_line

MAX_EXPONENT = 17  # 2**17 = 131072, the largest tile a 4x4 board can hold
ACTION_NAMES = ("Up", "Right", "Down", "Left")
GOAL_LINE = "Goal: Merge same numbers to reach 2048."


@chex.dataclass(frozen=True)
class Game2048State(EnvState):
    board: chex.Array  # int32 [4, 4] tile exponents (0 = empty)
    score: chex.Array  # int32 [] sum of all merged tiles so far


@chex.dataclass(frozen=True)
class Game2048Params(EnvParams):
    two_prob: chex.Array           # float32 [] probability that a spawned tile is a 2
    invalid_act_score: chex.Array  # float32 [] reward of a move that changes nothing
    use_log_reward: chex.Array     # bool [] 0.1 * log2(merge + 1) instead of the merge sum


def _line_table() -> tuple[np.ndarray, np.ndarray]:
    """Every line of four exponents (18**4 = 104,976 of them) -> its slid line and merge value.

    A move is then four table lookups per direction: far cheaper under vmap than sorting or
    scattering each line (the trick fast 2048 players use).
    """
    base = MAX_EXPONENT + 1
    lines = np.stack(np.meshgrid(*[np.arange(base)] * SIZE, indexing="ij"), -1).reshape(-1, SIZE)
    slid = np.zeros_like(lines)
    gain = np.zeros(len(lines), np.int64)
    for i, line in enumerate(lines):
        slid[i], gain[i] = merge_line(line)
    # A tile past 2**17 cannot arise on a 4x4 board; clip keeps the table closed anyway.
    return np.minimum(slid, MAX_EXPONENT).astype(np.int32), gain.astype(np.int32)


_TABLE = None


def line_table() -> tuple[np.ndarray, np.ndarray]:
    global _TABLE
    if _TABLE is None:
        _TABLE = _line_table()
    return _TABLE


def _oriented(board: chex.Array, action) -> chex.Array:
    """The board turned so that ``action`` slides every row towards column 0 (an involution)."""
    flips = (
        board.T,                 # Up: columns, travelling to row 0
        board[:, ::-1],          # Right: rows, travelling to the last column
        board[::-1, :].T,        # Down: columns, travelling to the last row
        board,                   # Left
    )
    return flips[action]


def _restore(rows: chex.Array, action) -> chex.Array:
    undo = (rows.T, rows[:, ::-1], rows.T[::-1, :], rows)
    return undo[action]


def slide(board: chex.Array) -> tuple[chex.Array, chex.Array]:
    """All four moves at once: ``(boards int32 [4, 4, 4], merged value int32 [4])`` by action."""
    slid, gain = (jnp.asarray(t) for t in line_table())
    radix = (MAX_EXPONENT + 1) ** jnp.arange(SIZE - 1, -1, -1)
    boards, gains = [], []
    for a in range(4):
        rows = _oriented(board, a)
        index = jnp.sum(jnp.clip(rows, 0, MAX_EXPONENT) * radix, axis=1)
        boards.append(_restore(slid[index], a))
        gains.append(jnp.sum(gain[index]))
    return jnp.stack(boards), jnp.stack(gains)


def _spawn(u_cell, u_value, board, two_prob):
    """One tile on a uniformly random empty cell (none when the board is full); u_* uniform [0, 1)."""
    empty = (board == 0).reshape(-1)
    n = jnp.sum(empty)
    pick = jnp.floor(u_cell * n).astype(jnp.int32)
    # The pick-th empty cell (row-major, the original's np.where order).
    cell = jnp.argmax(empty & (jnp.cumsum(empty) - 1 == pick))
    value = jnp.where(u_value < two_prob, 1, 2)
    flat = board.reshape(-1)
    flat = jnp.where((jnp.arange(SIZE * SIZE) == cell) & (n > 0), value, flat)
    return flat.reshape(SIZE, SIZE).astype(jnp.int32)


def _uniforms(key, n: int) -> chex.Array:
    """n uniforms in [0, 1) from one threefry call (24-bit resolution)."""
    return (jax.random.bits(key, (n,), jnp.uint32) >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


class Game2048(Environment):
    """RAGEN's 2048: ``observation_format`` is ``"text"`` (the original's render)."""

    name = "game_2048"
    action_names = ACTION_NAMES
    observation_formats = ("text",)
    observation_format = "text"
    list_actions = True  # the system prompt lists the four moves, as the original's action_lookup does

    instruction = (
        "You are playing 2048 on a 4x4 grid. Slide all tiles Up, Right, Down or Left; two equal tiles "
        "that meet merge into their sum. A move that moves no tile is invalid and costs a small penalty. "
        "Answer with one move, for example <answer>Left</answer>.\n"
    )

    def __init__(self, observation_format: str = "text"):
        self.observation_format = self.check_format(observation_format)
        t = render.PieceTable(["Current 2048 Grid:"])
        t.extend(f"\nRow {i + 1}: [" for i in range(SIZE))
        t.extend(str(0 if e == 0 else 2 ** e) for e in range(MAX_EXPONENT + 1))
        t.extend([", ", "]", "\n\nValid Actions: ", "None", ".\n" + GOAL_LINE + "\nCurrent Score: ",
                  "\nWhat is your next move?"])
        t.extend(f"{a}({n})" for a, n in enumerate(ACTION_NAMES))
        self._digits = render.digit_ids(t)
        self._table = t
        self._tile_ids = t.ids([str(0 if e == 0 else 2 ** e) for e in range(MAX_EXPONENT + 1)])
        self._action_ids = t.ids([f"{a}({n})" for a, n in enumerate(ACTION_NAMES)])

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, two_prob: float = 0.9, invalid_act_score: float = -0.1,
                       use_log_reward: bool = True, max_steps_in_episode: int = 1 << 30) -> Game2048Params:
        if not 0.0 <= float(two_prob) <= 1.0:
            raise ValueError(f"game_2048: two_prob={two_prob} is not a probability")
        if int(max_steps_in_episode) < 1:
            raise ValueError(f"game_2048: max_steps_in_episode={max_steps_in_episode} must be >= 1")
        return Game2048Params(two_prob=jnp.float32(two_prob), invalid_act_score=jnp.float32(invalid_act_score),
                              use_log_reward=jnp.bool_(use_log_reward),
                              max_steps_in_episode=jnp.int32(max_steps_in_episode))

    def reset_env(self, key, params: Game2048Params):
        return self._reset_from(_uniforms(key, 4), params)

    def _reset_from(self, u, params):
        board = _spawn(u[2], u[3], _spawn(u[0], u[1], jnp.zeros((SIZE, SIZE), jnp.int32), params.two_prob),
                       params.two_prob)
        state = Game2048State(time=jnp.int32(0), board=board, score=jnp.int32(0))
        return self.observation(state), state

    def step(self, key, state: Game2048State, action, params: Game2048Params | None = None):
        """``step_env`` + auto-reset from one threefry call (2 uniforms for the spawn, 4 for the reset)."""
        params = self.default_params() if params is None else params
        u = _uniforms(key, 6)
        obs, next_state, reward, terminated, truncated, info = self._transition(u[:2], state, action, params)
        _, fresh = self._reset_from(u[2:], params)
        done = terminated | truncated
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), fresh, next_state)
        return self.observation(next_state), next_state, reward, terminated, truncated, info

    def valid_moves(self, state: Game2048State) -> chex.Array:
        """bool [4]: the moves that change the board (the original's action mask)."""
        boards, _ = slide(state.board)
        return jnp.any(boards != state.board[None], axis=(1, 2))

    def step_env(self, key, state: Game2048State, action, params: Game2048Params):
        return self._transition(_uniforms(key, 2), state, action, params)

    def _transition(self, u, state: Game2048State, action, params: Game2048Params):
        action = jnp.asarray(action, jnp.int32)
        boards, gains = slide(state.board)
        in_range = (action >= 0) & (action < 4)
        a = jnp.clip(action, 0, 3)
        moved = in_range & jnp.any(boards[a] != state.board)
        gained = jnp.where(moved, gains[a], 0)
        board = jnp.where(moved, _spawn(u[0], u[1], boards[a], params.two_prob), state.board)
        next_state = Game2048State(time=state.time + 1, board=board, score=state.score + gained)
        mask = self.valid_moves(next_state)
        terminated = moved & ~jnp.any(mask)
        log_reward = jnp.where(gained > 0, 0.1 * jnp.log2(gained.astype(jnp.float32) + 1.0), 0.0)
        reward = jnp.where(moved, jnp.where(params.use_log_reward, log_reward, gained.astype(jnp.float32)),
                           params.invalid_act_score).astype(jnp.float32)
        truncated = (next_state.time >= params.max_steps_in_episode) & ~terminated
        info = {"action_is_valid": moved, "action_is_effective": moved,
                "success": terminated & (jnp.max(board) >= 11),  # 2**11 = 2048
                "action_mask": mask}  # the moves that change the next board (the original's info key)
        return self.observation(next_state), next_state, reward, terminated, truncated, info

    # The observation's integer codes (tile exponents 0 .. MAX_EXPONENT): its gymnax Box space (environments.gymnax_adapter).
    observation_codes = MAX_EXPONENT + 1

    def observation(self, state: Game2048State, params=None) -> chex.Array:
        """int32 [4, 4] tile exponents."""
        return state.board

    # --- text -----------------------------------------------------------------------------
    def render_pieces(self, state: Game2048State, params=None, fmt: str | None = None):
        self.check_format(fmt)
        t = self._table
        tiles = jnp.asarray(self._tile_ids)[jnp.clip(state.board, 0, MAX_EXPONENT)]  # [4, 4]
        sep = jnp.full((SIZE, SIZE - 1), t.id(", "), jnp.int32)
        cells = jnp.stack([tiles[:, :-1], sep], axis=2).reshape(SIZE, -1)
        heads = jnp.asarray(t.ids([f"\nRow {i + 1}: [" for i in range(SIZE)]))[:, None]
        rows = jnp.concatenate([heads, cells, tiles[:, -1:], jnp.full((SIZE, 1), t.id("]"))], axis=1).reshape(-1)
        valid = self.valid_moves(state)
        first = jnp.cumsum(valid) == 1
        acts = jnp.stack([jnp.full((4,), t.id(", ")), jnp.asarray(self._action_ids)], axis=1).reshape(-1)
        act_keep = jnp.stack([valid & ~first, valid], axis=1).reshape(-1)
        return render.compact(*render.cat_sections(
            render.const_section([t.id("Current 2048 Grid:")]),
            (rows, jnp.ones(rows.shape, bool)),
            render.const_section([t.id("\n\nValid Actions: ")]),
            (acts, act_keep),
            (jnp.asarray([t.id("None")]), ~jnp.any(valid)[None]),
            render.const_section([t.id(".\n" + GOAL_LINE + "\nCurrent Score: ")]),
            render.int_section(state.score, self._digits),
            render.const_section([t.id("\nWhat is your next move?")]),
        ))

    def render_text(self, state: Game2048State, fmt: str | None = None) -> str:
        """The original's ``render()``: host, NumPy."""
        self.check_format(fmt)
        board = np.asarray(state.board)
        values = np.where(board == 0, 0, 2 ** board.astype(np.int64))
        lines = ["Current 2048 Grid:"]
        lines += [f"Row {i + 1}: [" + ", ".join(str(int(v)) for v in values[i]) + "]" for i in range(SIZE)]
        valid = np.asarray(self.valid_moves(jax.tree.map(jnp.asarray, state)))
        names = [f"{a}({ACTION_NAMES[a]})" for a in range(4) if valid[a]]
        lines += ["", f"Valid Actions: {', '.join(names) if names else 'None'}.", GOAL_LINE,
                  f"Current Score: {int(np.asarray(state.score))}", "What is your next move?"]
        return "\n".join(lines)

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return game_2048_expert.plan(self, state, params)
