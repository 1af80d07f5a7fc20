"""The reply parser, on device: bytes → actions (RAGEN's ``_parse_response`` rules).

Rules (the original's, stated on bytes):
  1. The reply text is the forced prefix (``<think>``) followed by the sampled reply, special tokens
     removed. The first match of ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (DOTALL; or
     ``<answer>(.*?)</answer>`` without thinking) selects the answer.
  2. The answer loses every occurrence of ``<think>``, ``</think>``, ``<answer>``, ``</answer>``,
     ``<|im_start|>``, ``<|im_end|>`` (in that order), is split on ``||``, and each part is stripped;
     empty parts are dropped.
  3. At most ``max_actions_per_turn`` parts are kept (extras dropped without penalty); each is
     matched case-insensitively against the action names; unknown names are dropped.
  4. Format penalty for the turn iff there was no match, or a kept part was not a known action, or
     no action is valid. No valid action → the env is not stepped.

Free-text actions (Sudoku's ``place 5 at row 2 col 3``, Countdown's equations, a host env's search
query): instead of a name table the caller passes a ``TextActions`` — the part's bytes
(``uint8 [width]``, the stripped part, zero-padded) and its length go to the environment's own
``parse_action``, which returns the action (any pytree) and whether the manager counts the part as
a valid action. The original hands such parts to the environment as strings and never penalises
them at the manager level; our environments return ``True`` for every non-empty part, so the
rules above hold unchanged (a part longer than ``width`` reaches the env with its true length,
and the env decides).

Whitespace and case are ASCII (``\\s`` = ``[ \\t\\n\\r\\f\\v]``, ``bytes.lower``): the original
works on decoded ``str`` and would additionally strip Unicode spaces and fold non-ASCII case; the
action names are ASCII, so the two differ only on replies that pad names with non-ASCII spaces.

Everything is vectorised: a tag is found by comparing shifted copies of the byte buffer with it
(first match = ``argmax``), segments by cumulative sums, so the cost is a few passes over the reply
with no sequential scan.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

STRIPPED_STRINGS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")
_WHITESPACE = np.array([32, 9, 10, 13, 12, 11], np.uint8)


@chex.dataclass(frozen=True)
class ParsedReply:
    matched: chex.Array  # bool [] the think/answer pattern matched
    actions: chex.Array  # int32 [A] valid action ids in order, -1 after n_valid (a pytree of [A, ...]
    #                      leaves, valid ones first, for ``TextActions``)
    n_parsed: chex.Array  # int32 [] non-empty answer parts kept (<= A)
    n_valid: chex.Array  # int32 [] of those, known action names
    format_penalty: chex.Array  # bool [] the turn is penalised
    think_end: chex.Array  # int32 [] byte index where "</think>" starts (n when unmatched)


@dataclasses.dataclass(frozen=True)
class ActionVocab:
    """Lower-cased action names as a padded byte table (host-built, static)."""

    names: tuple[str, ...]
    table: np.ndarray  # uint8 [num_actions, max_len]
    lengths: np.ndarray  # int32 [num_actions]

    @classmethod
    def from_names(cls, names) -> "ActionVocab":
        if not names:
            raise ValueError("the environment has no action_names; the parser needs a fixed action vocabulary")
        enc = [n.lower().encode("utf-8") for n in names]
        if any(not e or e != e.strip() or b"||" in e for e in enc):
            raise ValueError(f"action names must be non-empty, without surrounding spaces or '||': {names}")
        width = max(len(e) for e in enc)
        table = np.zeros((len(enc), width), np.uint8)
        for i, e in enumerate(enc):
            table[i, : len(e)] = np.frombuffer(e, np.uint8)
        return cls(tuple(names), table, np.array([len(e) for e in enc], np.int32))


@dataclasses.dataclass(frozen=True)
class TextActions:
    """Free-text actions: ``parse(part uint8 [width], length int32 []) -> (action pytree, valid bool [])``."""

    parse: Callable
    width: int


def _find(buf, valid, tag: bytes):
    """bool [L]: ``tag`` starts at i (entirely inside the valid region)."""
    length = buf.shape[0]
    k = len(tag)
    pad_b = jnp.concatenate([buf, jnp.zeros((k,), buf.dtype)])
    pad_v = jnp.concatenate([valid, jnp.zeros((k,), bool)])
    hit = jnp.ones((length,), bool)
    for j, c in enumerate(tag):
        hit = hit & (pad_b[j : j + length] == c) & pad_v[j : j + length]
    return hit


def _first(mask, default):
    """Index of the first True in ``mask`` (``default`` when none)."""
    return jnp.where(jnp.any(mask), jnp.argmax(mask), default).astype(jnp.int32)


def _is_space(buf):
    return jnp.any(buf[:, None] == jnp.asarray(_WHITESPACE)[None, :], axis=-1)


def _compact(buf, keep):
    """Move the kept bytes to the front (order preserved); returns (buf, n)."""
    length = buf.shape[0]
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, length)
    out = jnp.zeros_like(buf).at[dest].set(buf, mode="drop")
    return out, jnp.sum(keep).astype(jnp.int32)


def _remove_all(buf, n, tag: bytes):
    """``bytes.replace(tag, b"")`` for a tag that cannot overlap itself."""
    length = buf.shape[0]
    idx = jnp.arange(length)
    valid = idx < n
    hit = _find(buf, valid, tag)
    covered = jnp.zeros((length,), bool)
    for j in range(len(tag)):
        covered = covered | jnp.concatenate([jnp.zeros((j,), bool), hit[: length - j]])
    return _compact(buf, valid & ~covered)


def _match_actions(ans, starts, ends, n_parsed, vocab: ActionVocab, max_actions: int):
    """Compare each kept part ``ans[starts[k]:ends[k] + 1]`` with each action name (ASCII
    lower-case). -> ``(action ids int32 [max_actions], valid ones first, -1 after; their count)``."""
    length = ans.shape[0]
    j = jnp.arange(vocab.table.shape[1])
    gather = jnp.minimum(starts[:, None] + j[None, :], length - 1)
    part = ans[gather]
    part = jnp.where((part >= ord("A")) & (part <= ord("Z")), part + 32, part)
    names = jnp.asarray(vocab.table)
    lens = jnp.asarray(vocab.lengths)
    same = (part[:, None, :] == names[None, :, :]) | (j[None, None, :] >= lens[None, :, None])
    eq = jnp.all(same, axis=-1) & ((ends - starts + 1)[:, None] == lens[None, :])  # [A, num_actions]
    slot_ok = jnp.any(eq, axis=-1) & (jnp.arange(max_actions) < n_parsed)
    action = jnp.argmax(eq, axis=-1).astype(jnp.int32)
    n_valid = jnp.sum(slot_ok).astype(jnp.int32)
    dest = jnp.where(slot_ok, jnp.cumsum(slot_ok) - 1, max_actions)
    return jnp.full((max_actions,), -1, jnp.int32).at[dest].set(action, mode="drop"), n_valid


def _parse_text_actions(ans, starts, ends, n_parsed, text: TextActions, max_actions: int):
    """Each kept part's bytes through ``text.parse``; the valid actions moved to the front."""
    length = ans.shape[0]
    j = jnp.arange(text.width)
    part_len = jnp.maximum(ends - starts + 1, 0)  # [A]
    gather = jnp.minimum(starts[:, None] + j[None, :], length - 1)
    parts = jnp.where(j[None, :] < part_len[:, None], ans[gather], 0).astype(jnp.uint8)
    actions, ok = jax.vmap(text.parse)(parts, part_len.astype(jnp.int32))
    slot_ok = ok & (jnp.arange(max_actions) < n_parsed)
    # Stable order: valid slots first (a permutation, so pytree actions move as a whole).
    order = jnp.argsort(~slot_ok, stable=True)
    actions = jax.tree.map(lambda x: x[order], actions)
    return actions, jnp.sum(slot_ok).astype(jnp.int32)


