"""Codec: device-assembled user turns decode to exactly the host text, for every env and format.

Host references: ``env.render_text`` (the original's strings, NumPy) for the observation,
``prompts.turn_block`` / ``prompts.reward_message`` for the turn text and the chat template itself
(``apply_chat_template``) for the framing. States are drawn on device from fixed seeds
(reset keys and random actions), so the run is reproducible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import environments
from ragen_jax.rollout import prompts
from ragen_jax.config import RolloutConfig
from ragen_jax.rollout.prompts import build_system_text
from ragen_jax.rollout.chat import chat_framing
from ragen_jax.rollout.codec import PromptCodec, concat_pieces, decode, token_byte_table
from tests.rollout.helpers import make_tokenizer

N_STATES = 1024

CASES = [
    ("sokoban", {}, "grid"),
    ("sokoban", {}, "coord"),
    ("sokoban", {}, "grid_coord"),
    ("frozen_lake", {}, "grid"),
    ("frozen_lake", {}, "coord"),
    ("frozen_lake", {}, "grid_coord"),
    ("bandit", {}, "text"),
]


@functools.lru_cache(maxsize=None)
def _random_states(name, n=N_STATES, seed=7):
    """``n`` states of env ``name``: resets from ``n // 4`` keys, each followed by 3 random actions
    (``step_env``: no auto-reset, so finished episodes stay in their final state). Cached per env so
    every format and tokenizer reuses one compilation of the level generator."""
    env = environments.make(name)
    params = env.default_params()
    m = n // 4

    @jax.jit
    def draw(key):
        k_reset, k_act = jax.random.split(key)
        _, s = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_reset, m), params)
        out = [s]
        for k in jax.random.split(k_act, 3):
            ka, ks = jax.random.split(k)
            acts = jax.random.randint(ka, (m,), 0, env.num_actions)
            _, s, *_ = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))(jax.random.split(ks, m), s, acts, params)
            out.append(s)
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *out)

    return draw(jax.random.key(seed))


def _to_host(states):
    is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.tree.map(lambda x: x if is_key(x) else np.asarray(x), states)


def _host_state(states, i):
    return jax.tree.map(lambda x: x[i], states)


# A few combinations run by default; the full env × format × template sweep is marked slow.
FAST = {("sokoban", "grid", "qwen"), ("frozen_lake", "coord", "llama3"), ("bandit", "text", "qwen")}
SWEEP = [
    pytest.param(name, kwargs, fmt, style, marks=() if (name, fmt, style) in FAST else pytest.mark.slow)
    for name, kwargs, fmt in CASES
    for style in ("qwen", "llama3")
]


@pytest.mark.parametrize("name,kwargs,fmt,style", SWEEP)
def test_turn_chunk_decodes_to_host_text(name, kwargs, fmt, style):
    tok = make_tokenizer(style)
    env = environments.make(name, **kwargs)
    params = env.default_params()
    framing = chat_framing(tok)
    states = _random_states(name)
    pieces, n = jax.vmap(lambda s: env.render_pieces(s, params, fmt))(states)
    cd = PromptCodec(tok, framing, env.piece_table, "sys", enable_think=True, max_words=100, max_int=12,
                     max_obs_pieces=pieces.shape[1], reward_decimals=1, reward_limit=20.0)

    rng = np.random.default_rng(0)
    t = rng.integers(0, 6, N_STATES)
    eot = rng.random(N_STATES) < 0.5
    warn = rng.random(N_STATES) < 0.5
    left = rng.integers(0, 11, N_STATES)
    stepped = rng.random(N_STATES) < 0.8
    reward = rng.integers(-25, 115, N_STATES) / 10.0  # multiples of 0.1, as Sokoban/FrozenLake produce

    @jax.jit
    def chunks(t, p, n, e, r, s, w, a):
        def one(t, p, n, e, r, s, w, a):
            ids, valid = cd.turn_pieces(t, p, n, eot_emitted=e, reward_id=cd.reward_id(r, s), warning=w, actions_left=a)
            return cd.chunk(ids, valid)[:2]
        return jax.vmap(one)(t, p, n, e, r, s, w, a)

    toks, lens = chunks(jnp.asarray(t), pieces, n, jnp.asarray(eot), jnp.asarray(reward, jnp.float32),
                        jnp.asarray(stepped), jnp.asarray(warn), jnp.asarray(left))
    toks, lens = np.asarray(toks), np.asarray(lens)
    states = _to_host(states)
    assert lens.max() <= cd.chunk_len
    eot_text = framing.end_of_turn
    for i in range(N_STATES):
        state_text = env.render_text(_host_state(states, i), fmt)
        content = prompts.turn_block(int(t[i]) + 1, state_text, int(left[i]), warning=bool(warn[i]),
                                     enable_think=True, max_words=100)
        if t[i] > 0:
            content = prompts.reward_message(float(reward[i]) if stepped[i] else None) + content
        if framing.trims_content:
            content = content.strip()
        expected = content + framing.user_to_assistant + "<think>"
        if t[i] > 0:
            close = framing.assistant_end[len(eot_text):] if eot[i] else framing.assistant_end
            expected = close + framing.user_header + expected
        got = decode(tok, toks[i, : lens[i]])
        assert got == expected, (i, got, expected)


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_conversation_matches_chat_template(style):
    """Preamble + chunks + replies + closes == apply_chat_template on the same messages."""
    tok = make_tokenizer(style)
    env = environments.make("frozen_lake")
    params = env.default_params()
    framing = chat_framing(tok)
    system = build_system_text(env, "grid", RolloutConfig(), (4, 4))
    _, state = jax.jit(env.reset)(jax.random.key(3), params)
    pieces, n = jax.jit(lambda s: env.render_pieces(s, params, "grid"))(state)
    cd = PromptCodec(tok, framing, env.piece_table, system, enable_think=True, max_words=100, max_int=12,
                     max_obs_pieces=pieces.shape[0])
    replies = [" I push up </think> <answer> Up </answer>", " done </think><answer>Left</answer>"]
    users = [
        prompts.turn_block(1, env.render_text(state), 10, warning=False, enable_think=True, max_words=100),
        prompts.reward_message(-0.1) + prompts.turn_block(2, env.render_text(state), 9, warning=True,
                                                          enable_think=True, max_words=100),
    ]
    @jax.jit
    def chunk(turn):
        ids, valid = cd.turn_pieces(turn, pieces, n, eot_emitted=False,
                                    reward_id=cd.reward_id(jnp.float32(-0.1), True),
                                    warning=turn == 1, actions_left=10 - turn)
        return cd.chunk(ids, valid)[:2]

    tokens = list(cd.preamble_ids)
    for turn, reply in enumerate(replies):
        chunk_ids, k = chunk(turn)
        chunk_ids, k = np.asarray(chunk_ids), int(k)
        tokens += list(chunk_ids[:k])
        tokens += list(tok(reply, add_special_tokens=False)["input_ids"])
    tokens += list(tok(framing.assistant_end, add_special_tokens=False)["input_ids"])
    messages = [{"role": "system", "content": system}]
    for u, r in zip(users, replies):
        messages += [{"role": "user", "content": u}, {"role": "assistant", "content": "<think>" + r}]
    expected = tok.apply_chat_template(messages, tokenize=False)
    assert decode(tok, tokens) == expected


def test_concat_pieces_matches_numpy():
    rng = np.random.default_rng(1)
    table = rng.integers(1, 50, (9, 4)).astype(np.int32)
    lengths = rng.integers(0, 5, 9).astype(np.int32)
    concat = jax.jit(lambda i, v: concat_pieces(jnp.asarray(table), jnp.asarray(lengths), i, v, 40))
    for _ in range(20):
        ids = rng.integers(0, 9, 7)
        valid = rng.random(7) < 0.7
        out, k, src = concat(jnp.asarray(ids), jnp.asarray(valid))
        ref = [v for i, ok in zip(ids, valid) if ok for v in table[i, : lengths[i]]]
        ref_src = [m for m, (i, ok) in enumerate(zip(ids, valid)) if ok for _ in range(lengths[i])]
        assert int(k) == len(ref)
        assert list(np.asarray(out[:k])) == ref
        assert list(np.asarray(src[:k])) == ref_src
        assert np.all(np.asarray(out[k:]) == 0)


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_token_byte_table_matches_decode(style):
    tok = make_tokenizer(style)
    table, lengths = token_byte_table(tok)
    special = set(tok.all_special_ids)
    text = "<think> √ push the box Up </think> <answer>Up || Left</answer> ünïcödé ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    got = b"".join(bytes(table[i, : lengths[i]]) for i in ids)
    assert got == text.encode()
    for i in special:
        assert lengths[i] == 0


def test_untemplated_tokenizer_is_rejected():
    with pytest.raises(ValueError, match="no chat template"):
        chat_framing(make_tokenizer("none"))
