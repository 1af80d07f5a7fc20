"""The environment contract: gymnax-style, every function pure, state in a struct.

An environment is a stateless object holding only *static* configuration (grid size, box count,
symbol table, observation format). Everything that changes lives in an ``EnvState`` pytree, and
numeric knobs that may be traced (slip probability, frozen fraction, step cap) live in an
``EnvParams`` pytree, so one compiled function serves every value of them.

    obs, state = env.reset(key, params)
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

``step`` auto-resets finished episodes (gymnax semantics, for throughput loops); ``step_env`` does
not (the LLM agent loop masks finished episodes itself). ``obs`` is the symbol grid
``int32 [rows, cols]`` of render codes. ``info`` always carries ``action_is_valid``,
``action_is_effective`` and ``success`` (RAGEN's names).

Actions are 0-based indices into ``env.action_names`` (RAGEN's ids are these plus one).

What the agent reads and how it answers is the environment's own (``AgentFacing``, with the
defaults of everything optional); the rollout and the warm-up use nothing else:
  * ``instruction_text(fmt, board_shape, params)``: the task paragraph of the system prompt (default:
    the ``instruction`` attribute); ``lists_actions(fmt)``: whether the system prompt lists
    ``action_names`` (default: not for ``"text"`` observations, nor for free-text actions);
  * ``parse_action(text uint8 [W], n int32 []) -> (action pytree, valid bool [])`` with
    ``max_action_bytes = W``: free-text answers (Sudoku's placements, Countdown's equations)
    read on device by the env itself; ``action_names`` is then empty and an action is whatever
    ``parse_action`` returns (``step_env`` takes the same pytree). ``None``: actions are names;
  * ``random_action(key)``: a random action of that pytree shape (used to measure observation
    lengths; the default draws an index below ``num_actions``);
  * ``expert(state, params) -> Plan`` (host, NumPy state): the behaviour-cloning warm-up's
    demonstrations; ``random_answer(state, rng)``: a random legal-looking answer;
    ``answer_action(text)``: the action an answer parses to, as the rollout reads it;
  * ``reset_batch`` / ``render_batch`` / ``step_batch``: the episode batch at once (default: the
    single-episode functions under ``vmap``; a Python environment makes one host call instead).

Text. The language model reads the state as text. Two renders exist and must agree exactly:
  * ``render_text(state, fmt)`` — host, NumPy, the original's strings (the reference);
  * ``render_pieces(state, params, fmt)`` — device: ``(pieces int32 [max_pieces], n int32)``, the
    text as a sequence of ids into the static string table ``env.piece_table``. The rollout's
    codec tokenises each table entry once, so an observation becomes tokens on device with no
    Python in the loop. ``"".join(piece_table[p] for p in pieces[:n]) == render_text(state, fmt)``.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import text_match

OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")


@chex.dataclass(frozen=True)
class EnvState:
    time: chex.Array  # int32 [] env steps taken in this episode


@chex.dataclass(frozen=True)
class EnvParams:
    max_steps_in_episode: chex.Array  # int32 [] truncation cap


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an expert would answer from a state (the warm-up's demonstrations)."""
    answers: list[str]                     # the expert's next answers, in order (texts between <answer> tags)
    reasoning: Callable[[list[str]], str]  # sentence about the state leading to the answers actually given


def backtrack(parent: dict, node) -> list[int]:
    """The actions leading from a BFS root to ``node`` (``parent[n] = (previous, action)``, root: None)."""
    actions = []
    while parent[node] is not None:
        node, act = parent[node]
        actions.append(act)
    return actions[::-1]


def cell_text(rc) -> str:
    """A grid cell as the experts' sentences name it: ``(row, col)``."""
    return f"({int(rc[0])}, {int(rc[1])})"


@functools.lru_cache(maxsize=8)
def _jitted_parse(env):
    return jax.jit(env.parse_action)


