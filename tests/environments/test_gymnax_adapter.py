"""Our envs in gymnax's ecosystem: the adapter against our own dynamics, gymnax's wrappers, and a
PureJaxRL-style PPO loop that learns FrozenLake from the symbol grid (and runs on Sokoban).

Seeds are fixed (``jax.random.key(0)``), so every run of this file trains the same networks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gymnax.environments import environment as gymnax_env  # the test extra installs gymnax
from gymnax.environments import spaces
from gymnax.wrappers import FlattenObservationWrapper, LogWrapper

import environments
from environments.gymnax_adapter import GymnaxEnvironment, to_gymnax


def test_adapter_is_a_gymnax_environment_with_our_dynamics():
    ours = environments.make("frozen_lake", size=4)
    env = GymnaxEnvironment(ours)
    assert isinstance(env, gymnax_env.Environment)
    params = env.default_params
    assert isinstance(env.action_space(params), spaces.Discrete) and env.action_space(params).n == 4
    space = env.observation_space(params)
    assert isinstance(space, spaces.Box) and space.shape == (4, 4) and space.high == 5
    key = jax.random.key(3)
    obs, state = env.reset(key, params)
    obs_ref, state_ref = ours.reset_env(key, params)
    np.testing.assert_array_equal(obs, obs_ref)
    assert bool(space.contains(obs))
    # Step by step against our step_env (no reset needed until the episode ends).
    actions = np.random.default_rng(0).integers(0, 4, size=12)
    for i, a in enumerate(actions):
        k = jax.random.fold_in(key, i)
        obs, state_next, reward, terminated, truncated, info = env.step(k, state, int(a), params)
        k_step, _ = jax.random.split(k)
        obs_r, state_r, reward_r, term_r, trunc_r, info_r = ours.step_env(k_step, state_ref, int(a), params)
        assert float(reward) == float(reward_r) and bool(terminated) == bool(term_r)
        assert bool(truncated) == bool(trunc_r)
        np.testing.assert_array_equal(info["final_observation"], obs_r)
        assert bool(info["success"]) == bool(info_r["success"])
        if bool(term_r) or bool(trunc_r):
            break  # the adapter auto-reset; our reference has no reset to compare with
        np.testing.assert_array_equal(obs, obs_r)
        state, state_ref = state_next, state_r


def test_truncation_is_our_step_cap():
    env = to_gymnax("frozen_lake", size=4)
    params = env.env.default_params(max_steps_in_episode=2)
    obs, state = env.reset(jax.random.key(0), params)
    flags = []
    for i in range(2):
        obs, state, reward, terminated, truncated, info = env.step(jax.random.key(i), state, 0, params)
        flags.append((bool(terminated), bool(truncated)))
        if flags[-1] != (False, False):
            break
    # Moving Left from the start either ends in a hole/goal or hits the cap at step 2.
    assert flags[-1][0] or flags[-1] == (False, True)


@pytest.mark.parametrize("name, shape, high, actions", [("sokoban", (6, 6), 6, 4), ("game_2048", (4, 4), 17, 4),
                                                       ("rubikscube", (6, 4), 5, 12)])
def test_every_discrete_device_env_steps_as_ours(name, shape, high, actions):
    """The adapter's step against our ``step_env`` on random actions, and the spaces it declares."""
    env = to_gymnax(name)
    ours, params = env.env, env.default_params
    assert env.action_space(params).n == actions == ours.num_actions
    space = env.observation_space(params)
    assert space.shape == shape and space.high == high
    key = jax.random.key(5)
    obs, state = env.reset(key, params)
    obs_ref, state_ref = ours.reset_env(key, params)
    np.testing.assert_array_equal(obs, obs_ref)
    for i, a in enumerate(np.random.default_rng(1).integers(0, actions, size=20)):
        k = jax.random.fold_in(key, i)
        obs, state_next, reward, terminated, truncated, info = env.step(k, state, int(a), params)
        obs_r, state_r, reward_r, term_r, trunc_r, info_r = ours.step_env(jax.random.split(k)[0], state_ref, int(a),
                                                                          params)
        # jitted (the adapter) against eager (ours): 2048's log2 reward may differ in the last bit
        assert float(reward) == pytest.approx(float(reward_r), rel=1e-6) and bool(terminated) == bool(term_r)
        assert bool(truncated) == bool(trunc_r) and bool(space.contains(obs))
        np.testing.assert_array_equal(info["final_observation"], obs_r)
        if bool(term_r) or bool(trunc_r):
            break
        np.testing.assert_array_equal(obs, obs_r)
        state, state_ref = state_next, state_r


