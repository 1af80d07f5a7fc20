"""A custom gym-style Python environment in the jitted rollout (io_callback), against a plain loop.

The custom env is the pattern users follow: ``reset(seed) -> text``,
``step(action_text) -> (text, reward, done, info)``. Replies are scripted (``ForcedReplies``)
from a fixed seed; the reference loop steps fresh instances of the same class in Python.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout import prompts
from ragen_jax.config import RolloutConfig
from ragen_jax.rollout.loop import make_rollout
from ragen_jax.rollout.codec import decode
from ragen_jax.rollout.host_env import HostEnv
from tests.rollout.helpers import make_tokenizer
from tests.rollout.test_agent import ref_parse, scripted_replies, tiny_model


class Corridor:
    """Walk along a corridor of 5 cells to the exit; -0.1 per step, +1 on reaching the exit."""

    def reset(self, seed: int) -> str:
        self.pos = 0
        self.exit = 2 + seed % 3
        return self._text()

    def _text(self) -> str:
        return f"You are at cell {self.pos}. The exit is at cell {self.exit}."

    def step(self, action: str):
        old = self.pos
        self.pos = min(4, self.pos + 1) if action == "Forward" else max(0, self.pos - 1)
        done = self.pos == self.exit
        reward = 1.0 if done else -0.1
        return self._text(), reward, done, {"success": done, "action_is_effective": self.pos != old}


INSTRUCTION = "You are in a corridor. Reach the exit. Answer like <answer>Forward</answer>.\n"


def _corridor_rollout(env_cls, **rollout_kwargs):
    """(tokenizer, config, HostEnv of ``env_cls``, its compiled rollout, weights of a tiny model)."""
    tok = make_tokenizer("qwen")
    cfg = RolloutConfig(max_new_tokens=32, max_seq_len=1024, **rollout_kwargs)
    env = HostEnv(env_cls, tok, action_names=("Forward", "Back"), batch_size=cfg.batch_size,
                  max_obs_tokens=64, instruction=INSTRUCTION)
    graphdef, weights = tiny_model(tok)
    return tok, cfg, env, make_rollout(graphdef, env, env.default_params(), tok, cfg), weights


def test_host_env_rollout_matches_python_loop():
    tok, cfg, env, ro, weights = _corridor_rollout(Corridor, num_groups=3, group_size=2, max_turns=4,
                                                   max_actions_per_turn=2, max_actions_per_traj=5)
    rng = np.random.default_rng(4)
    forced, replies = scripted_replies(tok, env.action_names, rng, cfg.batch_size, cfg.max_turns,
                                       cfg.max_new_tokens, ro.framing.end_of_turn)
    key = jax.random.key(9)
    traj = ro(weights, key, forced)

    env_key, _ = jax.random.split(key)
    env_keys = jnp.repeat(jax.random.split(env_key, cfg.num_groups), cfg.group_size, axis=0)
    seeds = np.asarray(jax.random.key_data(env_keys))[:, -1]
    assert seeds[0] == seeds[1] and seeds[0] != seeds[2]  # same seed within a group
    for b in range(cfg.batch_size):
        e = Corridor()
        obs = e.reset(int(seeds[b]))
        users, assistants, rewards = [], [], []
        n_act, done, success, warn, prev = 0, False, False, False, None
        for t in range(cfg.max_turns):
            if done:
                break
            u = prompts.turn_block(t + 1, obs, cfg.max_actions_per_traj - n_act, warning=warn, enable_think=True,
                                   max_words=cfg.max_words)
            users.append(u if t == 0 else prompts.reward_message(prev) + u)
            full, plain, with_eot = replies[b][t]
            assistants.append("<think>" + (full[: -len(ro.framing.end_of_turn)] if with_eot else full))
            actions, penalty = ref_parse(("<think>" + plain).encode(), env.action_names, cfg.max_actions_per_turn)
            reward = 0.0
            for a in actions:
                obs, r, d, info = e.step(env.action_names[a])
                n_act += 1
                reward += r
                if d:
                    done, success = True, info["success"]
                    break
                if n_act >= cfg.max_actions_per_traj:
                    break
            done = done or n_act >= cfg.max_actions_per_traj
            rewards.append(reward + (cfg.format_penalty if penalty else 0.0))
            warn, prev = not actions, (reward if actions else None)
        text = ro.framing.render(ro.system_text, users, assistants)
        assert decode(tok, traj.tokens[b, : int(traj.lengths[b])]) == text, b
        np.testing.assert_allclose(np.asarray(traj.turn_rewards[b, : len(rewards)]), rewards, atol=1e-5)
        assert int(traj.num_turns[b]) == len(rewards)
        assert bool(traj.success[b]) == success
        assert int(traj.num_actions[b]) == n_act


class BrokenReward(Corridor):
    """A Corridor whose second step returns NaN (a bug users make: 0/0 in a reward formula)."""

    def reset(self, seed: int) -> str:
        self.n = 0
        return super().reset(seed)

    def step(self, action: str):
        text, reward, done, info = super().step(action)
        self.n += 1
        return text, (float("nan") if self.n == 2 else reward), done, info


def test_non_finite_host_reward_is_an_error_naming_env_and_step():
    import pytest

    tok, cfg, env, ro, weights = _corridor_rollout(BrokenReward, num_groups=1, group_size=2, max_turns=3,
                                                   max_actions_per_turn=1, max_actions_per_traj=3)
    ids = tok("back</think><answer>Back</answer>", add_special_tokens=False)["input_ids"]  # never exits
    toks = np.zeros((cfg.batch_size, cfg.max_turns, cfg.max_new_tokens), np.int32)
    toks[:, :, : len(ids)] = ids
    lens = np.full((cfg.batch_size, cfg.max_turns), len(ids), np.int32)
    from ragen_jax.rollout.carry import ForcedReplies

    with pytest.raises(Exception, match=r"HostEnv BrokenReward returned a non-finite reward nan at step 2 of row 0"):
        jax.block_until_ready(ro(weights, jax.random.key(0), ForcedReplies(tokens=jnp.asarray(toks),
                                                                           lengths=jnp.asarray(lens))))


class Echo:
    """Free-text actions: the observation repeats the last answer; 'stop' ends with reward 1."""

    def reset(self, seed):
        self.n = 0
        return f"Start {seed % 7}."

    def step(self, action):
        self.n += 1
        return f"You said: {action}", float(action == "stop"), action == "stop", {}


class Raises(Echo):
    def step(self, action):
        raise KeyError("no such room")


class NotText(Echo):
    def step(self, action):
        return 42, 0.0, False, {}


def _forced(tok, cfg, reply):
    from ragen_jax.rollout.carry import ForcedReplies

    ids = tok(reply, add_special_tokens=False)["input_ids"]
    toks = np.zeros((cfg.batch_size, cfg.max_turns, cfg.max_new_tokens), np.int32)
    toks[:, :, : len(ids)] = ids
    lens = np.full((cfg.batch_size, cfg.max_turns), len(ids), np.int32)
    return ForcedReplies(tokens=jnp.asarray(toks), lengths=jnp.asarray(lens))


def _text_rollout(env_cls, **kw):
    tok = make_tokenizer("qwen")
    cfg = RolloutConfig(max_new_tokens=40, max_seq_len=1024, num_groups=1, group_size=2, max_turns=2,
                        max_actions_per_turn=2, max_actions_per_traj=4, **kw)
    env = HostEnv(env_cls, tok, action_names=None, batch_size=cfg.batch_size, max_obs_tokens=64,
                  instruction="Say something.\n")
    graphdef, weights = tiny_model(tok)
    return tok, cfg, env, make_rollout(graphdef, env, env.default_params(), tok, cfg), weights


def test_free_text_actions_reach_the_host_env_as_written():
    tok, cfg, env, ro, weights = _text_rollout(Echo)
    traj = ro(weights, jax.random.key(0), _forced(tok, cfg, "ok</think><answer> search[who wrote Emma?] || stop </answer>"))
    text = decode(tok, np.asarray(traj.tokens[0])[np.asarray(traj.valid_mask[0])])
    assert "You said: search[who wrote Emma?]" not in text  # the episode ended on "stop" in the same turn
    assert np.asarray(traj.success).all() and np.allclose(np.asarray(traj.episode_return), 1.0)
    assert [e.n for e in env.envs[:2]] == [2, 2]  # both parts were stepped, in order
    assert "Your available actions" not in ro.system_text  # free text: no action list


def test_host_env_exceptions_and_non_text_name_the_env_row_and_step():
    import pytest

    for cls, pattern in ((Raises, r"HostEnv Raises raised KeyError at step 1 of row 0: 'no such room'"),
                         (NotText, r"HostEnv NotText.step\(\) at step 1 of row 0 returned int as the observation")):
        tok, cfg, env, ro, weights = _text_rollout(cls)
        with pytest.raises(Exception, match=pattern):
            jax.block_until_ready(ro(weights, jax.random.key(0), _forced(tok, cfg, "x</think><answer>hi</answer>")))


class Hangs(Echo):
    """A step that does not come back (bounded here: 60 s), as a stuck web page or simulator would."""

    def step(self, action):
        import time

        time.sleep(60)
        return super().step(action)


class BadInfo(Echo):
    def step(self, action):
        return "ok", 0.0, False, ["not", "a", "dict"]


def test_a_host_step_that_never_returns_fails_within_its_timeout():
    import time

    import pytest

    from ragen_jax.rollout import host_env

    tok = make_tokenizer("qwen")
    env = HostEnv(Hangs, tok, action_names=("a", "b"), batch_size=2, max_obs_tokens=64, step_timeout_s=1.0)
    env._host_reset(np.arange(2))
    start = time.time()
    with pytest.raises(TimeoutError, match=r"HostEnv Hangs did not return from step\(\) within 1 s at step 1 of "
                                           r"row 0; .*env.step_timeout_s"):
        env._host_step(np.zeros(2, np.int32), np.ones(2, bool))
    assert time.time() - start < 10
    assert isinstance(host_env.FAILURES[-1], TimeoutError)
    with pytest.raises(ValueError, match="step_timeout_s"):
        HostEnv(Hangs, tok, action_names=("a",), batch_size=1, step_timeout_s=0)


def test_a_non_dict_info_names_the_env_row_and_step():
    import pytest

    tok = make_tokenizer("qwen")
    env = HostEnv(BadInfo, tok, action_names=("a",), batch_size=1, max_obs_tokens=64)
    env._host_reset(np.arange(1))
    with pytest.raises(TypeError, match=r"HostEnv BadInfo.step\(\) at step 1 of row 0 returned info of type list"):
        env._host_step(np.zeros(1, np.int32), np.ones(1, bool))
