"""Our environments as gymnax environments: gymnax's wrappers, spaces and PureJaxRL-style loops run on them.

    from environments.gymnax_adapter import to_gymnax
    from gymnax.wrappers import LogWrapper

    env = LogWrapper(to_gymnax("frozen_lake", size=4))
    params = env.default_params                      # a property, as gymnax has it
    obs, state = env.reset(key, params)              # obs: int32 [rows, cols] symbol grid
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

``GymnaxEnvironment`` subclasses ``gymnax.environments.environment.Environment`` around one of our
environments with discrete actions and an integer-code observation: FrozenLake and Sokoban (the
symbol grid), 2048 (``[4, 4]`` tile exponents), the 2×2 cube (``[6, 4]`` sticker colours). The dynamics are ours unchanged:
``step_env`` is our ``step_env``, and ``step`` auto-resets exactly as gymnax's does, with gymnax's
extra ``info`` keys (``terminated``, ``truncated``, ``final_observation``) beside ours
(``action_is_valid``, ``action_is_effective``, ``success``). Truncation is our env's own flag
(the step cap reached on a non-terminal step). Spaces: ``Discrete(num_actions)`` actions and a
``Box`` over the codes ``0 .. observation_codes - 1`` (``len(grid_lookup)`` for a symbol grid) of the
observation's shape.

gymnax is an optional dependency (``pip install -e ".[gymnax]"``); the rest of ``environments``
never imports it.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from gymnax.environments import environment as gymnax_env
from gymnax.environments import spaces

import environments
from environments.core import Environment


class GymnaxEnvironment(gymnax_env.Environment):
    """A gymnax ``Environment`` whose dynamics are those of ``env`` (one of ours)."""

    def __init__(self, env: Environment, params=None):
        codes = getattr(env, "observation_codes", None)
        if codes is None and hasattr(env, "grid_lookup"):
            codes = len(env.grid_lookup)
        if codes is None:
            raise ValueError(f"{env.name}: only environments with a discrete-code observation (frozen_lake, sokoban, "
                             "game_2048, rubikscube) have a gymnax observation space")
        self.env = env
        self._params = env.default_params() if params is None else params
        params = self._params
        obs, _ = jax.eval_shape(env.reset_env, jax.random.key(0), params)
        self._obs_shape = tuple(obs.shape)
        self._num_codes = int(codes)

    @property
    def name(self) -> str:
        return f"ragen_jax/{self.env.name}"

    @property
    def num_actions(self) -> int:
        return self.env.num_actions

    @property
    def default_params(self):
        """The params given at construction (our env's defaults when none were)."""
        return self._params

    def reset_env(self, key: jax.Array, params) -> tuple[jax.Array, Any]:
        return self.env.reset_env(key, params)

    def step_env(self, key: jax.Array, state, action, params):
        """Our ``step_env`` with gymnax's 5-tuple: ``truncated`` travels in ``info`` to ``step``."""
        obs, state, reward, terminated, truncated, info = self.env.step_env(key, state, action, params)
        return obs, state, reward, terminated, {**info, "truncated": truncated}

    @partial(jax.jit, static_argnames=("self",))
    def step(self, key: jax.Array, state, action, params=None):
        """gymnax's auto-resetting step, with our env's own truncation flag."""
        params = self.default_params if params is None else params
        key_step, key_reset = jax.random.split(key)
        obs_st, state_st, reward, terminated, info = self.step_env(key_step, state, action, params)
        truncated = info["truncated"]
        done = jnp.logical_or(terminated, truncated)
        obs_re, state_re = self.reset_env(key_reset, params)
        state = jax.tree.map(lambda r, s: jax.lax.select(done, r, s), state_re, state_st)
        obs = jax.lax.select(done, obs_re, obs_st)
        info = {**info, "terminated": terminated, "final_observation": obs_st}
        return obs, state, reward, terminated, truncated, info

    def is_truncated(self, state, params) -> jax.Array:
        return state.time >= params.max_steps_in_episode

    def action_space(self, params=None) -> spaces.Discrete:
        return spaces.Discrete(self.env.num_actions)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, self._num_codes - 1, self._obs_shape, jnp.int32)


def to_gymnax(name: str, params: dict | None = None, **env_kwargs) -> GymnaxEnvironment:
    """``environments.make(name, **env_kwargs)`` as a gymnax environment whose ``default_params`` are
    ``env.default_params(**params)``, e.g. ``to_gymnax("frozen_lake", size=4, params=dict(success_rate=1.0))``."""
    env = environments.make(name, **env_kwargs)
    return GymnaxEnvironment(env, env.default_params(**(params or {})))
