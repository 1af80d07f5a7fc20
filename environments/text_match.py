"""Fixed-size text matching on device: ``re.search`` for the few answer patterns the envs read.

A pattern is a tuple of elements — a literal (``bytes``), ``WS`` (``\\s+``), ``OPT_WS`` (``\\s*``)
or ``NUM`` (a captured ``\\d+``). Every quantified element is followed by something outside its
class (a digit run by a space, comma or bracket; a space run by a non-space), so greedy matching
never backtracks and a match attempt is a fixed sequence of gathers. ``search`` runs the attempt at
every start position at once and keeps the leftmost success — ``re.search``'s answer.

Bytes are ASCII: ``\\s`` is ``[ \\t\\n\\r\\f\\v]`` and ``\\d`` is ``[0-9]`` (Python's ``str`` patterns
would also accept Unicode spaces and digits). A captured number of more than ``MAX_DIGITS`` digits
reads as ``HUGE``.

``literal`` / ``decimal`` / ``cell`` / ``masked`` / ``concat`` / ``starts_with`` build a text of
data-dependent length and compare another with it (whether a reply states what it sees); ``encode``
is the host side's text -> buffer.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

WS, OPT_WS, NUM = "ws+", "ws*", "num"
MAX_DIGITS = 9
HUGE = 10 ** MAX_DIGITS - 1
SPACES = np.array([32, 9, 10, 13, 12, 11], np.uint8)


def lower(text: chex.Array) -> chex.Array:
    """ASCII lower case of ``uint8 [L]``."""
    return jnp.where((text >= ord("A")) & (text <= ord("Z")), text + 32, text).astype(text.dtype)


def is_space(text: chex.Array) -> chex.Array:
    return jnp.any(text[..., None] == jnp.asarray(SPACES), axis=-1)


def strip(text: chex.Array, n: chex.Array) -> tuple[chex.Array, chex.Array]:
    """``text[:n].strip()`` (ASCII spaces) moved to the front: ``(uint8 [L] zero-padded, length)``."""
    width = text.shape[0]
    idx = jnp.arange(width)
    content = ~is_space(text) & (idx < n)
    first = jnp.where(jnp.any(content), jnp.argmax(content), 0).astype(jnp.int32)
    end = jnp.where(jnp.any(content), jnp.max(jnp.where(content, idx + 1, 0)), 0).astype(jnp.int32)
    body = jnp.where(idx < end - first, text[jnp.clip(first + idx, 0, width - 1)], 0).astype(jnp.uint8)
    return body, end - first


class Scanner:
    """Per-position facts about one text buffer, shared by every pattern searched in it."""

    def __init__(self, text: chex.Array, n: chex.Array):
        length = text.shape[0]
        idx = jnp.arange(length)
        valid = idx < n
        self.text, self.n, self.length = text, n, length
        digit = valid & (text >= ord("0")) & (text <= ord("9"))
        space = valid & is_space(text)
        # Run lengths from each position: distance to the next position outside the class.
        self.digit_run = jax.lax.cummin(jnp.where(digit, length, idx), reverse=True) - idx
        self.space_run = jax.lax.cummin(jnp.where(space, length, idx), reverse=True) - idx
        # Value of the digit run starting at each position (at most MAX_DIGITS digits, else HUGE).
        j = jnp.arange(MAX_DIGITS)
        d = jnp.where(digit, text.astype(jnp.int32) - ord("0"), 0)
        dpad = jnp.concatenate([d, jnp.zeros((MAX_DIGITS,), jnp.int32)])
        window = dpad[idx[:, None] + j[None, :]]                                   # [L, D]
        run = jnp.minimum(self.digit_run, MAX_DIGITS)
        power = jnp.where(j[None, :] < run[:, None], 10 ** jnp.maximum(run[:, None] - 1 - j[None, :], 0), 0)
        value = jnp.sum(window * power, axis=1)
        self.number = jnp.where(self.digit_run > MAX_DIGITS, HUGE, value).astype(jnp.int32)

    def _at(self, arr, pos):
        return arr[jnp.clip(pos, 0, self.length - 1)]

    def contains(self, literal: bytes) -> chex.Array:
        """bool []: ``literal in text[:n]``."""
        k = len(literal)
        idx = jnp.arange(self.length)
        hit = idx + k <= self.n
        for o, c in enumerate(literal):
            hit = hit & (self._at(self.text, idx + o) == c)
        return jnp.any(hit)

    def search(self, pattern: tuple) -> tuple[chex.Array, chex.Array]:
        """``(matched bool [], captured numbers int32 [num captures])`` of the leftmost match."""
        pos = jnp.arange(self.length)
        ok = pos < self.n
        caps = []
        for element in pattern:
            if element == WS:
                run = self._at(self.space_run, pos)
                ok, pos = ok & (run >= 1) & (pos < self.n), pos + run
            elif element == OPT_WS:
                pos = pos + jnp.where(pos < self.n, self._at(self.space_run, pos), 0)
            elif element == NUM:
                run = self._at(self.digit_run, pos)
                ok = ok & (run >= 1) & (pos < self.n)
                caps.append(self._at(self.number, pos))
                pos = pos + run
            else:
                for c in element:
                    ok = ok & (pos < self.n) & (self._at(self.text, pos) == c)
                    pos = pos + 1
        first = jnp.argmax(ok)
        numbers = jnp.stack([c[first] for c in caps]) if caps else jnp.zeros((0,), jnp.int32)
        return jnp.any(ok), numbers


# --- building a text -------------------------------------------------------------------------------


def encode(text: str, width: int) -> tuple[np.ndarray, int]:
    """Host side: ``text``'s UTF-8 bytes cut to ``width``, as the buffers above take them:
    ``(uint8 [width] zero-padded, byte count)``."""
    data = text.encode("utf-8")[:width]
    buf = np.zeros((width,), np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    return buf, len(data)


def literal(text: str) -> tuple[chex.Array, chex.Array]:
    """An ASCII literal as a segment: ``(uint8 [len], int32 [] len)``."""
    data = np.frombuffer(text.encode("ascii"), np.uint8)
    return jnp.asarray(data), jnp.int32(len(data))


def decimal(value: chex.Array, max_digits: int) -> tuple[chex.Array, chex.Array]:
    """A non-negative int ``value < 10**max_digits`` in decimal, no leading zeros:
    ``(uint8 [max_digits], int32 [] digits)``."""
    value = jnp.asarray(value, jnp.int32)
    powers = 10 ** np.arange(max_digits - 1, -1, -1)  # most significant first
    digits = (value // powers) % 10
    n = jnp.maximum(1, jnp.sum(value >= powers[:-1]) + 1) if max_digits > 1 else jnp.int32(1)
    # Drop the leading zeros: the last n of the max_digits digits, moved to the front.
    shifted = jnp.take(digits, jnp.clip(jnp.arange(max_digits) + max_digits - n, 0, max_digits - 1))
    return (shifted + ord("0")).astype(jnp.uint8), n.astype(jnp.int32)


def masked(segment, when) -> tuple[chex.Array, chex.Array]:
    """``segment`` where ``when`` (bool []), else left out (its length 0)."""
    data, n = segment
    return data, jnp.where(when, n, 0)


def cell(rc: chex.Array, max_digits: int, when=True) -> list:
    """A grid cell as the experts' sentences name it, "(r, c)", as segments (left out where not ``when``)."""
    return [masked(segment, when) for segment in (literal("("), decimal(rc[0], max_digits), literal(", "),
                                                  decimal(rc[1], max_digits), literal(")"))]


def concat(segments, width: int) -> tuple[chex.Array, chex.Array]:
    """Segments ``(uint8 [k], int32 [] used)`` one after the other (each cut to its ``used`` bytes; a
    segment with ``used`` 0 is left out): ``(uint8 [width] zero-padded, int32 [] length)``. A text
    longer than ``width`` is cut there."""
    out = jnp.zeros((width,), jnp.uint8)
    offset = jnp.int32(0)
    for data, used in segments:
        k = data.shape[0]
        idx = jnp.where(jnp.arange(k) < used, offset + jnp.arange(k), width)
        out = out.at[idx].set(data, mode="drop")
        offset = offset + jnp.minimum(used, k)
    return out, jnp.minimum(offset, width)


def starts_with(text: chex.Array, n: chex.Array, prefix: chex.Array, m: chex.Array) -> chex.Array:
    """Whether ``text[:n]`` (uint8 [L]) opens with ``prefix[:m]`` (uint8 [W]); bool []."""
    w = prefix.shape[0]
    head = text[:w] if text.shape[0] >= w else jnp.pad(text, (0, w - text.shape[0]))
    same = (head == prefix) | (jnp.arange(w) >= m)
    return jnp.all(same) & (n >= m)
