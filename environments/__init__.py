"""Pure-JAX environments for LLM agents (gymnax-style API), and Python text environments.

On device (``REGISTRY``; jax/chex/numpy only): sokoban, frozen_lake, bandit, game_2048, rubikscube,
sudoku, countdown. In Python (``HOST_REGISTRY``, run through ``ragen_jax.rollout.host_env.HostEnv``):
metamathqa, search, textworld, code (programs run against tests in a sandbox), lean (tactics checked by a Lean server), and ``webshop`` / ``alfworld`` adapters for a locally installed
copy of those environments. ``TAGS`` maps the original's ``config/envs.yaml`` tag names
(``SimpleSudoku``, ``SearchQAMock``, ...) to an environment and its settings.
"""
from __future__ import annotations

import importlib

from environments.core import OBSERVATION_FORMATS, Environment, EnvParams, EnvState

# name -> "module:Class" (or the class itself, see ``register``); imported lazily so one env's
# import cost is not paid by the others.
REGISTRY = {
    "sokoban": "environments.sokoban.env:Sokoban",
    "frozen_lake": "environments.frozen_lake.env:FrozenLake",
    "bandit": "environments.bandit.env:Bandit",
    "game_2048": "environments.game_2048.env:Game2048",
    "rubikscube": "environments.rubiks_cube.env:RubiksCube",
    "sudoku": "environments.sudoku.env:Sudoku",
    "countdown": "environments.countdown.env:Countdown",
}

# Text environments in Python: ``reset(seed) -> str``, ``step(action: str) -> (str, reward, done, info)``.
HOST_REGISTRY = {
    "metamathqa": "environments.text.math_qa:MathQA",
    "search": "environments.text.search_qa:SearchQA",
    "textworld": "environments.text.textworld_env:TextWorld",
    "webshop": "environments.text.adapters:WebShop",
    "alfworld": "environments.text.adapters:ALFWorld",
    "code": "environments.code.env:CodeEnv",
    "lean": "environments.code.lean:LeanEnv",
    # A task solved through tools (Search-R1 style: the BM25 search tool over the shipped QA data).
    "tool_search": "ragen_jax.tools.env:ToolSearchQA",
}

# The original's tag names (config/envs.yaml) -> (environment, its settings there).
TAGS = {
    "SimpleSokoban": ("sokoban", {"dim_room": (6, 6), "num_boxes": 1, "max_steps": 100}),
    "LargerSokoban": ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "max_steps": 100}),
    "CoordSokoban": ("sokoban", {"dim_room": (6, 6), "num_boxes": 1, "observation_format": "grid_coord"}),
    "FrozenLake": ("frozen_lake", {"success_rate": 0.8}),
    "CoordFrozenLake": ("frozen_lake", {"success_rate": 0.8, "observation_format": "grid_coord"}),
    "Bandit": ("bandit", {"split": "train"}),
    "BanditTest": ("bandit", {"split": "test"}),
    "SimpleSudoku": ("sudoku", {"grid_size": 9, "difficulty": "easy", "observation_format": "with_feedback",
                                "max_steps_in_episode": 81}),
    "MediumSudoku": ("sudoku", {"grid_size": 9, "difficulty": "medium", "observation_format": "with_feedback",
                                "max_steps_in_episode": 81}),
    "Countdown": ("countdown", {}),
    "MetamathQA": ("metamathqa", {}),
    "SearchQA": ("search", {"max_steps": 10, "max_search_results": 5}),
    "SearchQAMock": ("search", {"max_steps": 10, "max_search_results": 5, "mock": True}),
    "Alfworld": ("alfworld", {}),
    "WebShop": ("webshop", {}),
}
# game_2048 and rubikscube are tags of their own name; rubikscube's tag settings:
TAGS["rubikscube"] = ("rubikscube", {"scramble_depth": 1, "max_steps_in_episode": 20})


def resolve(name: str) -> tuple[str, dict]:
    """A registered name or tag -> ``(environment name, the tag's settings)``."""
    if name in TAGS:
        base, settings = TAGS[name]
        return base, dict(settings)
    if name in REGISTRY or name in HOST_REGISTRY:
        return name, {}
    raise ValueError(f"unknown environment {name!r}; registered: {sorted(REGISTRY)}, host: {sorted(HOST_REGISTRY)}, "
                     f"tags: {sorted(TAGS)}")


def register(name: str, target, *, host: bool = False) -> None:
    """Add an environment under ``name``: its class, or ``"module:Class"`` (imported when first used).

    An on-device environment subclasses ``environments.core.Environment``; ``host=True`` registers a
    Python text environment (``reset(seed) -> str``, ``step(text) -> (str, reward, done, info)``).
    After this, ``--config.env.name=NAME`` trains it like the built-in ones.
    """
    if name in TAGS:
        raise ValueError(f"{name!r} is one of the original's tag names; register the environment under another name")
    (HOST_REGISTRY if host else REGISTRY)[name] = target
    (REGISTRY if host else HOST_REGISTRY).pop(name, None)


def env_class(name: str):
    """The class registered under ``name`` (on device or host; a tag resolves to its environment)."""
    base, _ = resolve(name)
    target = REGISTRY.get(base) or HOST_REGISTRY[base]
    if not isinstance(target, str):
        return target
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def is_host(name: str) -> bool:
    return resolve(name)[0] in HOST_REGISTRY


def make(name: str, **kwargs) -> Environment:
    """Build a registered on-device environment, e.g. ``make("sokoban", dim_room=(8, 8), num_boxes=2)``.

    A tag's constructor settings apply unless ``kwargs`` override them; its ``default_params``
    settings are for ``make_with_params``.
    """
    base, settings = resolve(name)
    if base in HOST_REGISTRY:
        raise ValueError(f"{name!r} is a Python text environment: wrap it in ragen_jax.rollout.host_env.HostEnv "
                         "(the trainer does this from config.env.name)")
    return make_with_params(name, **kwargs)[0]


def make_with_params(name: str, **kwargs):
    """``(env, params)`` for a name or tag, keyword arguments routed to the constructor or to
    ``default_params`` by their names."""
    import inspect

    base, settings = resolve(name)
    cls = env_class(base)
    settings.update(kwargs)
    ctor = set(inspect.signature(cls.__init__).parameters) - {"self"}
    params = set(inspect.signature(cls.default_params).parameters) - {"self"}
    unknown = sorted(set(settings) - ctor - params)
    if unknown:
        raise ValueError(f"{base}: unknown setting(s) {unknown}; constructor {sorted(ctor)}, params {sorted(params)}")
    env = cls(**{k: v for k, v in settings.items() if k in ctor})
    return env, env.default_params(**{k: v for k, v in settings.items() if k in params})


__all__ = ["Environment", "EnvParams", "EnvState", "HOST_REGISTRY", "OBSERVATION_FORMATS", "REGISTRY", "TAGS",
           "env_class", "is_host", "make", "make_with_params", "register", "resolve"]
