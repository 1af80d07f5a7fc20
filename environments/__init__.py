"""Pure-JAX environments for LLM agents (gymnax-style API). Standalone: depends on jax/chex/numpy only."""
from __future__ import annotations

import importlib

from environments.core import OBSERVATION_FORMATS, Environment, EnvParams, EnvState

# name -> "module:Class"; imported lazily so one env's import cost is not paid by the others.
REGISTRY = {
    "sokoban": "environments.sokoban:Sokoban",
    "frozen_lake": "environments.frozen_lake:FrozenLake",
    "bandit": "environments.bandit:Bandit",
}


def make(name: str, **kwargs) -> Environment:
    """Build a registered environment, e.g. ``make("sokoban", dim_room=(8, 8), num_boxes=2)``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["Environment", "EnvParams", "EnvState", "OBSERVATION_FORMATS", "REGISTRY", "make"]
