"""The environment suite's throughput cases for the peer harness (``../shared/bench/env_peers.py``).

Every case is jit + vmap over B environments, random actions, auto-reset of finished episodes
inside the step (so a fresh puzzle is generated on device whenever one ends):
  * ours: 2048, Sudoku (9x9, easy: generated grid + blanks), the 2x2 cube (scramble 5), Countdown;
  * peers: jumanji ``Game2048-v1`` and ``Sudoku-v0`` (its bundled puzzle database) through
    ``jumanji.wrappers.VmapAutoResetWrapper``, pgx ``2048`` with an explicit re-init on termination.
Case names carry ``[suite]`` so ``benchmarks/env_suite.py`` can select them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from env_peers import JaxCase

import environments


def _ours(name: str, env_name: str, **kwargs) -> JaxCase:
    env, params = environments.make_with_params(env_name, **kwargs)
    sample = env.random_action

    def make(B: int):
        vreset = jax.vmap(env.reset, in_axes=(0, None))
        vstep = jax.vmap(env.step, in_axes=(0, 0, 0, None))

        def reset_b(key):
            obs, state = vreset(jax.random.split(key, B), params)
            return state, obs

        def step_b(key, state, actions):
            # Text-action envs draw their own random reading of an answer; actions[B] are ignored.
            k_act, k_step = jax.random.split(key)
            acts = actions if env.action_names else jax.vmap(sample)(jax.random.split(k_act, B))
            obs, state, reward, term, trunc, _ = vstep(jax.random.split(k_step, B), state, acts, params)
            return state, obs, reward, term | trunc

        return reset_b, step_b

    return JaxCase(name + " [suite]", make, max(env.num_actions, 1))


def _jumanji(name: str, env_id: str, num_actions: int, multi=None) -> JaxCase:
    import jumanji
    from jumanji.wrappers import VmapAutoResetWrapper

    def make(B: int):
        env = VmapAutoResetWrapper(jumanji.make(env_id))

        def reset_b(key):
            state, ts = env.reset(jax.random.split(key, B))
            return state, ts.observation

        def step_b(key, state, actions):
            if multi is not None:  # MultiDiscrete: one random index per dimension
                actions = jax.random.randint(key, (B, len(multi)), 0, jnp.asarray(multi))
            state, ts = env.step(state, actions)
            return state, ts.observation, ts.reward, ts.last()

        return reset_b, step_b

    return JaxCase(name + " [suite]", make, num_actions)


def _pgx_2048() -> JaxCase:
    import pgx

    env = pgx.make("2048")

    def make(B: int):
        vinit, vstep = jax.vmap(env.init), jax.vmap(env.step)

        def reset_b(key):
            state = vinit(jax.random.split(key, B))
            return state, state.observation

        def step_b(key, state, actions):
            k_step, k_init = jax.random.split(key)
            # pgx's 2048 treats an illegal move as a loss (terminated): random actions play as ours do.
            state = vstep(state, actions, jax.random.split(k_step, B))
            done = state.terminated | state.truncated
            fresh = vinit(jax.random.split(k_init, B))
            state = jax.tree.map(lambda f, s: jnp.where(done.reshape((-1,) + (1,) * (s.ndim - 1)), f, s), fresh, state)
            return state, state.observation, state.rewards[:, 0], done

        return reset_b, step_b

    return JaxCase("pgx 2048 [suite]", make, 4)


def jax_cases(quick: bool) -> list[JaxCase]:
    cases = [
        _ours("ragen_jax 2048", "game_2048"),
        _ours("ragen_jax Sudoku 9x9 easy", "SimpleSudoku"),
        _ours("ragen_jax Rubik's cube 2x2 scramble 5", "rubikscube", scramble_depth=5),
        _ours("ragen_jax Countdown 3-4 numbers", "countdown"),
    ]
    for make_case in (lambda: _jumanji("jumanji Game2048-v1", "Game2048-v1", 4),
                      lambda: _jumanji("jumanji Sudoku-v0", "Sudoku-v0", 729, multi=(9, 9, 9)),
                      _pgx_2048):
        try:
            cases.append(make_case())
        except ImportError as e:  # the bench extra installs them
            print(f"peer unavailable: {e}")
    return cases
