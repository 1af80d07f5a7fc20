"""Cheap counter-based random words for level generation.

Generating a level draws many small random numbers; one threefry call per word costs several times
more on CPU than this integer hash. Each env draws one threefry block per reset and expands it by
hashing counters with it, so the words stay a pure function of the key.
"""
from __future__ import annotations

import numpy as np


def lowbias32(x):
    """A 32-bit integer hash with low bias (C. Wellons' ``lowbias32``); uint32 -> uint32 (numpy or jax)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def expand_words(seed, shape):
    """``uint32 [*shape]`` random words from ``seed`` (uint32 [2], one threefry draw), by hashing a
    counter twice, keyed by the seed's two words (FrozenLake's and Countdown's generators)."""
    import jax.numpy as jnp

    counter = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    return lowbias32(lowbias32(counter ^ seed[0]) + seed[1])
