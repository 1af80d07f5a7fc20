"""ragen_jax's environments as cases for the peer benchmark (``env_peers.py --extra``).

``env_peers.py`` (in ``<repo>/../shared/bench``) imports this module by name and calls
``jax_cases(quick)``; each case runs through the same harness as the peers (jit + vmap, random
actions, auto-reset inside ``env.step``, fresh procedurally generated levels on every reset).
``benchmarks/envs.py`` sets up the import paths and runs everything in one invocation.
"""
from __future__ import annotations

from env_peers import JaxCase, case_from_gymnax_api

import environments

# (case name, registry name, constructor kwargs); the names are what envs.py looks up.
CASES = (
    ("ragen_jax Sokoban 6x6 1 box", "sokoban", {"dim_room": (6, 6), "num_boxes": 1}),
    ("ragen_jax Sokoban 10x10 3 box", "sokoban", {"dim_room": (10, 10), "num_boxes": 3}),
    ("ragen_jax FrozenLake 4x4 random maps", "frozen_lake", {"size": 4}),
)


def jax_cases(quick: bool) -> list[JaxCase]:
    cases = []
    for name, env_name, kwargs in CASES:
        try:
            env = environments.make(env_name, **kwargs)
        except Exception as e:  # an env still missing from the checkout is reported, not fatal
            print(f"{name} unavailable: {type(e).__name__}: {e}")
            continue
        cases.append(case_from_gymnax_api(name, env, env.default_params(), env.num_actions))
    return cases