@pytest.mark.parametrize("name, kwargs, params", [
    ("frozen_lake", dict(size=4), {}), ("sokoban", dict(dim_room=(6, 6)), {}),
    # A 20-step cap, so that random play ends episodes (a 2048 game would run on for long).
    ("game_2048", {}, dict(max_steps_in_episode=20)), ("rubikscube", {}, {})])
def test_gymnax_wrappers_run_vmapped(name, kwargs, params):
    env = LogWrapper(FlattenObservationWrapper(to_gymnax(name, params=params, **kwargs)))
    params = env.default_params
    keys = jax.random.split(jax.random.key(1), 8)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    assert obs.shape == (8, int(np.prod(env._env._env._obs_shape)))

    def step(carry, key):
        state = carry
        k_act, k_step = jax.random.split(key)
        action = jax.vmap(env.action_space(params).sample)(jax.random.split(k_act, 8))
        obs, state, reward, terminated, truncated, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(k_step, 8), state, action, params)
        return state, (reward, info["returned_episode"])

    state, (rewards, returned) = jax.lax.scan(step, state, jax.random.split(jax.random.key(2), 40))
    assert rewards.shape == (40, 8) and bool(jnp.all(jnp.isfinite(rewards)))
    assert bool(returned.any())  # episodes end and the LogWrapper records them


# ---- a PureJaxRL-style PPO (one jitted function: rollout scan, GAE scan, epochs × mini-batches) ----
def _mlp_init(key, sizes):
    params = []
    for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (m, n)) * jnp.sqrt(2.0 / m), "b": jnp.zeros(n)})
    return params


