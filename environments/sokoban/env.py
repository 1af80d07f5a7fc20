"""Sokoban with RAGEN's procedurally generated rooms, generated inside jit.

Dynamics and reward are gym-sokoban's (which RAGEN inherits unchanged): actions 0..3 are
Up/Down/Left/Right *push* moves (RAGEN ids 1..4); a box is pushed when the cell beyond it is free,
otherwise the player just moves into free floor; walls and blocked boxes make the action a no-op
that still costs the step penalty. Reward per step: -0.1, +1 when a box lands on a target, -1 when
one leaves a target, +10 once every box is on a target (which terminates the episode). Episodes are
truncated after ``max_steps`` actions (a solve on the last step counts as terminated, not truncated).

The level generator (RAGEN's ``generate_room`` at a fixed cost per level, and the auto-reset
that generates only for finished lanes) is ``environments.sokoban.levels``; the renders
(``grid`` / ``coord`` / ``grid_coord``) are ``environments.sokoban.render``. This module is the
environment: state, dynamics, reward.

State layout: ``grid`` holds *render codes* (0 wall, 1 floor, 2 empty target, 3 box on target, 4
box, 5 player, 6 player on target), so the observation is the state itself; ``room_fixed`` holds
0 wall, 1 floor, 2 target as in gym-sokoban.
"""
from __future__ import annotations

import math
from typing import Mapping

import chex
import jax
import jax.numpy as jnp

from environments import text_match
from environments.core import DescriptionReward, EnvParams, EnvState, Environment
from environments.sokoban import expert as sokoban_expert
from environments.sokoban.levels import (BOX, BOX_ON_TARGET, FLOOR, MOVES, PLAYER, PLAYER_ON_TARGET, TARGET, WALL,
                                         Level, LevelGenerator, fallback_room)
from environments.sokoban.render import CODE_MEANINGS, DEFAULT_GRID_LOOKUP, SokobanRenderer, check_lookup

# The codes, tables and helpers of the two halves, importable from here as before the split.
__all__ = ["ACTION_NAMES", "BOX", "BOX_ON_TARGET", "CODE_MEANINGS", "DEFAULT_GRID_LOOKUP", "FLOOR", "Level", "MOVES",
           "PLAYER", "PLAYER_ON_TARGET", "Sokoban", "SokobanParams", "SokobanState", "TARGET", "WALL", "fallback_room"]

ACTION_NAMES = ("Up", "Down", "Left", "Right")
# gym-sokoban's rewards.
STEP_PENALTY, BOX_ON_REWARD, BOX_OFF_PENALTY, FINISH_REWARD = -0.1, 1.0, -1.0, 10.0

# The task paragraph (YAML block scalars in the original: they end with a newline, so the legend
# starts on a fresh line after one blank line). The coordinate form names the real board's range.
INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
    "When you are right next to a box, you can push it by moving in the same direction. "
    "You cannot push a box through a wall, and you cannot pull a box. "
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)
COORD_INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n"
    "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner ({last_row}, {last_col}). \n"
    "When you are exactly next to a box, you can push it by moving in the same direction. \n"
    "You cannot push a box through a wall, and you cannot pull a box.\n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)


@chex.dataclass(frozen=True)
class SokobanState(EnvState):
    room_fixed: chex.Array       # int8 [rows, cols] 0 wall, 1 floor, 2 target
    grid: chex.Array             # int8 [rows, cols] render codes, the observation
    player: chex.Array           # int32 [2] (row, col)
    boxes_on_target: chex.Array  # int32 []


@chex.dataclass(frozen=True)
class SokobanParams(EnvParams):
    # Optional reward shaping (0 = gym-sokoban's rewards, RAGEN's default). Our additions, not the
    # original's: potential-based distance shaping (Ng et al., 1999), which leaves the optimal policy
    # unchanged, and a penalty for a move that changes nothing (walking into a wall or a stuck box).
    distance_shaping: chex.Array = 0.0  # float32 []: + c * (dist before - dist after)
    noop_penalty: chex.Array = 0.0  # float32 []: - c for an action that moved nothing
    # Ours too: the reward for a reply whose reasoning opens with the board's exact description
    # (``Sokoban.reasoning_reward``); 0 = none. Params batched for a vmap need this one batched too.
    description_reward: chex.Array = 0.0  # float32 []: + c a turn whose reasoning reads the board right


