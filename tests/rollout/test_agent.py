"""The on-device agent loop against a pure-Python reference loop, and sampler log-prob parity.

The reference loop below re-implements RAGEN's agent loop in plain Python: host
text renders (``env.render_text``), the prompt functions, the chat template, a regex parser on the
decoded reply and single, un-batched env steps. A scripted policy (``ForcedReplies``) feeds both
loops the same replies. All keys and replies come from fixed seeds.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import environments
from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.rollout import prompts
from ragen_jax.config import RolloutConfig
from ragen_jax.rollout.carry import ForcedReplies
from ragen_jax.rollout.loop import make_rollout, validation_keys
from ragen_jax.rollout.codec import decode
from tests.rollout.helpers import make_tokenizer

THINK_RE = re.compile(rb"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)


def tiny_model(tok, seed=0):
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=4096)
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)))


def ref_parse(text: bytes, names, max_actions):
    m = THINK_RE.search(text)
    if m is None:
        return [], True
    answer = m.group(2)
    for s in ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"):
        answer = answer.replace(s.encode(), b"")
    parts = [a.strip() for a in answer.strip().split(b"||") if a.strip()][:max_actions]
    lookup = {n.lower().encode(): i for i, n in enumerate(names)}
    valid = [lookup[p.lower()] for p in parts if p.lower() in lookup]
    return valid, (len(valid) != len(parts) or not valid)


def reference_episode(env, params, key, replies, cfg: RolloutConfig, framing, system, fmt):
    """One episode in plain Python. ``replies``: per turn (full_text, text_without_specials, eot)."""
    _, state = env.reset(key, params)
    users, assistants, rewards, penalties, boards = [], [], [], [], []
    num_actions, done, success, warn, prev = 0, False, False, False, None
    for t in range(cfg.max_turns):
        if done:
            break
        boards.append(env.render_text(state, fmt))
        u = prompts.turn_block(t + 1, env.render_text(state, fmt),
                               cfg.max_actions_per_traj - num_actions, warning=warn, enable_think=True,
                               max_words=cfg.max_words)
        if t > 0:
            u = prompts.reward_message(prev) + u
        users.append(u)
        full, plain, _ = replies[t]
        assistants.append("<think>" + full)
        actions, penalty = ref_parse(("<think>" + plain).encode(), env.action_names, cfg.max_actions_per_turn)
        reward = 0.0
        for a in actions:
            if num_actions >= cfg.max_actions_per_traj:
                break
            k = jax.random.fold_in(key, num_actions + 1)
            _, state, r, term, trunc, info = env.step_env(k, state, a, params)
            num_actions += 1
            reward += float(r)
            if bool(term) or bool(trunc):
                done = True
                success = bool(info["success"]) and bool(term)
                break
        if num_actions >= cfg.max_actions_per_traj:
            done = True
        rewards.append(reward + (cfg.format_penalty if penalty else 0.0))
        penalties.append(cfg.format_penalty if penalty else 0.0)
        warn = not actions
        prev = reward if actions else None
    # The transcript's assistant contents exclude a sampled end-of-turn token (it is the close).
    eot = framing.end_of_turn
    contents = [a[: -len(eot)] if a.endswith(eot) else a for a in assistants]
    text = framing.render(system, users, contents)
    return dict(text=text, rewards=rewards, penalties=penalties, success=success, num_actions=num_actions,
                boards=boards)


def scripted_replies(tok, names, rng, batch, turns, width, eot):
    """Random replies from templates covering valid, invalid, unparsable and over-long answers."""
    def pick():
        return names[rng.integers(len(names))]

    templates = [
        lambda: f" go </think><answer>{pick()} || {pick()}</answer>",
        lambda: f" hm </think> <answer> {pick().lower()} </answer>",
        lambda: f"</think><answer>Jump || {pick()}</answer>",
        lambda: " no tags at all",
        lambda: f"</think><answer>{pick()}||{pick()}||{pick()}</answer>",
        lambda: f"x</think>\n<answer>{pick().upper()}</answer> trailing",
    ]
    toks = np.zeros((batch, turns, width), np.int32)
    lens = np.zeros((batch, turns), np.int32)
    replies = []
    for b in range(batch):
        row = []
        for t in range(turns):
            text = templates[rng.integers(len(templates))]()
            with_eot = bool(rng.integers(2))
            full = text + (eot if with_eot else "")
            ids = tok(full, add_special_tokens=False)["input_ids"]
            assert len(ids) <= width
            toks[b, t, : len(ids)] = ids
            lens[b, t] = len(ids)
            row.append((full, text, with_eot))
        replies.append(row)
    return ForcedReplies(tokens=jnp.asarray(toks), lengths=jnp.asarray(lens)), replies


@pytest.mark.parametrize("env_name,env_kwargs,params_kwargs", [
    ("frozen_lake", {}, {}),
    ("sokoban", {}, {}),  # the default env of base.py: its agent loop runs in the default suite
])
def test_scripted_rollout_matches_reference_loop(env_name, env_kwargs, params_kwargs):
    tok = make_tokenizer("qwen")
    env = environments.make(env_name, **env_kwargs)
    params = env.default_params(**params_kwargs)
    cfg = RolloutConfig(num_groups=3, group_size=2, max_turns=4, max_actions_per_turn=2, max_actions_per_traj=5,
                        max_new_tokens=32, max_seq_len=1024, max_obs_tokens=96)
    graphdef, weights = tiny_model(tok)
    ro = make_rollout(graphdef, env, params, tok, cfg)
    rng = np.random.default_rng(11)
    forced, replies = scripted_replies(tok, env.action_names, rng, cfg.batch_size, cfg.max_turns, cfg.max_new_tokens,
                                       ro.framing.end_of_turn)
    key = jax.random.key(5)
    traj = ro(weights, key, forced)

    env_key, _ = jax.random.split(key)
    env_keys = jnp.repeat(jax.random.split(env_key, cfg.num_groups), cfg.group_size, axis=0)
    anchors = {}  # GiGPO's anchor states: equal boards hash equal, different boards differently
    observed = {}  # and the observations recorded for similarity grouping: one piece sequence per board
    for b in range(cfg.batch_size):
        ref = reference_episode(env, params, env_keys[b], replies[b], cfg, ro.framing, ro.system_text, ro.fmt)
        for t, board in enumerate(ref["boards"]):
            anchors.setdefault(board, set()).add(int(traj.turn_state_hash[b, t]))
            seen = np.asarray(traj.turn_observation[b, t, :int(traj.turn_observation_len[b, t])])
            observed.setdefault(board, set()).add(tuple(seen.tolist()))
        assert not np.asarray(traj.turn_reply_cut[b]).any()  # a scripted reply counts as stopped
        n = int(traj.lengths[b])
        assert decode(tok, traj.tokens[b, :n]) == ref["text"], b
        k = len(ref["rewards"])
        assert int(traj.num_turns[b]) == k
        np.testing.assert_array_equal(np.asarray(traj.turn_mask[b]), np.arange(cfg.max_turns) < k)
        np.testing.assert_allclose(np.asarray(traj.turn_rewards[b, :k]), ref["rewards"], atol=1e-5)
        np.testing.assert_allclose(np.asarray(traj.turn_format_penalty[b, :k]), ref["penalties"], atol=1e-6)
        assert bool(traj.success[b]) == ref["success"]
        assert int(traj.num_actions[b]) == ref["num_actions"]
        np.testing.assert_allclose(float(traj.episode_return[b]), sum(ref["rewards"]), atol=1e-5)
        # loss mask = exactly the scripted reply tokens, in order
        sampled = np.asarray(traj.tokens[b])[np.asarray(traj.loss_mask[b])]
        script = np.concatenate([np.asarray(forced.tokens[b, t, : forced.lengths[b, t]]) for t in range(k)])
        np.testing.assert_array_equal(sampled, script)
        # each turn's reward sits on its last sampled token
        for t in range(k):
            last = int(traj.turn_last_token[b, t])
            assert traj.loss_mask[b, last] and not traj.loss_mask[b, last + 1]
            assert float(traj.token_rewards[b, last]) == pytest.approx(ref["rewards"][t], abs=1e-5)
        # MI spans: prompt_end right after the forced "<think>"; reasoning excludes the tags
        for t in range(k):
            pe = int(traj.prompt_end[b, t])
            assert decode(tok, traj.tokens[b, :pe]).endswith("<think>")
            full, plain, _ = replies[b][t]
            rs, re_ = int(traj.reasoning_start[b, t]), int(traj.reasoning_end[b, t])
            assert rs == pe
            reasoning = decode(tok, traj.tokens[b, rs:re_])
            if "</think>" in plain and THINK_RE.search(("<think>" + plain).encode()):
                # token granularity: every token wholly inside the thought, and the next one
                # already holds the start of "</think>"
                thought = plain[: plain.index("</think>")]
                assert thought.startswith(reasoning), (reasoning, plain)
                assert not thought.startswith(decode(tok, traj.tokens[b, rs:re_ + 1])), (reasoning, plain)
            else:
                # A reply that does not parse has no reasoning: the MI proxy leaves the turn out
                # (as the original does) instead of taking the whole reply as Z.
                assert re_ == rs, (reasoning, plain)
    assert not bool(jnp.any(traj.truncated))
    np.testing.assert_array_equal(np.asarray(traj.group_ids), np.arange(cfg.batch_size) // cfg.group_size)
    assert all(len(h) == 1 for h in anchors.values()), anchors
    assert len({next(iter(h)) for h in anchors.values()}) == len(anchors)
    assert all(len(o) == 1 for o in observed.values()) and len({next(iter(o)) for o in observed.values()}) == len(observed)
    assert any(np.sum(np.asarray(traj.turn_mask), 1) > 1) and len(anchors) > cfg.num_groups


def _full_forward_logprobs(graphdef, weights, tokens):
    model = nnx.merge(graphdef, weights)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = model(tokens, positions)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]  # [B, L-1], entry t-1 scores token t


def test_sampler_logprobs_equal_full_forward_and_determinism():
    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    params = env.default_params()
    cfg = RolloutConfig(num_groups=2, group_size=2, max_turns=3, max_new_tokens=16, max_seq_len=768,
                        max_obs_tokens=64)
    graphdef, weights = tiny_model(tok, seed=3)
    ro = make_rollout(graphdef, env, params, tok, cfg)
    traj = ro(weights, jax.random.key(1))
    assert int(jnp.sum(traj.num_turns)) > cfg.batch_size  # several turns appended to the cache
    full = _full_forward_logprobs(graphdef, weights, traj.tokens)
    mask = np.asarray(traj.loss_mask[:, 1:])
    np.testing.assert_allclose(np.asarray(traj.sampler_logprobs[:, 1:])[mask], np.asarray(full)[mask], atol=1e-4)

    again = ro(weights, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(traj.tokens))
    other = ro(weights, jax.random.key(2))
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(traj.tokens))


def test_greedy_baseline_is_the_return_of_a_greedy_episode_per_group():
    """ReMax's baseline, played inside the rollout program: every row of a group gets the return of
    one temperature-0 episode from the group's start state — what a separate greedy rollout of those
    start states returns — and the sampled episodes are the ones the rollout plays without it."""
    import dataclasses

    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    params = env.default_params()
    cfg = RolloutConfig(num_groups=3, group_size=2, max_turns=3, max_new_tokens=16, max_seq_len=768,
                        max_obs_tokens=64, greedy_baseline=True)
    graphdef, weights = tiny_model(tok, seed=3)
    traj = make_rollout(graphdef, env, params, tok, cfg)(weights, jax.random.key(1))
    plain = make_rollout(graphdef, env, params, tok, dataclasses.replace(cfg, greedy_baseline=False))
    np.testing.assert_array_equal(np.asarray(plain(weights, jax.random.key(1)).tokens), np.asarray(traj.tokens))
    greedy = make_rollout(graphdef, env, params, tok, dataclasses.replace(
        cfg, greedy_baseline=False, temperature=0.0, num_groups=3, group_size=1))
    env_key, _ = jax.random.split(jax.random.key(1))
    ref = greedy.run(weights, jax.random.split(env_key, cfg.num_groups), jax.random.key(9))
    np.testing.assert_allclose(np.asarray(traj.reward_baseline),
                               np.repeat(np.asarray(ref.episode_return), cfg.group_size), atol=1e-6)


def test_validation_keys_are_fixed_and_distinct():
    a, b = validation_keys(8), validation_keys(8)
    assert np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert len({tuple(np.asarray(k)) for k in jax.random.key_data(a)}) == 8


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="context_mode"):
        RolloutConfig(context_mode="window")
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=0)


@pytest.mark.slow
def test_batch_64_by_5_turns_on_cpu():
    tok = make_tokenizer("qwen")
    env = environments.make("sokoban")
    cfg = RolloutConfig(num_groups=16, group_size=4, max_turns=5, max_new_tokens=24, max_seq_len=1280)
    graphdef, weights = tiny_model(tok)
    ro = make_rollout(graphdef, env, env.default_params(), tok, cfg)
    traj = ro(weights, jax.random.key(0))
    assert traj.tokens.shape[0] == 64
    assert int(jnp.max(traj.num_turns)) == 5
    assert bool(jnp.all(traj.lengths <= cfg.max_seq_len))


@pytest.mark.parametrize("window", [1, 2])
def test_limited_window_logprobs_equal_forward_over_window(window):
    """``limited`` mode: turn t's sampled log-probs equal one forward over preamble + the last
    ``context_window`` turns (the context ``context_start`` describes), re-positioned from 0; the
    per-turn rows (``turn_rows``) are exactly those contexts."""
    from ragen_jax.rollout.turn_rows import turn_rows

    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    params = env.default_params(success_rate=1.0)
    cfg = RolloutConfig(num_groups=2, group_size=1, max_turns=3, max_new_tokens=12, max_seq_len=768,
                        max_obs_tokens=64, context_mode="limited", context_window=window)
    graphdef, weights = tiny_model(tok, seed=5)
    ro = make_rollout(graphdef, env, params, tok, cfg)
    assert ro.cache_len < cfg.max_seq_len
    traj = ro(weights, jax.random.key(4))
    p0 = len(ro.codec.preamble_ids)
    rows = turn_rows(traj, p0, ro.cache_len)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    model = nnx.merge(graphdef, weights)
    checked = 0
    for b in range(cfg.batch_size):
        for t in range(cfg.max_turns):
            r = b * cfg.max_turns + t
            if not traj.turn_mask[b, t]:
                assert not bool(jnp.any(rows.view.loss_mask[r]))
                continue
            cs = int(traj.context_start[b, t])
            end = int(traj.turn_last_token[b, t]) + 1
            ctx = np.concatenate([np.asarray(traj.tokens[b, :p0]), np.asarray(traj.tokens[b, cs:end])])
            if t >= window:
                assert cs > int(traj.prompt_end[b, t - window])  # turn t - window has left the window
            # The context opens with the preamble and then a user message: one message per turn kept.
            opened = int(np.sum(ctx[p0:] == im_start))
            assert opened == 2 * min(t + 1, window) - 1
            row_len = int(jnp.sum(rows.view.valid_mask[r]))
            assert row_len == len(ctx) <= ro.cache_len
            np.testing.assert_array_equal(np.asarray(rows.view.tokens[r, :row_len]), ctx)
            logits, _ = model(jnp.asarray(ctx)[None], jnp.arange(len(ctx))[None])
            logp = np.asarray(jax.nn.log_softmax(logits[0, :-1], -1))
            sampled = np.nonzero(np.asarray(traj.loss_mask[b]) & (np.asarray(traj.turn_ids[b]) == t))[0]
            np.testing.assert_array_equal(np.nonzero(np.asarray(rows.view.loss_mask[r]))[0], sampled - cs + p0)
            for i in sampled:
                j = i - cs + p0  # index of transcript token i inside ctx
                np.testing.assert_allclose(logp[j - 1, ctx[j]], float(traj.sampler_logprobs[b, i]), atol=1e-4)
                checked += 1
            # Reasoning spans and the prompt end move into row coordinates with the tokens.
            for name in ("prompt_end", "reasoning_start", "reasoning_end"):
                assert int(getattr(rows.view, name)[r, 0]) == int(getattr(traj, name)[b, t]) - cs + p0
    assert checked > 0
    # Own tokens go back to where they came from.
    back = rows.scatter(rows.gather(traj.sampler_logprobs), traj.sampler_logprobs)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(jnp.where(traj.loss_mask, traj.sampler_logprobs, 0)))


def test_rollout_metrics_against_numpy():
    """The trainer's episode metrics (``training.metrics.rollout_metrics``), every key against NumPy."""
    from ragen_jax.rollout.trajectory import Trajectory
    from ragen_jax.training.metrics import rollout_metrics

    rng = np.random.default_rng(2)
    B, T, L = 6, 3, 8
    success = np.array([1, 0, 0, 0, 1, 1], bool)
    pen = -0.1 * (rng.random((B, T)) < 0.5)
    valid = np.arange(L)[None] < rng.integers(2, L + 1, B)[:, None]
    ret = rng.random(B).astype(np.float32)
    resp = rng.integers(0, 50, B).astype(np.int32)
    trunc = np.array([0, 1, 0, 0, 0, 1], bool)
    arr = lambda x: jnp.asarray(x)
    traj = Trajectory(
        tokens=arr(np.zeros((B, L), np.int32)), valid_mask=arr(valid),
        loss_mask=arr(np.zeros((B, L), bool)), sampler_logprobs=arr(np.zeros((B, L), np.float32)),
        turn_ids=arr(np.zeros((B, L), np.int32)), token_rewards=arr(np.zeros((B, L), np.float32)),
        turn_rewards=arr(np.zeros((B, T), np.float32)), turn_format_penalty=arr(pen.astype(np.float32)),
        turn_reasoning_reward=arr(np.zeros((B, T), np.float32)),
        turn_mask=arr(np.ones((B, T), bool)), turn_last_token=arr(np.zeros((B, T), np.int32)),
        prompt_end=arr(np.zeros((B, T), np.int32)), reasoning_start=arr(np.zeros((B, T), np.int32)),
        reasoning_end=arr(np.zeros((B, T), np.int32)), group_ids=arr(np.arange(B) // 2),
        episode_return=arr(ret), success=arr(success),
        num_turns=arr(np.full(B, 3, np.int32)), num_actions=arr(rng.integers(0, 6, B).astype(np.int32)),
        valid_action_rate=arr(rng.random(B).astype(np.float32)),
        effective_action_rate=arr(rng.random(B).astype(np.float32)),
        response_length=arr(resp), truncated=arr(trunc),
    )
    assert float(rollout_metrics(traj, group_size=2)["window_length_max"]) == 0.0  # full context: no windows
    # Limited context: row (b, t) holds transcript [context_start, turn_last_token] after the preamble;
    # the widest active turn here is row 4, turn 1: 40 - 22 + 1 = 19 (row 2's 30 tokens are an ended turn).
    last = np.full((B, T), 20, np.int32)
    start = np.full((B, T), 15, np.int32)
    last[4, 1], start[4, 1] = 40, 22
    last[2, 2], start[2, 2] = 44, 15
    mask = np.ones((B, T), bool)
    mask[2, 2] = False
    last[5, 0] = -1  # no sampled token
    traj = traj.replace(turn_last_token=arr(last), context_start=arr(start), turn_mask=arr(mask))
    m = {k: float(v) for k, v in rollout_metrics(traj, group_size=2).items()}
    lengths = valid.sum(1)
    want = {
        "success": 0.5, "pass_at_2": 2 / 3,  # groups (1,0), (0,0), (1,1)
        "return": ret.mean(), "return_std": ret.std(),
        "in_group_reward_std": np.mean([np.std(ret[2 * g:2 * g + 2], ddof=1) for g in range(3)]),
        "num_turns": 3.0, "num_actions": np.asarray(traj.num_actions).mean(),
        "valid_action_rate": np.asarray(traj.valid_action_rate).mean(),
        "effective_action_rate": np.asarray(traj.effective_action_rate).mean(),
        "response_length": resp.mean(), "sequence_length": lengths.mean(), "sequence_length_max": lengths.max(),
        "format_penalty": pen.sum(1).mean(), "reasoning_reward": 0.0, "sampled_tokens": resp.sum(), "truncated": trunc.mean(),
        "window_length_max": 19.0,
    }
    assert set(m) == set(want)
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # With a state description: turns that describe their state over turns that took place (row 2's
    # third turn did not: its True is not counted), and over first turns.
    describes = np.zeros((B, T), bool)
    describes[[0, 0, 1, 2, 3], [0, 1, 0, 2, 2]] = True
    m = {k: float(v) for k, v in rollout_metrics(traj.replace(turn_describes_state=arr(describes)), 2).items()}
    assert m["describes_state"] == pytest.approx(4 / 17) and m["first_turn_describes_state"] == pytest.approx(2 / 6)
    assert set(m) == set(want) | {"describes_state", "first_turn_describes_state"}


@pytest.mark.slow
def test_conversation_longer_than_max_seq_len_ends_at_a_turn_boundary():
    tok = make_tokenizer("qwen")
    env = environments.make("frozen_lake")
    params = env.default_params()
    probe = RolloutConfig(num_groups=2, group_size=1, max_turns=4, max_new_tokens=32, max_seq_len=4096,
                          max_obs_tokens=64)
    graphdef, weights = tiny_model(tok)
    ro = make_rollout(graphdef, env, params, tok, probe)
    # room for the system prompt and about two turns
    p0, chunk = len(ro.codec.preamble_ids), ro.codec.chunk_len
    cfg = RolloutConfig(**{**probe.__dict__, "max_seq_len": p0 + 2 * (chunk + 32) + 8})
    ro = make_rollout(graphdef, env, params, tok, cfg)
    rng = np.random.default_rng(0)
    forced, _ = scripted_replies(tok, ("Nope",), rng, cfg.batch_size, cfg.max_turns, cfg.max_new_tokens,
                                 ro.framing.end_of_turn)  # never a valid action: episodes never end early
    traj = ro(weights, jax.random.key(0), forced)
    assert bool(jnp.all(traj.truncated))
    assert bool(jnp.all(traj.num_turns < cfg.max_turns)) and bool(jnp.all(traj.num_turns >= 1))
    for b in range(cfg.batch_size):
        text = decode(tok, traj.tokens[b, : int(traj.lengths[b])])
        assert text.endswith(ro.framing.assistant_end)  # closed after the last complete turn
        assert int(traj.lengths[b]) <= cfg.max_seq_len