def _mlp(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def make_ppo(env, num_codes, num_envs=64, num_steps=16, num_updates=150, epochs=4, minibatches=4,
             lr=2.5e-3, gamma=0.95, lam=0.9, clip=0.2, ent_coef=0.01):
    params_env = env.default_params
    num_actions = env.action_space(params_env).n

    def features(obs):  # one-hot of each cell's render code, flattened
        return jax.nn.one_hot(obs, num_codes).reshape(*obs.shape[:-2], -1)

    def policy(net, obs):
        x = features(obs)
        return _mlp(net["pi"], x), _mlp(net["v"], x)[..., 0]

    def train(key):
        k_pi, k_v, k_env, key = jax.random.split(key, 4)
        obs_dim = int(np.prod(env.observation_space(params_env).shape)) * num_codes
        net = {"pi": _mlp_init(k_pi, [obs_dim, 64, num_actions]), "v": _mlp_init(k_v, [obs_dim, 64, 1])}
        net["pi"][-1]["w"] = net["pi"][-1]["w"] * 0.01
        tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(lr))
        opt_state = tx.init(net)
        obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_env, num_envs), params_env)

        def env_step(carry, key):
            net, obs, state = carry
            k_a, k_s = jax.random.split(key)
            logits, value = policy(net, obs)
            action = jax.random.categorical(k_a, logits)
            logp = jax.nn.log_softmax(logits)[jnp.arange(num_envs), action]
            obs2, state, reward, term, trunc, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(k_s, num_envs), state, action, params_env)
            tr = dict(obs=obs, action=action, logp=logp, value=value, reward=reward, done=term | trunc,
                      term=term, returned=info["returned_episode"], ep_return=info["returned_episode_returns"])
            return (net, obs2, state), tr

        def gae(tr, last_value):
            def back(carry, t):
                adv, next_value = carry
                delta = t["reward"] + gamma * next_value * (1 - t["term"]) - t["value"]
                adv = delta + gamma * lam * (1 - t["done"]) * adv
                return (adv, t["value"]), adv

            _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), tr, reverse=True)
            return adv, adv + tr["value"]

        def loss_fn(net, batch):
            logits, value = policy(net, batch["obs"])
            logp_all = jax.nn.log_softmax(logits)
            logp = jnp.take_along_axis(logp_all, batch["action"][:, None], axis=1)[:, 0]
            ratio = jnp.exp(logp - batch["logp"])
            adv = (batch["adv"] - batch["adv"].mean()) / (batch["adv"].std() + 1e-8)
            pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv).mean()
            v_loss = 0.5 * ((value - batch["target"]) ** 2).mean()
            entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
            return pg + 0.5 * v_loss - ent_coef * entropy

        def update(carry, key):
            net, opt_state, obs, state = carry
            k_roll, k_perm = jax.random.split(key)
            (net, obs, state), tr = jax.lax.scan(env_step, (net, obs, state), jax.random.split(k_roll, num_steps))
            adv, target = gae(tr, policy(net, obs)[1])
            flat = jax.tree.map(lambda x: x.reshape(num_steps * num_envs, *x.shape[2:]),
                                dict(obs=tr["obs"], action=tr["action"], logp=tr["logp"], adv=adv, target=target))

            def epoch(carry, key):
                net, opt_state = carry
                perm = jax.random.permutation(key, num_steps * num_envs).reshape(minibatches, -1)

                def minibatch(carry, idx):
                    net, opt_state = carry
                    grads = jax.grad(loss_fn)(net, jax.tree.map(lambda x: x[idx], flat))
                    updates, opt_state = tx.update(grads, opt_state, net)
                    return (optax.apply_updates(net, updates), opt_state), None

                return jax.lax.scan(minibatch, (net, opt_state), perm)[0], None

            (net, opt_state), _ = jax.lax.scan(epoch, (net, opt_state), jax.random.split(k_perm, epochs))
            finished = tr["returned"].sum()
            mean_return = jnp.where(finished > 0, (tr["ep_return"] * tr["returned"]).sum() / jnp.maximum(finished, 1),
                                    jnp.nan)
            return (net, opt_state, obs, state), mean_return

        _, returns = jax.lax.scan(update, (net, opt_state, obs, state), jax.random.split(key, num_updates))
        return returns  # [num_updates] mean return of the episodes finished during each update

    return jax.jit(train)


def _random_policy_success(env, num_envs=64, num_steps=400):
    """Mean return (= success rate) of the episodes a uniform random policy finishes: the baseline."""
    params = env.default_params
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(jax.random.key(7), num_envs), params)

    def step(state, key):
        k_a, k_s = jax.random.split(key)
        action = jax.random.randint(k_a, (num_envs,), 0, env.action_space(params).n)
        _, state, _, _, _, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(k_s, num_envs), state, action, params)
        return state, (info["returned_episode"], info["returned_episode_returns"])

    _, (done, ret) = jax.lax.scan(step, state, jax.random.split(jax.random.key(8), num_steps))
    return float((ret * done).sum() / done.sum())


def test_ppo_learns_frozen_lake_from_the_symbol_grid():
    """Random maps every episode (25% holes), deterministic ice: success needs reading the board.
    150 PPO updates (64 envs × 16 steps each) take the success rate far above a random policy's."""
    env = LogWrapper(to_gymnax("frozen_lake", size=4, params=dict(p=0.75, success_rate=1.0)))
    baseline = _random_policy_success(env)
    returns = np.asarray(make_ppo(env, num_codes=6)(jax.random.key(0)))
    late = np.nanmean(returns[-20:])
    assert 0.05 < baseline < 0.45, baseline
    assert late > 0.7 and late > baseline + 0.35, (baseline, late, returns[::10])


def test_ppo_runs_on_sokoban():
    env = LogWrapper(to_gymnax("sokoban", dim_room=(6, 6), num_boxes=1))
    returns = np.asarray(make_ppo(env, num_codes=7, num_envs=16, num_steps=8, num_updates=3, epochs=1)(
        jax.random.key(0)))
    assert returns.shape == (3,) and np.all(np.isfinite(returns[~np.isnan(returns)]))
