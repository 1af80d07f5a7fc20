"""ragen_jax's environments as cases for the peer benchmark (``env_peers.py --extra``).

``env_peers.py`` (in ``<repo>/../shared/bench``) imports this module by name and calls
``jax_cases(quick)``; each case runs through the same harness as the peers (jit + vmap, random
actions, auto-reset inside ``env.step``, fresh procedurally generated levels on every reset).
``benchmarks/envs.py`` sets up the import paths and runs everything in one invocation.
"""
from __future__ import annotations

from env_peers import JaxCase, case_from_gymnax_api

import environments

# (case name, registry name, constructor kwargs, batch sizes or None for the run's list); the
# names are what envs.py looks up. 10x10 with 3 boxes generates ~100-300 levels/s per core, so a
# batch of 8,192 fresh levels alone takes a minute per call on 2 cores: it stops at 1,024, the
# batch of the jumanji comparison.
CASES = (
    ("ragen_jax Sokoban 6x6 1 box", "sokoban", {"dim_room": (6, 6), "num_boxes": 1}, None),
    ("ragen_jax Sokoban 10x10 3 box", "sokoban", {"dim_room": (10, 10), "num_boxes": 3}, [1, 64, 1024]),
    ("ragen_jax FrozenLake 4x4 random maps", "frozen_lake", {"size": 4}, None),
)


def jax_cases(quick: bool) -> list[JaxCase]:
    cases = []
    for name, env_name, kwargs, batches in CASES:
        try:
            env = environments.make(env_name, **kwargs)
        except Exception as e:  # an env still missing from the checkout is reported, not fatal
            print(f"{name} unavailable: {type(e).__name__}: {e}")
            continue
        cases.append(case_from_gymnax_api(name, env, env.default_params(), env.num_actions, batches=batches))
    return cases