def parse_reply(buf, n, vocab: ActionVocab | TextActions, max_actions: int, enable_think: bool = True) -> ParsedReply:
    """Parse one reply. ``buf`` uint8 ``[L]`` (forced prefix included), ``n`` int32 [] valid bytes;
    ``vocab`` the action names or, for free-text actions, a ``TextActions``."""
    length = buf.shape[0]
    idx = jnp.arange(length, dtype=jnp.int32)
    valid = idx < n
    space = _is_space(buf) & valid

    ans_open = _find(buf, valid, b"<answer>")
    ans_close = _find(buf, valid, b"</answer>")
    if enable_think:
        think_open = _find(buf, valid, b"<think>")
        think_close = _find(buf, valid, b"</think>")
        open_at = _first(think_open, length)
        # next non-space index at or after j (length when none): reverse cumulative minimum
        nxt = jax.lax.cummin(jnp.where(space, length, idx), reverse=True)
        nxt_pad = jnp.concatenate([nxt, jnp.full((9,), length, jnp.int32)])
        ans_open_pad = jnp.concatenate([ans_open, jnp.zeros((1,), bool)])
        after_close = nxt_pad[jnp.minimum(idx + 8, length)]
        cand = think_close & (idx >= open_at + 7) & ans_open_pad[jnp.minimum(after_close, length)]
        close_at = _first(cand, length)
        answer_start = jnp.minimum(nxt_pad[jnp.minimum(close_at + 8, length)] + 8, length)
        found_head = jnp.any(think_open) & jnp.any(cand)
        think_end = jnp.where(found_head, close_at, n)
    else:
        open_at = _first(ans_open, length)
        answer_start = jnp.minimum(open_at + 8, length)
        found_head = jnp.any(ans_open)
        think_end = n
    answer_end = _first(ans_close & (idx >= answer_start), length)
    matched = found_head & jnp.any(ans_close & (idx >= answer_start))

    # The answer, moved to the front of its own buffer.
    src = answer_start + idx
    ans = jnp.where(src < answer_end, buf[jnp.minimum(src, length - 1)], 0).astype(buf.dtype)
    m = jnp.where(matched, answer_end - answer_start, 0).astype(jnp.int32)
    for tag in STRIPPED_STRINGS:
        ans, m = _remove_all(ans, m, tag.encode())

    # Split on "||", greedily left to right: in a run of pipes, delimiters start at even offsets.
    a_valid = idx < m
    pipe = (ans == ord("|")) & a_valid
    run_start = jax.lax.cummax(jnp.where(pipe, 0, idx + 1))
    pipe_next = jnp.concatenate([pipe[1:], jnp.zeros((1,), bool)])
    delim = pipe & pipe_next & ((idx - run_start) % 2 == 0)
    delim_byte = delim | jnp.concatenate([jnp.zeros((1,), bool), delim[:-1]])
    seg = jnp.cumsum(delim)
    content = a_valid & ~delim_byte & ~_is_space(ans)
    # A part's first content byte: no earlier content byte in the same segment.
    prev_seg = jnp.concatenate([jnp.full((1,), -1), jax.lax.cummax(jnp.where(content, seg, -1))[:-1]])
    first = content & (prev_seg < seg)
    rank = jnp.cumsum(first) - 1
    n_parts = jnp.sum(first).astype(jnp.int32)
    slot = jnp.where(content & (rank < max_actions), rank, max_actions)
    starts = jnp.full((max_actions,), length, jnp.int32).at[slot].min(idx, mode="drop")
    ends = jnp.full((max_actions,), -1, jnp.int32).at[slot].max(idx, mode="drop")
    n_parsed = jnp.minimum(n_parts, max_actions)

    if isinstance(vocab, TextActions):
        actions, n_valid = _parse_text_actions(ans, starts, ends, n_parsed, vocab, max_actions)
    else:
        actions, n_valid = _match_actions(ans, starts, ends, n_parsed, vocab, max_actions)
    penalty = (n_valid == 0) | (n_valid != n_parsed)
    return ParsedReply(
        matched=matched,
        actions=actions,
        n_parsed=n_parsed,
        n_valid=n_valid,
        format_penalty=penalty,
        think_end=think_end.astype(jnp.int32),
    )
