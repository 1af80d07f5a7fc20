"""SNR-adaptive rollout filter (RAGEN-2): keep the groups whose rewards still carry signal.

Each group of ``group_size`` rollouts from one initial state gets a score — by default the spread of
its episode scores (``reward_variance``, which, like the original, is the *standard deviation* with
ddof 1). Low spread means the policy already behaves the same on every sample of that prompt, so its
advantages are mostly noise; the filter keeps the high-score groups (``filter_type='largest'``, the
code's and both papers' direction).

Everything is static-shape: the filter returns a per-group weight ``[G]`` (0/1 in the hard modes,
soft weights in ``weighted``), the matching per-row weight ``[B]``, the kept count and an
"empty" flag. Nothing is gathered out of the batch; the update step multiplies the loss mask by the
row weights (or passes them to ``losses.aggregate(..., row_weights=...)``) and skips the optimizer
step when ``is_empty``. The sequential walks of the original are sorts + cumulative sums here.

Sorting is stable: among equal scores the lower group index comes first.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
from flax import struct

from ragen_jax.registry import Registry
from ragen_jax.starpo.reductions import group_std, masked_row_mean

Array = jax.Array
Scalar = Union[float, Array]

ZERO_SCORE_TOL = 1e-10  # |score| <= this counts as "zero" (include_zero=False drops these groups)
MIN_P_TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# Per-group scores
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupScore:
    """A registered group score: which per-row quantity it reads and how it reduces a group.

    ``source`` is ``'reward'`` (episode scores), ``'entropy'`` (per-row mean token entropy) or
    ``'length'`` (per-row sampled-token count); ``reduce`` maps ``[G, K]`` -> ``[G]``.
    """

    source: str
    reduce: Callable[[Array], Array]


GROUP_SCORES: Registry[GroupScore] = Registry("filter group score")
GROUP_SCORES.register("reward_variance", "reward_std")(GroupScore("reward", group_std))
GROUP_SCORES.register("reward")(GroupScore("reward", lambda x: jnp.mean(x, axis=1)))
GROUP_SCORES.register("reward_sum")(GroupScore("reward", lambda x: jnp.sum(x, axis=1)))
GROUP_SCORES.register("length")(GroupScore("length", lambda x: jnp.mean(x, axis=1)))
GROUP_SCORES.register("entropy")(GroupScore("entropy", lambda x: jnp.mean(x, axis=1)))
GROUP_SCORES.register("entropy_variance", "entropy_std")(GroupScore("entropy", group_std))


def row_mean_entropy(token_entropy: Array, loss_mask: Array) -> Array:
    """Per-row mean token entropy over the sampled tokens: ``[B, L]`` -> ``[B]`` (0 for empty rows)."""
    return masked_row_mean(token_entropy, loss_mask)


# ---------------------------------------------------------------------------------------------
# Selection strategies: scores [G], eligible [G] -> weights [G]
# ---------------------------------------------------------------------------------------------

StrategyFn = Callable[..., Array]
FILTER_STRATEGIES: Registry[StrategyFn] = Registry("filter strategy")
# A strategy may carry ``keeps_nothing(value) -> str``: non-empty (why, and the range to use) when
# ``filter.value`` would keep no group at all, so every update would be skipped in silence; the
# configuration asks it (``value_problem``) and fails with that message.
FILTER_TYPES = Registry("filter type")
FILTER_TYPES.add("largest", "largest")
FILTER_TYPES.add("smallest", "smallest")
TOP_P_MODES = Registry("top_p probability mode")
TOP_P_MODES.add("linear", "linear")
TOP_P_MODES.add("softmax", "softmax")


def _sort_eligible(scores: Array, eligible: Array, largest: bool):
    """Order putting eligible groups first, best first; returns (order, sorted scores, sorted eligible, rank)."""
    key = jnp.where(eligible, -scores if largest else scores, jnp.inf)
    order = jnp.argsort(key, stable=True)
    rank = jnp.argsort(order)  # rank[g] = position of group g in the sorted order
    return order, scores[order], eligible[order], rank


def _keep_top(num_keep: Array, scores: Array, eligible: Array, largest: bool) -> Array:
    _, _, _, rank = _sort_eligible(scores, eligible, largest)
    return ((rank < num_keep) & eligible).astype(jnp.float32)


def _top_p_linear(scores, eligible, value, largest, eps):
    """The original's cumulative walk over sorted scores (linear mode).

    threshold = value * sum(scores) - eps. Walk best-first: stop once cum >= threshold, stop at the
    first score <= 0, else add the score. Keep the walked prefix iff cum >= threshold, else nothing.
    """
    g = scores.shape[0]
    _, s, elig, rank = _sort_eligible(scores, eligible, largest)
    threshold = value * jnp.sum(jnp.where(eligible, scores, 0.0)) - eps
    s = jnp.where(elig, s, 0.0)
    # prefix[i] = sum of the first i sorted scores: the running total before visiting item i.
    prefix = jnp.concatenate([jnp.zeros((1,), s.dtype), jnp.cumsum(s)])
    stop = (prefix[:-1] >= threshold) | (s <= 0) | ~elig
    idx = jnp.arange(g)
    walked = jnp.min(jnp.where(stop, idx, g))  # number of groups added before stopping
    cum = prefix[walked]
    keep_sorted = (idx < walked) & (cum >= threshold)
    return keep_sorted[rank].astype(jnp.float32)


def _top_p_softmax(scores, eligible, value, largest):
    """Nucleus over ``softmax(+-scores)`` of the eligible groups: keep the first k whose mass >= value."""
    n = jnp.sum(eligible)
    logits = jnp.where(eligible, scores if largest else -scores, -jnp.inf)
    probs = jnp.where(eligible, jax.nn.softmax(logits), 0.0)
    order, _, _, rank = _sort_eligible(scores, eligible, largest)
    cum = jnp.cumsum(probs[order])
    k = jnp.minimum(jnp.searchsorted(cum, value, side="left") + 1, n)
    return ((rank < k) & eligible).astype(jnp.float32)


@FILTER_STRATEGIES.register("top_p")
def top_p(scores, eligible, *, value, largest=True, top_p_mode="linear", selection_eps=0.01):
    """Keep the top cumulative fraction ``value`` of score mass; ``value >= 1`` keeps every eligible group.

    Linear mode follows the original's walk exactly, including its edges: all-zero scores give an
    empty selection, and a walk that meets a score <= 0 before reaching the threshold (e.g.
    ``filter_type='smallest'`` with zero-std groups present) selects nothing.
    """
    TOP_P_MODES.validate(top_p_mode)
    if top_p_mode == "linear":
        kept = _top_p_linear(scores, eligible, value, largest, selection_eps)
    else:
        kept = _top_p_softmax(scores, eligible, value, largest)
    return jnp.where(value >= 1.0, eligible.astype(jnp.float32), kept)


top_p.keeps_nothing = lambda value: ("keeps no group (the kept share of the reward spread); use a value in "
                                     "(0, 1] (1.0 keeps every group)") if value <= 0 else ""


def _int_floor(x: Scalar) -> Array:
    # Python numbers follow int() exactly; traced values get a tolerance so 0.7 * 10 is 7, not 6.
    if isinstance(x, (int, float)):
        return jnp.asarray(int(x), jnp.int32)
    return jnp.floor(x + 1e-6).astype(jnp.int32)


@FILTER_STRATEGIES.register("top_k")
def top_k(scores, eligible, *, value, largest=True, top_p_mode="linear", selection_eps=0.01):
    """Keep ``k = max(1, min(int(value * num_groups), #eligible))`` best groups."""
    n = jnp.sum(eligible).astype(jnp.int32)
    raw = _int_floor(value * scores.shape[0])
    k = jnp.minimum(jnp.maximum(1, jnp.minimum(raw, n)), n)
    return _keep_top(k, scores, eligible, largest)


@FILTER_STRATEGIES.register("top_k_abs")
def top_k_abs(scores, eligible, *, value, largest=True, top_p_mode="linear", selection_eps=0.01):
    """Keep ``k = max(1, min(int(value), #eligible))`` best groups."""
    n = jnp.sum(eligible).astype(jnp.int32)
    k = jnp.minimum(jnp.maximum(1, jnp.minimum(_int_floor(value), n)), n)
    return _keep_top(k, scores, eligible, largest)


@FILTER_STRATEGIES.register("min_p")
def min_p(scores, eligible, *, value, largest=True, top_p_mode="linear", selection_eps=0.01):
    """largest: keep ``score >= max * value - 1e-10``; smallest: keep ``score <= min / (value + 1e-10) + 1e-10``."""
    if largest:
        best = jnp.max(jnp.where(eligible, scores, -jnp.inf))
        keep = scores >= best * value - MIN_P_TOL
    else:
        best = jnp.min(jnp.where(eligible, scores, jnp.inf))
        keep = scores <= best / (value + MIN_P_TOL) + MIN_P_TOL
    return (keep & eligible).astype(jnp.float32)


min_p.keeps_nothing = lambda value: ("keeps no group (it keeps groups whose score is at least value x the best "
                                     "one's); use a value in [0, 1]") if value > 1 else ""


def value_problem(strategy: str, value: float) -> str:
    """Why ``filter.value`` keeps no group under ``strategy`` ("" when it can keep some)."""
    test = getattr(FILTER_STRATEGIES.get(strategy), "keeps_nothing", None)
    return test(value) if test is not None else ""


@FILTER_STRATEGIES.register("weighted")
def weighted(scores, eligible, *, value=1.0, largest=True, top_p_mode="linear", selection_eps=0.01):
    """Soft mode: instead of a hard cut, every eligible group is weighted in proportion to its score.

    largest: ``raw_g = max(score_g, 0)``; smallest: ``raw_g = max_eligible(score) - score_g``.
    ``w_g = raw_g * n_eligible / sum(raw)`` so the weights average 1 over the eligible groups;
    if every ``raw`` is 0 the weights are uniform (1). Ineligible groups get 0. ``value`` is unused.
    The least informative end gets weight 0 (a zero-std group under ``largest``, the top-scoring
    group under ``smallest``), which is the only way a group leaves the batch in this mode.
    """
    if largest:
        raw = jnp.maximum(scores, 0.0)
    else:
        raw = jnp.max(jnp.where(eligible, scores, -jnp.inf)) - scores
    raw = jnp.where(eligible, raw, 0.0)
    total = jnp.sum(raw)
    n = jnp.sum(eligible).astype(scores.dtype)
    w = jnp.where(total > 0, raw * n / jnp.where(total > 0, total, 1.0), 1.0)
    return jnp.where(eligible, w, 0.0).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Loss scaling by kept fraction — the one place it is defined
# ---------------------------------------------------------------------------------------------

LOSS_SCALINGS: Registry[Callable[[Array], Array]] = Registry("filter loss scaling")
LOSS_SCALINGS.register("none")(lambda kept_ratio: jnp.ones_like(kept_ratio))
LOSS_SCALINGS.register("linear")(lambda kept_ratio: kept_ratio)
LOSS_SCALINGS.register("sqrt")(lambda kept_ratio: jnp.sqrt(kept_ratio))


def filter_loss_scale(mode: str, kept_ratio: Scalar) -> Array:
    """Advantage multiplier from the kept fraction: ``none`` 1, ``linear`` r, ``sqrt`` sqrt(r)."""
    return LOSS_SCALINGS.get(mode)(jnp.asarray(kept_ratio, jnp.float32))


# ---------------------------------------------------------------------------------------------
# The filter
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class FilterResult:
    group_weights: Array  # float32 [G]: 0/1 (hard modes) or soft weights (weighted)
    row_weights: Array  # float32 [B]: group_weights repeated over each group's rows
    group_scores: Array  # float32 [G]: the score the selection ranked (the configured metric)
    # float32 [B]: each row's group's ranking score (group_scores repeated): the configured metric,
    # which is not the reward std unless metric='reward_std' -- RAGEN-2 buckets by ``reward_std``.
    row_group_scores: Array
    # float32 [B]: each row's group std of episode scores (ddof 1), whatever the metric: RAGEN's
    # batch["reward_std"], under its name; None without scores
    reward_std: Optional[Array]
    kept_count: Array  # int32 []: groups with weight > 0
    kept_ratio: Array  # float32 []: kept_count / G
    is_empty: Array  # bool []: nothing kept -> the update step must skip this batch
    metrics: dict  # name -> float32 [] (RAGEN names, "rollout/" prefix)


def _group_stats(matrix: Array) -> dict[str, Array]:
    return {"std": group_std(matrix), "max": jnp.max(matrix, axis=1), "mean": jnp.mean(matrix, axis=1),
            "sum": jnp.sum(matrix, axis=1)}


def _weighted_group_mean(per_group: Array, weights: Array) -> Array:
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(per_group * weights) / jnp.where(total > 0, total, 1.0), 0.0)


def _group_matrix(per_row: Optional[Array], source: str, metric: str, group_size: int) -> Array:
    """float32 ``[num_groups, group_size]`` of the metric's per-row values, with the input checks."""
    if per_row is None:
        arg = {"reward": "episode_scores", "length": "response_lengths", "entropy": "row_entropy"}
        raise ValueError(f"Filter metric {metric!r} needs {arg[source]} [B]; it was not given.")
    per_row = jnp.asarray(per_row, jnp.float32)
    if per_row.ndim != 1:
        raise ValueError(f"Filter metric {metric!r} reads one value per row, [B]; got shape {per_row.shape}.")
    batch = per_row.shape[0]
    if not isinstance(group_size, int) or group_size < 1 or batch % group_size:
        raise ValueError(f"Batch of {batch} rows must be num_groups contiguous blocks of "
                         f"group_size={group_size!r}.")
    return per_row.reshape(batch // group_size, group_size)


def rollout_filter(
    *,
    group_size: int,
    episode_scores: Optional[Array] = None,
    response_lengths: Optional[Array] = None,
    row_entropy: Optional[Array] = None,
    metric: str = "reward_variance",
    strategy: str = "top_p",
    value: Scalar = 1.0,
    filter_type: str = "largest",
    include_zero: bool = True,
    top_p_mode: str = "linear",
    selection_eps: Scalar = 0.01,
) -> FilterResult:
    """Scores every group and selects which to train on (static shapes; jit-able).

    Args:
      group_size: rows per group; rows are ``num_groups`` contiguous blocks.
      episode_scores: float ``[B]`` episode score per row (turn rewards incl. format penalties) —
        needed by the ``reward*`` metrics.
      response_lengths: ``[B]`` sampled-token counts (``Trajectory.response_length``) — for ``length``.
      row_entropy: float ``[B]`` per-row mean token entropy (``row_mean_entropy``) — for ``entropy*``.
      metric: registry ``GROUP_SCORES`` (``reward_variance`` = group std of episode scores, ...).
      strategy: registry ``FILTER_STRATEGIES`` (``top_p``, ``top_k``, ``top_k_abs``, ``min_p``, ``weighted``).
      value: the strategy's parameter (top-p mass, top-k fraction, k, min-p ratio); may be traced.
      filter_type: ``largest`` keeps high scores (default), ``smallest`` keeps low scores.
      include_zero: False first drops groups with ``|score| <= 1e-10`` (none left -> empty).
      top_p_mode: ``linear`` (cumulative score walk) or ``softmax`` (nucleus over softmax(scores)).
      selection_eps: slack subtracted from the linear top-p threshold.

    Returns: ``FilterResult``. ``top_p`` with ``value >= 1`` keeps every eligible group, so with
    ``include_zero=True`` it is the no-op (all weights 1), while ``include_zero=False`` still drops
    zero-score groups (the original treats these as different settings).
    """
    score_def = GROUP_SCORES.get(metric)
    strategy_fn = FILTER_STRATEGIES.get(strategy)
    FILTER_TYPES.validate(filter_type)
    TOP_P_MODES.validate(top_p_mode)
    sources = {"reward": episode_scores, "length": response_lengths, "entropy": row_entropy}
    matrix = _group_matrix(sources[score_def.source], score_def.source, metric, group_size)
    num_groups = matrix.shape[0]
    scores = score_def.reduce(matrix)

    is_zero = jnp.abs(scores) <= ZERO_SCORE_TOL
    eligible = jnp.ones(num_groups, bool) if include_zero else ~is_zero
    weights = strategy_fn(scores, eligible, value=value, largest=filter_type == "largest",
                          top_p_mode=top_p_mode, selection_eps=selection_eps)
    kept = weights > 0
    kept_count = jnp.sum(kept).astype(jnp.int32)
    kept_ratio = kept_count.astype(jnp.float32) / num_groups

    stats = _group_stats(matrix)
    metrics = {}
    for name, per_group in stats.items():
        before = jnp.mean(per_group)
        after = _weighted_group_mean(per_group, weights)
        if name != "sum":
            metrics[f"rollout/in_group_{name}"] = before
            metrics[f"rollout/chosen_in_group_{name}"] = after
        metrics[f"rollout/in_group_{score_def.source}_{name}"] = before
        metrics[f"rollout/chosen_in_group_{score_def.source}_{name}"] = after
    metrics["rollout/filter_kept_count"] = kept_count.astype(jnp.float32)
    metrics["rollout/filter_kept_ratio"] = kept_ratio
    metrics["rollout/filter_zero_count"] = jnp.sum(is_zero).astype(jnp.float32)

    return FilterResult(
        group_weights=weights,
        row_weights=jnp.repeat(weights, group_size),
        group_scores=scores,
        row_group_scores=jnp.repeat(scores, group_size),
        reward_std=(None if episode_scores is None else jnp.repeat(
            group_std(_group_matrix(episode_scores, "reward", metric, group_size)), group_size)),
        kept_count=kept_count,
        kept_ratio=kept_ratio,
        is_empty=kept_count == 0,
        metrics=metrics,
    )
