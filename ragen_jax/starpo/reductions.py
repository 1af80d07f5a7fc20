"""Masked and grouped reductions: the one place the StarPO step, the filter, the metrics and the
diagnostics take a mean over sampled tokens or a statistic over a group of episodes.

Masks are ``[B, L]`` (bool, or float weights) over the token axis of a ``Trajectory``; groups are
``num_groups`` contiguous blocks of ``group_size`` rows (row ``i`` is in group ``i // group_size``),
so a group statistic is a reshape to ``[num_groups, group_size]``. Spreads are unbiased (ddof 1,
torch's ``std``), as in the original.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

WHITEN_EPS = 1e-8  # batch whitening: (A - mean) / sqrt(var + 1e-8), the original's constant


def check_group_size(batch: int, group_size: int) -> int:
    """The number of groups of ``batch`` rows; a clear error when they are not whole groups."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
    if batch % group_size:
        raise ValueError(
            f"Batch of {batch} rows is not a whole number of groups of group_size={group_size}; "
            "rows must be num_groups contiguous blocks of group_size."
        )
    return batch // group_size


def group_view(x: Array, group_size: int) -> Array:
    """``[B, ...]`` -> ``[num_groups, group_size, ...]`` (contiguous-block group layout)."""
    num_groups = check_group_size(x.shape[0], group_size)
    return x.reshape((num_groups, group_size) + x.shape[1:])


def group_std(grouped: Array) -> Array:
    """Unbiased (ddof 1) std over each group, ``[G, K]`` -> ``[G]``; a group of one has no spread (0,
    where the unbiased formula would give NaN)."""
    if grouped.shape[1] < 2:
        return jnp.zeros(grouped.shape[0], grouped.dtype)
    return jnp.std(grouped, axis=1, ddof=1)


def group_mean_std(scores: Array, group_size: int) -> tuple[Array, Array]:
    """Per-group mean and unbiased (ddof 1) std of ``scores [B]``, each ``[num_groups]``.

    Size-1 groups get mean 0 and std 1 (so a lone sample keeps its raw score), as in RAGEN's GRPO.
    """
    g = group_view(scores, group_size)
    if group_size == 1:
        return jnp.zeros(g.shape[0], scores.dtype), jnp.ones(g.shape[0], scores.dtype)
    return jnp.mean(g, axis=1), group_std(g)


def masked_mean(x: Array, mask: Array) -> Array:
    """Scalar mean of ``x`` over ``mask`` (any shape; bool, or float weights); 0 when the mask is
    empty. Masked-out entries never reach the sum, so a NaN or inf there cannot leak in."""
    m = mask.astype(jnp.result_type(x.dtype, jnp.float32))
    return jnp.sum(jnp.where(m > 0, x, 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


def masked_row_mean(x: Array, mask: Array) -> Array:
    """Per-row mean over ``mask``: ``[B, L]`` -> ``[B]`` (0 for an empty row; masked-out entries never
    reach the sum)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x, 0.0), axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)


def masked_whiten(x: Array, mask: Array, eps: float = WHITEN_EPS) -> Array:
    """``(x - mean_m) / sqrt(var_m + eps)`` with the Bessel-corrected (unbiased) masked variance.

    Statistics use only masked entries; the output is zeroed outside the mask. With fewer than two
    masked entries the variance is taken as 0 (the correction factor is undefined there).
    """
    m = mask.astype(x.dtype)
    n = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - 1.0, 1.0)
    return (x - mean) * jax.lax.rsqrt(var + eps) * m


def masked_stats(x: Array, mask: Array, prefix: str) -> dict:
    """``{prefix}/mean``, ``/std`` (population), ``/max``, ``/min`` of ``x`` over ``mask`` (0 when empty):
    the update's logged summary of advantages, returns, values and scores."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(x * m) / n
    has = jnp.sum(m) > 0
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": jnp.sqrt(jnp.sum(jnp.square(x - mean) * m) / n),
        f"{prefix}/max": jnp.where(has, jnp.max(jnp.where(mask, x, -jnp.inf)), 0.0),
        f"{prefix}/min": jnp.where(has, jnp.min(jnp.where(mask, x, jnp.inf)), 0.0),
    }