class AgentFacing:
    """Everything agent-facing about an environment, with the defaults of the optional parts.

    The rollout (system prompt, action parsing, batched stepping) and the warm-up (experts) talk to
    an environment only through these members; an environment overrides what it has of its own.
    """

    name: str = "env"
    action_names: tuple[str, ...] = ()
    instruction: str | None = None  # the task paragraph, when it does not depend on the format
    list_actions: bool | None = None  # None: list the names unless observations are free text
    parse_action: Callable | None = None  # free-text actions: (text uint8 [W], n) -> (action, valid bool)
    max_action_bytes: int | None = None  # W of parse_action (None: the reply's length)
    max_obs_tokens: int | None = None  # an observation's token bound, when the env knows it

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    # --- the system prompt ----------------------------------------------------------------
    def instruction_text(self, fmt: str, board_shape: tuple[int, int] | None, params=None) -> str:
        """The task paragraph for observation format ``fmt`` on a ``board_shape`` board."""
        if self.instruction is None:
            raise ValueError(f"environment {self.name!r} has no instruction; give it an `instruction` (or override "
                             "`instruction_text`), or set config.rollout.instruction")
        return self.instruction

    def lists_actions(self, fmt: str) -> bool:
        """Whether the system prompt lists ``action_names`` (never for free-text actions)."""
        if self.parse_action is not None:
            return False
        return fmt != "text" if self.list_actions is None else bool(self.list_actions)

    # --- actions --------------------------------------------------------------------------
    def random_action(self, key):
        """A uniformly random action (used to measure observation lengths)."""
        return jax.random.randint(key, (), 0, self.num_actions)

    def answer_action(self, text: str):
        """The action ``text`` parses to, as the rollout reads it (host arrays)."""
        if self.parse_action is None:
            return {n.lower(): i for i, n in enumerate(self.action_names)}[text.lower()]
        data = text.encode("utf-8")
        buf, _ = text_match.encode(text, int(self.max_action_bytes or max(len(data), 1)))
        action, _ = _jitted_parse(self)(jnp.asarray(buf), jnp.int32(len(data)))
        return action

    # --- a reward for the reasoning (optional) ---------------------------------------------
    def reasoning_reward(self, state, reasoning, n, params):
        """A reward for a reply's reasoning, given before its actions run (float32 []): ``reasoning``
        uint8 [W] is the reply after its forced opening (``<think>``), ``n`` its byte count, ``state``
        the state the reply answered. The base class gives none; an environment that grades what the
        reply says about its state overrides this (FrozenLake: ``description_reward``)."""
        return jnp.float32(0.0)

    # --- what the reasoning says about the state (optional) -----------------------------------
    def description_bytes(self, state):
        """The state's exact description as the expert's reasoning opens with it, built on device:
        ``(uint8 [W] zero-padded, int32 [] length)``. Environments whose expert describes what it sees
        override this (FrozenLake, Sokoban); ``describes_state`` and their ``reasoning_reward`` read it."""
        raise NotImplementedError(f"environment {self.name!r} has no state description")

    @classmethod
    def has_description(cls) -> bool:
        return cls.description_bytes is not AgentFacing.description_bytes

    def describes_state(self, state, reasoning, n):
        """bool []: the reasoning (``uint8 [W]``, ``n`` bytes, the reply after its forced opening) opens
        with the exact description of ``state`` (``description_bytes``) — the rollout logs the share of
        such turns (``describes_state``), which shows whether training keeps the reading of the state
        the warm-up taught or wears it away."""
        text, length = self.description_bytes(state)
        return text_match.starts_with(reasoning, n, text, length)

    def gives_reasoning_reward(self, params) -> bool:
        """Whether ``reasoning_reward`` can be non-zero under ``params``: the rollout skips the call (and its
        work in every turn) when not. Default: whether the class overrides it."""
        return type(self).reasoning_reward is not AgentFacing.reasoning_reward

    # --- the warm-up's expert -------------------------------------------------------------
    def expert(self, state, params) -> Plan:
        """The expert's answers from a host (NumPy) ``state``."""
        raise NotImplementedError(f"environment {self.name!r} has no expert for behaviour cloning: give it an "
                                  "`expert` method, or set warmup.steps=0 and warmup.single_turn_steps=0")

    @classmethod
    def has_expert(cls) -> bool:
        return cls.expert is not AgentFacing.expert

    def random_answer(self, state, rng: np.random.Generator) -> str:
        """A random answer of the right shape (default: one of the action names)."""
        if not self.action_names:
            raise ValueError(f"environment {self.name!r} has free-text actions: override random_answer")
        return self.action_names[int(rng.integers(len(self.action_names)))]

    # --- the episode batch (what the rollout calls) ---------------------------------------
    def reset_batch(self, keys, params):
        return jax.vmap(self.reset, in_axes=(0, None))(keys, params)

    def render_batch(self, state, params, fmt):
        return jax.vmap(lambda s: self.render_pieces(s, params, fmt))(state)

    def step_batch(self, keys, state, actions, params, do):
        """One step for the rows with ``do`` [B] (the others keep their state), no auto-reset:
        ``(state, reward [B], terminated [B], truncated [B], info)``."""
        _, nst, r, term, trunc, info = jax.vmap(self.step_env, in_axes=(0, 0, 0, None))(keys, state, actions, params)
        nst = jax.tree.map(lambda x, y: jnp.where(do.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), nst, state)
        return nst, r, term, trunc, info


