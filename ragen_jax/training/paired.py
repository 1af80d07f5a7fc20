"""Paired statistics of per-puzzle results (NumPy only): what ``ragen_jax.compare``'s report and the
trainer's summary ("what RL added over the warm-up") print beside a mean difference."""
from __future__ import annotations

import math

import numpy as np


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); NaN for one value: unknown)."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return math.nan, math.nan
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    return float(x.mean()), se


def sign_flip_p(d, draws: int = 20000, seed: int = 0) -> float:
    """Two-sided paired permutation p-value of the mean difference ``d`` (``[puzzles]``): how often
    flipping the signs of the differences gives a total at least as far from 0 as the observed one.
    Exact over all sign patterns up to 16 non-zero differences, else ``draws`` seeded random patterns
    (``(1 + hits) / (1 + draws)``). It tests the mean difference the report prints beside it;
    Wilcoxon's test ranks the differences, which with success averaged over a few seeds (steps of
    1/3) can disagree with the mean's direction."""
    d = np.asarray(d, np.float64)
    d = d[d != 0]
    if d.size == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-9 * np.abs(d).sum()  # float slack: an equal total counts as a hit
    if d.size <= 16:
        signs = 1 - 2 * ((np.arange(2 ** d.size)[:, None] >> np.arange(d.size)) & 1)
        return float(np.mean(np.abs(signs @ d) >= observed))
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(draws, d.size))
    return float((1 + np.count_nonzero(np.abs(signs @ d) >= observed)) / (1 + draws))
