"""The closed-loop experts behind the behaviour-cloning warm-up: one per environment.

``EXPERTS[env.name](env, state, params)`` -> ``Plan``: the answers the expert would give from
``state`` (answer *texts*, exactly what the model should write between ``<answer>`` tags, in
order; the warm-up takes the first ``max_actions_per_turn``) and ``reasoning(answers)``, one
sentence about the state that leads to the answers actually given (the expert's, or a random one). ``random_answer(env, rng)`` is a random
legal-looking answer (``warmup.action_noise``). Solvers live in ``environments.solvers``; here the
state is read and the text written.

The warm-up steps its host copy of the env with the action each answer *parses to*
(``answer_action``): the env's own ``parse_action`` for free-text actions, the name's index
otherwise — the same reading the rollout applies to the model's reply.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from environments import solvers


@dataclasses.dataclass(frozen=True)
class Plan:
    answers: list[str]                     # the expert's next answers, in order
    reasoning: Callable[[list[str]], str]  # sentence about the state leading to the given answers


def _cell(rc) -> str:
    return f"({int(rc[0])}, {int(rc[1])})"


def _names(env, actions) -> list[str]:
    return [env.action_names[int(a)] for a in actions]


# --- grid worlds ---------------------------------------------------------------------------------


def frozen_lake_reasoning(pos, goal, holes: np.ndarray, first: str | None) -> str:
    """Where the player and goal are, and which neighbouring hole the chosen move steers clear of."""
    pos, goal = np.asarray(pos), np.asarray(goal)
    moves = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]])  # FrozenLake: Left, Down, Right, Up
    text = f"The player is at {_cell(pos)} and the goal at {_cell(goal)}"
    if first is None:
        return text + "."
    size = holes.shape[0]
    near = [pos + d for d in moves if 0 <= (pos + d)[0] < size and 0 <= (pos + d)[1] < size and holes[tuple(pos + d)]]
    if near:
        return text + f"; moving {first} avoids the hole at {_cell(near[0])}."
    return text + f"; moving {first} gets closer."


def sokoban_reasoning(player, boxes, targets, first: str | None) -> str:
    text = f"The player is at {_cell(player)}"
    if len(boxes):
        text += f", the box at {_cell(boxes[0])}"
    if len(targets):
        text += f" and the target at {_cell(targets[0])}"
    return text + (f"; I move {first}." if first is not None else ".")


def _frozen_lake(env, s, params) -> Plan:
    answers = _names(env, solvers.frozen_lake_shortest_path(s.holes, tuple(s.pos), tuple(s.goal)) or [])
    return Plan(answers, lambda given: frozen_lake_reasoning(s.pos, s.goal, s.holes, given[0] if given else None))


def _sokoban(env, s, params) -> Plan:
    from environments import sokoban as sk

    answers = _names(env, solvers.solve_sokoban(s.room_fixed, s.grid) or [])
    boxes = np.argwhere((s.grid == sk.BOX) | (s.grid == sk.BOX_ON_TARGET))
    targets = np.argwhere(s.room_fixed == sk.TARGET)
    return Plan(answers, lambda given: sokoban_reasoning(s.player, boxes, targets, given[0] if given else None))


# --- puzzles -------------------------------------------------------------------------------------


def _game_2048(env, s, params) -> Plan:
    board = np.asarray(s.board)
    move = solvers.best_2048_move(board, float(np.asarray(params.two_prob)))
    answers = [] if move is None else [env.action_names[move]]
    top = int(2 ** board.max()) if board.max() else 0

    def reasoning(given):
        text = f"The largest tile is {top} and {int(np.sum(board == 0))} cells are empty"
        return text + (f"; {given[0]} keeps the board open." if given else ".")

    return Plan(answers, reasoning)


def _rubikscube(env, s, params) -> Plan:
    plan = solvers.solve_cube(np.asarray(s.stickers), env.moves) or []
    answers = _names(env, plan)

    def reasoning(given):
        if not plan:
            return "The cube is already solved."
        return f"The cube is {len(plan)} moves from solved; I turn {' then '.join(given)}."

    return Plan(answers, reasoning)


def _sudoku(env, s, params) -> Plan:
    grid = np.asarray(s.grid)
    solved = solvers.solve_sudoku(grid)
    target = solved if solved is not None else np.asarray(s.solution)
    # Fewest candidates first: the cells a person would fill next.
    cells = sorted((len(solvers.sudoku_candidates(grid, r, c)), r, c) for r, c in np.argwhere(grid == 0))
    answers, notes = [], []
    for _, r, c in cells:
        answers.append(env.answer_text(int(r), int(c), int(target[r, c])))
        notes.append((int(r), int(c), solvers.sudoku_candidates(grid, r, c), int(target[r, c])))

    def reasoning(given):
        if not given or not notes:
            return "The grid is full."
        if given[0] != answers[0]:
            return f"I try {given[0]}."
        r, c, cand, v = notes[0]
        only = "can only be" if len(cand) == 1 else f"has candidates {cand} and must be"
        return f"The cell at row {r + 1} col {c + 1} {only} {v}."

    return Plan(answers, reasoning)


def _countdown(env, s, params) -> Plan:
    nums = [int(v) for v in np.asarray(s.numbers)[: int(np.asarray(s.count))]]
    target = int(np.asarray(s.target))
    expr = solvers.solve_countdown(nums, target, env.operators)
    answers = [] if expr is None else [expr]

    def reasoning(given):
        return f"With {nums} and target {target}: " + (f"{given[0]} = {target}." if given else "no equation works.")

    return Plan(answers, reasoning)


def _bandit(env, s, params) -> Plan:
    """The high-risk arm (its mean payout, 0.25 by default, beats the low-risk arm's 0.1). The
    reasoning names both arms and the choice but not why: with ``warmup.action_noise=1.0`` the
    warm-up teaches the reply format on random choices between the two shown arms, and which arm
    pays is left to RL."""
    shown = [env.action_names[int(i)] for i in np.asarray(env.shown_arms(s))]
    high = env.action_names[2 * int(s.pair) + 1]
    return Plan([high], lambda given: f"The arms are {shown[0]} and {shown[1]}; I pull "
                                      f"{given[0] if given else high}.")


EXPERTS: dict[str, Callable[[Any, Any, Any], Plan]] = {
    "bandit": _bandit,
    "frozen_lake": _frozen_lake,
    "sokoban": _sokoban,
    "game_2048": _game_2048,
    "rubikscube": _rubikscube,
    "sudoku": _sudoku,
    "countdown": _countdown,
}


def plan(env, state, params) -> Plan:
    name = getattr(env, "name", "").lower()
    if name not in EXPERTS:
        raise ValueError(f"behaviour cloning has no expert for env {name!r}; supported: {', '.join(sorted(EXPERTS))}")
    return EXPERTS[name](env, jax.tree.map(np.asarray, state), params)


def random_answer(env, state, rng: np.random.Generator) -> str:
    """A random answer of the right shape: an action name, or for free-text envs a random reading."""
    name = getattr(env, "name", "").lower()
    if name == "bandit":  # one of the two arms shown (every other name is an invalid action)
        return env.action_names[int(np.asarray(env.shown_arms(state))[int(rng.integers(2))])]
    if env.action_names:
        return env.action_names[int(rng.integers(len(env.action_names)))]
    if name == "sudoku":
        r, c, v = (int(x) for x in rng.integers(0, env.n, 3))
        return env.answer_text(r, c, v + 1)
    if name == "countdown":
        nums = [int(v) for v in np.asarray(state.numbers)[: int(np.asarray(state.count))]]
        rng.shuffle(nums)
        ops = [str(rng.choice(list(env.operators))) for _ in nums[1:]]
        return " ".join(x for pair in zip(map(str, nums), ops + [""]) for x in pair).strip()
    raise ValueError(f"no random answer for env {name!r}")


@functools.lru_cache(maxsize=8)
def _jitted_parse(env):
    return jax.jit(env.parse_action)


def answer_action(env, text: str):
    """The action ``text`` parses to, as the rollout reads it (host arrays)."""
    if not hasattr(env, "parse_action"):
        lookup = {n.lower(): i for i, n in enumerate(env.action_names)}
        return lookup[text.lower()]
    data = text.encode("utf-8")
    width = int(getattr(env, "max_action_bytes", None) or max(len(data), 1))
    buf = np.zeros((width,), np.uint8)
    buf[: min(len(data), width)] = np.frombuffer(data[:width], np.uint8)
    action, _ = _jitted_parse(env)(jnp.asarray(buf), jnp.int32(len(data)))
    return action
