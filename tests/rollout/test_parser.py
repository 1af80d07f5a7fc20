"""Device reply parser vs a Python regex reference of RAGEN's rules.

The reference below is written from RAGEN's rules, independently of the device code: ``re`` on bytes,
``bytes.replace``, ``split(b"||")``, ``strip``, ``lower``. Hypothesis drives random and adversarial
byte strings (tag fragments, pipes, whitespace, action names in mixed case); its seed is derived
from the test name, so runs are reproducible.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragen_jax.rollout.parser import STRIPPED_STRINGS, ActionVocab, parse_reply

NAMES = ("Up", "Down", "Left", "Right")
BUF = 96
MAX_ACTIONS = 2

THINK_RE = re.compile(rb"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_RE = re.compile(rb"<answer>(.*?)</answer>", re.DOTALL)


def reference_parse(text: bytes, names, max_actions: int, enable_think: bool):
    """RAGEN's ``_parse_response`` + ``_extract_map_valid_actions`` + penalty rule, on bytes."""
    m = (THINK_RE if enable_think else ANSWER_RE).search(text)
    if m is None:
        return dict(matched=False, actions=[], n_parsed=0, n_valid=0, penalty=True, think_end=len(text))
    answer = m.group(2) if enable_think else m.group(1)
    for s in STRIPPED_STRINGS:
        answer = answer.replace(s.encode(), b"")
    answer = answer.strip()
    parts = [a.strip() for a in answer.split(b"||") if a.strip()][:max_actions]
    lookup = {n.lower().encode(): i for i, n in enumerate(names)}
    valid = [lookup[p.lower()] for p in parts if p.lower() in lookup]
    penalty = len(valid) != len(parts) or not valid
    think_end = m.end(1) if enable_think else len(text)  # where "</think>" starts
    return dict(matched=True, actions=valid, n_parsed=len(parts), n_valid=len(valid), penalty=penalty, think_end=think_end)


VOCAB = ActionVocab.from_names(NAMES)


@jax.jit
def _device_parse_think(buf, n):
    return jax.vmap(lambda b, k: parse_reply(b, k, VOCAB, MAX_ACTIONS, True))(buf, n)


@jax.jit
def _device_parse_answer(buf, n):
    return jax.vmap(lambda b, k: parse_reply(b, k, VOCAB, MAX_ACTIONS, False))(buf, n)


def _check_batch(texts, enable_think):
    buf = np.zeros((len(texts), BUF), np.uint8)
    # garbage after the valid length must be ignored
    buf[:] = ord("|")
    for i, t in enumerate(texts):
        buf[i, : len(t)] = np.frombuffer(t, np.uint8)
    n = np.array([len(t) for t in texts], np.int32)
    out = (_device_parse_think if enable_think else _device_parse_answer)(jnp.asarray(buf), jnp.asarray(n))
    for i, t in enumerate(texts):
        ref = reference_parse(t, NAMES, MAX_ACTIONS, enable_think)
        got_actions = [int(a) for a in out.actions[i][: int(out.n_valid[i])]]
        assert bool(out.matched[i]) == ref["matched"], t
        assert got_actions == ref["actions"], t
        assert int(out.n_parsed[i]) == ref["n_parsed"], t
        assert int(out.n_valid[i]) == ref["n_valid"], t
        assert bool(out.format_penalty[i]) == ref["penalty"], t
        assert np.all(np.asarray(out.actions[i][int(out.n_valid[i]):]) == -1)
        if ref["matched"]:
            assert int(out.think_end[i]) == ref["think_end"], t


HAND = [
    b"<think>go</think><answer>Up || Left</answer>",
    b"<think>go</think> \n\t<answer> up||LEFT </answer>",
    b"<think>a</think>x<answer>Up</answer>",  # text between the tags: no match
    b"<think>a</think>x</think><answer>Up</answer>",  # second </think> is the one followed by <answer>
    b"<think><think></think><answer>Down||Jump</answer>",  # unknown action -> penalty, Down kept
    b"<think>t</think><answer>Up||Down||Left</answer>",  # extras dropped, no penalty
    b"<think>t</think><answer>|||Up</answer>",  # "|||Up".split("||") == ["", "|Up"]
    b"<think>t</think><answer>Up<|im_end|>||Ri<answer>ght</answer>",  # stripped strings inside the answer
    b"<think>t</think><answer></answer>",
    b"<think>t</think><answer>  ||  || </answer>",
    b"<think>t</think><answer>Up</answer> trailing </answer>",
    b"<think>t</think><answer>Up",
    b"no tags at all",
    b"<answer>Up</answer>",
    b"<think></think><answer>up</answer><think></think><answer>down</answer>",
    b"<think>t</think><answer>Up | | Down</answer>",
    b"<think>t</think><answer>Down\x00||Up</answer>",
]


def test_hand_cases_think():
    _check_batch(HAND, enable_think=True)


def test_hand_cases_answer_only():
    _check_batch(HAND, enable_think=False)


ATOMS = [
    b"<think>", b"</think>", b"<answer>", b"</answer>", b"<|im_end|>", b"<|im_start|>", b"||", b"|",
    b" ", b"\n", b"\t", b"\x0b", b"\xa0", b"Up", b"up", b"DOWN", b"Left", b"right", b"Rig", b"ht", b"<", b">",
    b"</", b"think", b"answer", b"x", b"\x00", b"\xff",
]
texts = st.lists(st.one_of(st.sampled_from(ATOMS), st.binary(max_size=3)), max_size=24).map(
    lambda parts: b"".join(parts)[:BUF]
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(texts, min_size=8, max_size=8), st.booleans())
def test_property_agrees_with_regex_reference(batch, enable_think):
    _check_batch(batch, enable_think)


def test_action_vocab_rejects_bad_names():
    with pytest.raises(ValueError, match="action names"):
        ActionVocab.from_names(("Up", " Down"))
    with pytest.raises(ValueError, match="no action_names"):
        ActionVocab.from_names(())
