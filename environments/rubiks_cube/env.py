"""The 2×2 Rubik's cube (pocket cube, RAGEN's ``rubikscube``) as 24 sticker colours, inside jit.

Stickers: six faces in the order U(0), L(1), F(2), R(3), B(4), D(5), four stickers each in reading
order (face ``f`` holds indices ``4f .. 4f + 3`` as ``[[0, 1], [2, 3]]``); the solved cube has
colour ``f`` on face ``f`` (W, O, G, R, B, Y). A move is a fixed permutation of the 24 stickers,
applied with one gather: ``state = state[PERMS[a]]``.

Actions (Singmaster): 0 U, 1 U', 2 D, 3 D', 4 L, 5 L', 6 R, 7 R', 8 F, 9 F', 10 B, 11 B' (the
original's ids 1..12 minus one); a letter turns that face 90° clockwise seen from outside it, the
prime turns it back. Reset scrambles the solved cube with ``scramble_depth`` uniformly random moves
(the original's rule: no check against undoing the previous move). Reward 1 and ``success`` when
every face is one colour; the episode is truncated after ``max_steps_in_episode`` moves (the
original's ``max_steps``, default 20).

Difference from the original, on purpose: its ``B`` move is not a rotation of a cube — it cycles
the back layer's side stickers with two of them in the wrong order, so ``B`` twists corners in ways
no physical cube can. ``moves="physical"`` (the default) uses the true back turn; the other eleven
moves are the original's exactly (checked against a 3-D model of the cube in the tests).
``moves="ragen"`` reproduces the original's ``B`` to compare with its published runs.

Text: ``render_text`` is the original's ``render()`` (faces as ``[W, O]`` rows, the step counter,
the move list or the game-over line).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments.core import EnvParams, EnvState, Environment

from environments.rubiks_cube import expert as cube_expert
from environments.rubiks_cube.cube import ACTION_NAMES, COLOURS, FACE_LABELS, SOLVED, move_table  # noqa: F401


@chex.dataclass(frozen=True)
class CubeState(EnvState):
    stickers: chex.Array   # int32 [24] colour of each sticker
    max_steps: chex.Array  # int32 [] the step cap (printed by the render)
    over: chex.Array       # int32 [] 0 playing, 1 solved, 2 out of moves (the render's last line)


@chex.dataclass(frozen=True)
class CubeParams(EnvParams):
    scramble_depth: chex.Array  # int32 [] random moves applied at reset


def is_solved(stickers: chex.Array) -> chex.Array:
    faces = stickers.reshape(6, 4)
    return jnp.all(faces == faces[:, :1])


class RubiksCube(Environment):
    """RAGEN's 2×2 cube. ``observation_format`` is ``"text"``; ``moves``: see the module docstring."""

    name = "rubikscube"
    action_names = ACTION_NAMES
    observation_formats = ("text",)
    observation_format = "text"
    list_actions = True

    instruction = (
        "You are solving a 2x2 Rubik's cube (pocket cube): turn its faces until every face shows a single "
        "colour. Moves use Singmaster notation: U (up), D (down), L (left), R (right), F (front), B (back) "
        "turn that face 90 degrees clockwise as seen from outside it; a prime (U', R', ...) turns it "
        "counter-clockwise. Answer with a sequence of moves separated by \"||\", for example "
        "<answer>R || U'</answer>.\n"
    )

    def __init__(self, moves: str = "physical", observation_format: str = "text"):
        self.observation_format = self.check_format(observation_format)
        self.moves = moves
        self.table = move_table(moves)
        t = render.PieceTable(["=== Rubik's Cube 2x2 State ===\nStep: ", "/", "\n"])
        t.extend(f"\n{label}" for label in FACE_LABELS)
        t.extend(["[", ", ", "]\n [", "]"])
        t.extend(COLOURS)
        t.extend(["\n\nAvailable Actions:\n" + ", ".join(ACTION_NAMES) + "\n\nWhat is your next move?",
                  "\n\n=== Game Over: Cube Solved! ===", "\n\n=== Game Over: Max steps reached. ==="])
        self._digits = render.digit_ids(t)
        self._table = t

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, scramble_depth: int = 5, max_steps_in_episode: int = 20) -> CubeParams:
        if int(scramble_depth) < 0 or int(max_steps_in_episode) < 1:
            raise ValueError(f"rubikscube: scramble_depth={scramble_depth} must be >= 0 and "
                             f"max_steps_in_episode={max_steps_in_episode} >= 1")
        return CubeParams(scramble_depth=jnp.int32(scramble_depth), max_steps_in_episode=jnp.int32(max_steps_in_episode))

    def reset_env(self, key, params: CubeParams):
        table = jnp.asarray(self.table)

        def scramble(i, stickers):
            a = jax.random.randint(jax.random.fold_in(key, i), (), 0, 12)
            return stickers[table[a]]

        stickers = jax.lax.fori_loop(0, params.scramble_depth, scramble, jnp.asarray(SOLVED))
        state = CubeState(time=jnp.int32(0), stickers=stickers, max_steps=params.max_steps_in_episode,
                          over=jnp.int32(0))
        return self.observation(state), state

    def step_env(self, key, state: CubeState, action, params: CubeParams):
        action = jnp.asarray(action, jnp.int32)
        valid = (action >= 0) & (action < 12)
        moved = state.stickers[jnp.asarray(self.table)[jnp.clip(action, 0, 11)]]
        stickers = jnp.where(valid, moved, state.stickers)
        time = state.time + 1
        solved = is_solved(stickers)
        truncated = (time >= params.max_steps_in_episode) & ~solved
        over = jnp.where(solved, 1, jnp.where(truncated, 2, 0)).astype(jnp.int32)
        next_state = state.replace(time=time, stickers=stickers, over=over)
        info = {"action_is_valid": valid, "action_is_effective": valid, "success": solved}
        return self.observation(next_state), next_state, solved.astype(jnp.float32), solved, truncated, info

    # The observation's integer codes (one code per sticker colour): its gymnax Box space (environments.gymnax_adapter).
    observation_codes = len(COLOURS)

    def observation(self, state: CubeState, params=None) -> chex.Array:
        """int32 [6, 4] sticker colours per face."""
        return state.stickers.reshape(6, 4)

    # --- text -----------------------------------------------------------------------------
    def render_pieces(self, state: CubeState, params=None, fmt: str | None = None):
        self.check_format(fmt)
        t = self._table
        colour = jnp.asarray(t.ids(list(COLOURS)))[state.stickers].reshape(6, 4)
        labels = jnp.asarray(t.ids([f"\n{label}" for label in FACE_LABELS]))
        faces = jnp.stack([labels, jnp.full((6,), t.id("[")), colour[:, 0], jnp.full((6,), t.id(", ")), colour[:, 1],
                           jnp.full((6,), t.id("]\n [")), colour[:, 2], jnp.full((6,), t.id(", ")), colour[:, 3],
                           jnp.full((6,), t.id("]"))], axis=1).reshape(-1)
        tail = jnp.asarray(t.ids(["\n\nAvailable Actions:\n" + ", ".join(ACTION_NAMES) + "\n\nWhat is your next move?",
                                  "\n\n=== Game Over: Cube Solved! ===", "\n\n=== Game Over: Max steps reached. ==="]))
        return render.compact(*render.cat_sections(
            render.const_section([t.id("=== Rubik's Cube 2x2 State ===\nStep: ")]),
            render.int_section(state.time, self._digits),
            render.const_section([t.id("/")]),
            render.int_section(state.max_steps, self._digits),
            render.const_section([t.id("\n")]),
            (faces, jnp.ones(faces.shape, bool)),
            (tail[jnp.clip(state.over, 0, 2)][None], jnp.ones((1,), bool)),
        ))

    def render_text(self, state: CubeState, fmt: str | None = None) -> str:
        """The original's ``render()``: host, NumPy."""
        self.check_format(fmt)
        s = np.asarray(state.stickers)
        lines = ["=== Rubik's Cube 2x2 State ===", f"Step: {int(state.time)}/{int(state.max_steps)}", ""]
        for f, label in enumerate(FACE_LABELS):
            c = [COLOURS[int(v)] for v in s[4 * f: 4 * f + 4]]
            lines.append(f"{label}[{c[0]}, {c[1]}]\n [{c[2]}, {c[3]}]")
        over = int(state.over)
        if over == 0:
            lines += ["", "Available Actions:", ", ".join(ACTION_NAMES), "\nWhat is your next move?"]
        else:
            lines += ["", "=== Game Over: " + ("Cube Solved!" if over == 1 else "Max steps reached.") + " ==="]
        return "\n".join(lines)

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return cube_expert.plan(self, state, params)