def box_target_distance(grid: chex.Array, room_fixed: chex.Array) -> chex.Array:
    """float32 []: the sum over boxes not on a target of the Manhattan distance to the nearest target
    (0 when solved) — the potential the distance shaping reads."""
    rows, cols = grid.shape
    r = jnp.arange(rows)[:, None]
    c = jnp.arange(cols)[None, :]
    box = grid == BOX
    target = (room_fixed == TARGET) & (grid != BOX_ON_TARGET)
    dist = jnp.abs(r[:, :, None, None] - r[None, None]) + jnp.abs(c[:, :, None, None] - c[None, None])
    nearest = jnp.min(jnp.where(target[None, None], dist, rows + cols), axis=(2, 3))
    return jnp.sum(jnp.where(box, nearest, 0)).astype(jnp.float32)


class Sokoban(DescriptionReward, Environment):
    """RAGEN's Sokoban (see the module docstring).

    Args (all static):
      dim_room: (rows, cols), each >= 3 and cols <= 32 (rows of cells are uint32 bit words).
      num_boxes: boxes (= targets) per room.
      max_steps: truncation cap (the default ``EnvParams.max_steps_in_episode``).
      observation_format: "grid" | "coord" | "grid_coord" (RAGEN's renders).
      grid_lookup: render code -> symbol (RAGEN's ``grid_lookup``), codes 0..6.
      grid_vocab: symbol -> meaning for ``legend()``; derived from the code meanings when None.
      search_depth: RAGEN's reverse-search depth; caps ``walk_length`` and ``bfs_sweeps``.
      num_candidates: rooms drawn per level, the first valid one is kept (default 8 for one box,
        4 for several).
      bfs_sweeps: one-box BFS sweeps (default ``rows * cols * 2 // 3``: 24 for 6x6, above the 22
        measured as the most any of 20,000 rooms needed to converge; 42 for 8x8 (max 40 of 5,000)).
      num_walks, walk_length: reverse walks for several boxes (defaults 32 and ``3 * rows * cols``).
      reset_chunk: the largest number of levels one trip of the batched auto-reset generates
        (default 64; chunks of 4 and 16 serve steps where few episodes end).
    """

    name = "sokoban"
    action_names = ACTION_NAMES

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        observation_format: str = "grid",
        grid_lookup: Mapping[int, str] | None = None,
        grid_vocab: Mapping[str, str] | None = None,
        search_depth: int = 300,
        num_candidates: int | None = None,
        bfs_sweeps: int | None = None,
        num_walks: int = 32,
        walk_length: int | None = None,
        reset_chunk: int | None = None,
    ):
        try:
            rows, cols = (int(v) for v in dim_room)
        except (TypeError, ValueError):
            raise ValueError(f"Sokoban: dim_room={dim_room!r} must be a pair (rows, cols)") from None
        if rows < 3 or cols < 3:
            raise ValueError(f"Sokoban: dim_room={dim_room} is too small; each side needs >= 3 (walls + floor)")
        if cols > 32:
            raise ValueError(f"Sokoban: dim_room={dim_room} has more than 32 columns; transpose the room")
        if int(num_boxes) < 1:
            raise ValueError(f"Sokoban: num_boxes={num_boxes} must be >= 1")
        self.dim_room = (rows, cols)
        self.num_boxes = int(num_boxes)
        if int(max_steps) < 1:
            raise ValueError(f"Sokoban: max_steps={max_steps} must be >= 1")
        self.max_steps = int(max_steps)
        if observation_format not in self.observation_formats:
            raise ValueError(
                f"Sokoban: unknown observation_format {observation_format!r}; choose one of {self.observation_formats}"
            )
        self.observation_format = observation_format
        self.generator = LevelGenerator(self.dim_room, self.num_boxes, search_depth=search_depth,
                                        num_candidates=num_candidates, bfs_sweeps=bfs_sweeps, num_walks=num_walks,
                                        walk_length=walk_length, reset_chunk=reset_chunk)
        self.grid_lookup, self.grid_vocab = check_lookup(grid_lookup, grid_vocab)
        self.renderer = SokobanRenderer(self.dim_room, self.grid_lookup)

    # --- params -------------------------------------------------------------------------------
    def default_params(self, distance_shaping: float = 0.0, noop_penalty: float = 0.0,
                       description_reward: float = 0.0) -> SokobanParams:
        """``distance_shaping`` c adds ``c * (d_before - d_after)`` to each step's reward, ``d`` the boxes'
        distance to the nearest free targets (``box_target_distance``); ``noop_penalty`` c subtracts c
        from a step that moved nothing; ``description_reward`` c pays c for a reply whose reasoning opens
        with the board's exact description (``reasoning_reward``). All 0: gym-sokoban's (RAGEN's) rewards
        exactly."""
        for name, value in (("distance_shaping", distance_shaping), ("noop_penalty", noop_penalty),
                            ("description_reward", description_reward)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"sokoban: {name}={value!r} must be a finite number >= 0 (0 = off).")
        return SokobanParams(max_steps_in_episode=jnp.asarray(self.max_steps, jnp.int32),
                             distance_shaping=jnp.float32(distance_shaping), noop_penalty=jnp.float32(noop_penalty),
                             description_reward=jnp.float32(description_reward))

    # --- generation (environments.sokoban.levels) ------------------------------------------------
    def generate(self, key: chex.PRNGKey) -> Level:
        """One level (the first valid of ``num_candidates`` rooms, else the fixed fallback room)."""
        return self.generator.generate(key)

    # --- dynamics -------------------------------------------------------------------------------
    def _start(self, level: Level) -> SokobanState:
        return SokobanState(
            time=jnp.zeros((), jnp.int32),
            room_fixed=level.room_fixed,
            grid=level.grid,
            player=level.player,
            boxes_on_target=jnp.zeros((), jnp.int32),
        )

    def reset_env(self, key: chex.PRNGKey, params: SokobanParams) -> tuple[chex.Array, SokobanState]:
        state = self._start(self.generate(key))
        return self.observation(state, params), state

    def observation(self, state: SokobanState, params=None) -> chex.Array:
        """int32 [rows, cols] render codes (the state's grid)."""
        return state.grid.astype(jnp.int32)

    def step_env(self, key, state: SokobanState, action, params: SokobanParams):
        """gym-sokoban push action ``action`` (0 Up, 1 Down, 2 Left, 3 Right); no auto-reset.

        An out-of-range action index is a no-op step (-0.1, time advances) with
        ``action_is_valid=False``.
        """
        rows, cols = self.dim_room
        action = jnp.asarray(action, jnp.int32)
        valid = (action >= 0) & (action < 4)
        d = jnp.asarray(MOVES)[jnp.clip(action, 0, 3)]
        p = state.player
        # The border is wall, so q1 is on the board; q2 is clipped (then q1 is a wall: no push).
        q1 = p + d
        q2 = jnp.clip(p + 2 * d, 0, jnp.array([rows - 1, cols - 1]))
        grid, fixed = state.grid, state.room_fixed
        s1, s2 = grid[q1[0], q1[1]], grid[q2[0], q2[1]]
        f1, f2 = fixed[q1[0], q1[1]], fixed[q2[0], q2[1]]
        push = valid & ((s1 == BOX) | (s1 == BOX_ON_TARGET)) & ((s2 == FLOOR) | (s2 == TARGET))
        move = push | (valid & ((s1 == FLOOR) | (s1 == TARGET)))
        player_code = jnp.where(f1 == TARGET, PLAYER_ON_TARGET, PLAYER)
        box_code = jnp.where(f2 == TARGET, BOX_ON_TARGET, BOX)
        # At most three cells change; a no-op rewrites their current values.
        grid = grid.at[q2[0], q2[1]].set(jnp.where(push, box_code, s2).astype(grid.dtype))
        grid = grid.at[q1[0], q1[1]].set(jnp.where(move, player_code, s1).astype(grid.dtype))
        grid = grid.at[p[0], p[1]].set(jnp.where(move, fixed[p[0], p[1]], grid[p[0], p[1]]).astype(grid.dtype))
        player = jnp.where(move, q1, p)
        # Boxes on target change only through a push: off q1 if it is a target, onto q2 if it is one.
        delta = jnp.where(push, (f2 == TARGET).astype(jnp.int32) - (f1 == TARGET).astype(jnp.int32), 0)
        on_target = state.boxes_on_target + delta
        solved = on_target == self.num_boxes
        reward = (
            STEP_PENALTY
            + jnp.where(delta > 0, BOX_ON_REWARD, 0.0)
            + jnp.where(delta < 0, BOX_OFF_PENALTY, 0.0)
            + jnp.where(solved, FINISH_REWARD, 0.0)
        ).astype(jnp.float32)
        closer = box_target_distance(state.grid, fixed) - box_target_distance(grid, fixed)
        reward = reward + params.distance_shaping * jnp.where(push, closer, 0.0) - params.noop_penalty * (~move)
        time = state.time + 1
        terminated = solved
        truncated = (time >= params.max_steps_in_episode) & ~terminated
        state = state.replace(time=time, grid=grid, player=player, boxes_on_target=on_target)
        info = {"action_is_valid": valid, "action_is_effective": move, "success": solved}
        return self.observation(state, params), state, reward, terminated, truncated, info

    def step(self, key: chex.PRNGKey, state: SokobanState, action, params: SokobanParams | None = None):
        """``step_env`` plus auto-reset; under ``vmap`` only finished lanes generate (module docstring)."""
        params = self.default_params() if params is None else params
        key_step, key_reset = jax.random.split(key)
        obs, next_state, reward, terminated, truncated, info = self.step_env(key_step, state, action, params)
        done = terminated | truncated
        fresh = self._start(self.generator.reset_where(done, key_reset))
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), fresh, next_state)
        return self.observation(next_state, params), next_state, reward, terminated, truncated, info

    # --- text (environments.sokoban.render) -----------------------------------------------------
    @property
    def piece_table(self) -> tuple[str, ...]:
        return self.renderer.piece_table

    def max_pieces(self, fmt: str | None = None) -> int:
        return self.renderer.max_pieces(self.check_format(fmt))

    def render_pieces(self, state: SokobanState, params=None, fmt: str | None = None):
        """Device render -> ``(pieces int32 [max_pieces(fmt)], n int32)`` into ``piece_table``."""
        return self.renderer.render_pieces(state, self.check_format(fmt))

    def render_text(self, state, fmt: str | None = None) -> str:
        """Host render from NumPy arrays (RAGEN's ``_render_text``): the reference for the device path."""
        return self.renderer.render_text(state, self.check_format(fmt))

    def legend(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.grid_vocab.items())

    # --- the system prompt ---------------------------------------------------------------------
    def instruction_text(self, fmt, board_shape, params=None) -> str:
        """The task paragraph; the coordinate formats name the board's real range (an 8×8 room reads
        "(7, 7)"; the original always said "(5, 5)")."""
        if fmt in ("coord", "grid_coord"):
            return COORD_INSTRUCTION.format(last_row=board_shape[0] - 1, last_col=board_shape[1] - 1)
        return INSTRUCTION

    # --- the board's description (what reasoning that reads the board right opens with) -----------
    def description_bytes(self, state: SokobanState) -> tuple[chex.Array, chex.Array]:
        """The board's description as the expert's reasoning opens (``sokoban_reasoning``), up to and
        including its first ``;``: "The player is at (1, 1), the box at (2, 2) and the target at (3, 4);"
        — the first box and the first target in row-major order, as the expert names them; a clause is
        left out when there is no such cell. -> ``(uint8 [description_width], int32 [] length)``, built
        on device."""
        digits = len(str(max(self.dim_room) - 1))

        def text(literal: str, when=True):
            return text_match.masked(text_match.literal(literal), when)

        def cell(rc, when=True):  # "(r, c)"
            return text_match.cell(rc, digits, when)

        def first(mask):  # the first True cell of a [rows, cols] mask in row-major order, and whether any
            flat = mask.reshape(-1)
            i = jnp.argmax(flat)
            return jnp.stack([i // self.dim_room[1], i % self.dim_room[1]]), jnp.any(flat)

        box, has_box = first((state.grid == BOX) | (state.grid == BOX_ON_TARGET))
        target, has_target = first(state.room_fixed == TARGET)
        parts = [text("The player is at "), *cell(state.player), text(", the box at ", has_box), *cell(box, has_box),
                 text(" and the target at ", has_target), *cell(target, has_target), text(";")]
        return text_match.concat(parts, self.description_width)

    @property
    def description_width(self) -> int:
        """The longest description ``description_bytes`` can build."""
        cell = len("(, )") + 2 * len(str(max(self.dim_room) - 1))
        return len("The player is at , the box at  and the target at ;") + 3 * cell

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return sokoban_expert.plan(self, state, params)
