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

Optional members the rollout uses when present:
  * ``parse_action(text uint8 [W], n int32 []) -> (action pytree, valid bool [])`` with
    ``max_action_bytes = W``: free-text answers (Sudoku's placements, Countdown's equations)
    read on device by the env itself; ``action_names`` is then empty and an action is whatever
    ``parse_action`` returns (``step_env`` takes the same pytree);
  * ``random_action(key)``: a random action of that pytree shape (used to measure observation
    lengths; the default draws an index below ``num_actions``);
  * ``instruction``: the task paragraph of the system prompt; ``list_actions``: whether the system
    prompt lists ``action_names`` (default: not for ``"text"`` observations).

Text. The language model reads the state as text. Two renders exist and must agree exactly:
  * ``render_text(state, fmt)`` — host, NumPy, the original's strings (the reference);
  * ``render_pieces(state, params, fmt)`` — device: ``(pieces int32 [max_pieces], n int32)``, the
    text as a sequence of ids into the static string table ``env.piece_table``. The rollout's
    codec tokenises each table entry once, so an observation becomes tokens on device with no
    Python in the loop. ``"".join(piece_table[p] for p in pieces[:n]) == render_text(state, fmt)``.
"""
from __future__ import annotations

import abc
from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp

OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")


@chex.dataclass(frozen=True)
class EnvState:
    time: chex.Array  # int32 [] env steps taken in this episode


@chex.dataclass(frozen=True)
class EnvParams:
    max_steps_in_episode: chex.Array  # int32 [] truncation cap


class Environment(abc.ABC):
    """Base class. Subclasses implement ``reset_env``, ``step_env``, ``observation`` and the renders."""

    name: str = "env"
    action_names: tuple[str, ...] = ()
    observation_formats: tuple[str, ...] = OBSERVATION_FORMATS

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

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
    @abc.abstractmethod
    def piece_table(self) -> tuple[str, ...]:
        """Static strings that ``render_pieces`` indexes into (host)."""
        ...

    @abc.abstractmethod
    def render_pieces(self, state, params, fmt: str | None = None) -> tuple[chex.Array, chex.Array]:
        ...

    @abc.abstractmethod
    def render_text(self, state, fmt: str | None = None) -> str:
        ...

    @abc.abstractmethod
    def legend(self) -> str:
        """The symbol legend of the configured table, e.g. ``"#: wall, _: empty, ..."``."""
        ...

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