class DescriptionReward:
    """For an environment with a state description (``description_bytes``) and a ``description_reward``
    param (ours, off by default): that reward for a turn whose reasoning opens with the exact
    description of the state it answered (``reasoning_reward``). Put before the base class:
    ``class FrozenLake(DescriptionReward, Environment)``."""

    def gives_reasoning_reward(self, params) -> bool:
        """False only for a concrete ``description_reward`` of 0 (the default: no description is built)."""
        bonus = params.description_reward
        return isinstance(bonus, jax.core.Tracer) or bool(np.any(np.asarray(bonus) != 0))

    def reasoning_reward(self, state, reasoning, n, params):
        """``description_reward`` when the reasoning (``uint8 [W]``, the reply after its forced opening;
        ``n`` bytes) opens with the state's exact description (``describes_state``), else 0.

        Ours, not the original's: a reward on what the reply says it sees, which grades the reading of
        a board whose episode fails either way, and holds it against outcome rewards that would wear
        it away (docs/experiments.md); with ``train_env`` it shapes training only, validation keeping
        RAGEN's rewards.
        """
        return jnp.where(self.describes_state(state, reasoning, n), params.description_reward, 0.0)


class Environment(AgentFacing, abc.ABC):
    """Base class. Subclasses implement ``reset_env``, ``step_env``, ``observation`` and the renders."""

    observation_formats: tuple[str, ...] = OBSERVATION_FORMATS

    # --- dynamics -------------------------------------------------------------------------
    @abc.abstractmethod
    def default_params(self) -> EnvParams:
        ...

    @abc.abstractmethod
    def reset_env(self, key: chex.PRNGKey, params: EnvParams) -> tuple[chex.Array, Any]:
        ...

    @abc.abstractmethod
    def step_env(self, key, state, action, params):
        """One step without auto-reset -> ``(obs, state, reward, terminated, truncated, info)``."""
        ...

    @abc.abstractmethod
    def observation(self, state, params) -> chex.Array:
        """Symbol grid ``int32 [rows, cols]`` of render codes (indices into ``symbols``)."""
        ...

    def reset(self, key: chex.PRNGKey, params: EnvParams | None = None):
        params = self.default_params() if params is None else params
        return self.reset_env(key, params)

    def step(self, key: chex.PRNGKey, state, action, params: EnvParams | None = None):
        """``step_env`` followed by an auto-reset of finished episodes (selected, not branched)."""
        params = self.default_params() if params is None else params
        key_step, key_reset = jax.random.split(key)
        obs, next_state, reward, terminated, truncated, info = self.step_env(key_step, state, action, params)
        obs_reset, state_reset = self.reset_env(key_reset, params)
        done = jnp.logical_or(terminated, truncated)
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_reset, next_state)
        obs = jnp.where(done, obs_reset, obs)
        return obs, next_state, reward, terminated, truncated, info

    # --- text -----------------------------------------------------------------------------
    @property
    def piece_table(self) -> tuple[str, ...]:
        """Static strings that ``render_pieces`` indexes into (host): those of the environment's
        ``render.PieceTable``, which it builds in its constructor as ``self._table``."""
        return self._table.pieces

    @abc.abstractmethod
    def render_pieces(self, state, params, fmt: str | None = None) -> tuple[chex.Array, chex.Array]:
        ...

    @abc.abstractmethod
    def render_text(self, state, fmt: str | None = None) -> str:
        ...

    def legend(self) -> str:
        """The symbol legend of the configured table, e.g. ``"#: wall, _: empty, ..."`` (default: none,
        for an environment whose text needs no symbols explained)."""
        return ""

    def check_format(self, fmt: str | None) -> str:
        fmt = self.observation_format if fmt is None else fmt
        if fmt not in self.observation_formats:
            raise ValueError(
                f"{self.name}: unknown observation_format {fmt!r}; choose one of {self.observation_formats}"
            )
        return fmt

    observation_format: str = "grid"


def tree_stack(trees: Sequence[Any]) -> Any:
    """Stack a list of pytrees along a new leading axis (for building batched reference states)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
