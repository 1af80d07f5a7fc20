"""StarPO losses: PPO policy loss, KL estimators, value loss and exact loss aggregation.

All ``[B, L]`` arrays follow the token-axis convention of ``advantages.py``: index ``t`` is about
token ``t`` as a target (its log-prob and entropy come from the logits at ``t - 1``, as
``starpo/logprobs.py`` computes them).

Aggregation is exact under micro-batching. Every aggregation mode returns ``(numerator,
denominator)`` whose denominators depend on the masks only, so for a batch split into micro-batches

    sum_i numerator_i / sum_i denominator_i  ==  full-batch aggregate.

The update step computes ``D = sum_i loss_denominator(mask_i, mode)`` once, then differentiates
``numerator_i / D`` on each micro-batch and adds the gradients: the accumulated gradient is the
full-batch gradient (not the original's per-micro-batch token-mean).

A full actor objective is assembled as (each term aggregated with the same mode):

    policy_loss = agg(pg_loss) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(logp, ref))
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from ragen_jax.registry import Registry
from ragen_jax.starpo.reductions import masked_mean, masked_row_mean

Array = jax.Array

LOG_RATIO_CLAMP = 20.0  # |log pi - log pi_old| clamp before exp, as verl
K3_DELTA_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _check_shapes(what: str, **arrays) -> None:
    """All named arrays must share one ``[B, L]`` shape (a static check, raised at trace time)."""
    shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items() if a is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{what}: expected arrays of one [B, L] shape, got {listed}.")


# ---------------------------------------------------------------------------------------------
# Loss aggregation: (numerator, denominator) pairs, exact under micro-batching
# ---------------------------------------------------------------------------------------------

AggregationFn = Callable[[Array, Array, Array], tuple[Array, Array]]
LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")


def _row_terms(x, mask, row_weights):
    m = mask.astype(jnp.float32)
    x = jnp.where(m > 0, x.astype(jnp.float32), 0.0)
    row_sum = jnp.sum(x * m, axis=-1)
    row_count = jnp.sum(m, axis=-1)
    w = jnp.ones(m.shape[0], jnp.float32) if row_weights is None else row_weights.astype(jnp.float32)
    return m, row_sum, row_count, w


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(x, mask, row_weights=None):
    """Mean over every masked token of the batch: ``(sum_b w_b sum_t m x, sum_b w_b sum_t m)``."""
    _, row_sum, row_count, w = _row_terms(x, mask, row_weights)
    return jnp.sum(w * row_sum), jnp.sum(w * row_count)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(x, mask, row_weights=None):
    """Mean over rows that have masked tokens of each row's token mean."""
    _, row_sum, row_count, w = _row_terms(x, mask, row_weights)
    has = row_count > 0
    row_mean = row_sum / jnp.maximum(row_count, 1.0)
    return jnp.sum(jnp.where(has, w * row_mean, 0.0)), jnp.sum(jnp.where(has, w, 0.0))


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(x, mask, row_weights=None):
    """Mean over rows that have masked tokens of each row's token sum.

    Rows without any masked token (e.g. dropped by the SNR filter through a zeroed mask) are not
    counted, so filtering never dilutes the loss.
    """
    _, row_sum, row_count, w = _row_terms(x, mask, row_weights)
    has = row_count > 0
    return jnp.sum(jnp.where(has, w * row_sum, 0.0)), jnp.sum(jnp.where(has, w, 0.0))


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(x, mask, row_weights=None):
    """verl v0.6.1's ``seq-mean-token-sum-norm``: every token's loss summed over the batch, over the
    static sequence width ``L`` — ``sum_b w_b sum_t m x / L`` — whatever the number of rows (the name
    says "seq-mean", verl's formula has none). The denominator is the constant ``L``: the update
    takes it once per mini-batch, so micro-batching stays exact, but ``combine`` of several parts
    (which adds denominators) is not this aggregate.

    Against ``drgrpo-token-sum-norm`` (the Dr. GRPO paper's objective) the loss and gradient are the
    number of rows times larger, which shifts how ``grad_clip``, the KL and entropy terms and the
    value loss weigh against the policy term.
    """
    m, row_sum, _, w = _row_terms(x, mask, row_weights)
    return jnp.sum(w * row_sum), jnp.asarray(float(m.shape[-1]), jnp.float32)


@LOSS_AGGREGATIONS.register("drgrpo-token-sum-norm")
def drgrpo_token_sum_norm(x, mask, row_weights=None):
    """The Dr. GRPO paper's objective (Liu et al., 2025): GRPO's per-response ``1/|o_i|`` replaced by a
    constant ``L`` (the static sequence width), the mean over responses kept:
    ``sum_b w_b sum_t m x / (sum_b w_b * L)``. Every row counts the same whatever its length;
    exact under micro-batching and ``combine``. (This is what this project called
    ``seq-mean-token-sum-norm`` before that name took verl's meaning.)
    """
    m, row_sum, _, w = _row_terms(x, mask, row_weights)
    return jnp.sum(w * row_sum), jnp.sum(w) * m.shape[-1]


def aggregate(x: Array, mask: Array, mode: str, row_weights: Optional[Array] = None) -> tuple[Array, Array]:
    """``(numerator, denominator)`` of ``x [B, L]`` over ``mask [B, L]`` in mode ``mode``.

    ``row_weights [B]`` (optional, e.g. the SNR filter's per-row weights) scale each row's
    contribution to both numerator and denominator: 0 removes the row, weights act as a weighted
    average. Denominators depend only on ``mask``/``row_weights``.
    """
    fn = LOSS_AGGREGATIONS.get(mode)
    _check_shapes(f"aggregate({mode!r})", x=x, mask=mask)
    if row_weights is not None and tuple(jnp.shape(row_weights)) != (jnp.shape(mask)[0],):
        raise ValueError(f"row_weights must be [B] = ({jnp.shape(mask)[0]},), got {tuple(jnp.shape(row_weights))}.")
    return fn(x, mask, row_weights)


def loss_denominator(mask: Array, mode: str, row_weights: Optional[Array] = None) -> Array:
    """The denominator ``aggregate`` would return, from the mask alone (for gradient accumulation)."""
    return aggregate(jnp.zeros(mask.shape, jnp.float32), mask, mode, row_weights)[1]


def combine(parts: Sequence[tuple[Array, Array]]) -> Array:
    """Combines per-micro-batch ``(numerator, denominator)`` pairs: ``sum num / sum den`` (0 if empty)."""
    num = sum(p[0] for p in parts)
    den = sum(p[1] for p in parts)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def aggregate_mean(x: Array, mask: Array, mode: str, row_weights: Optional[Array] = None) -> Array:
    """Scalar aggregate of one batch (``combine`` of a single part)."""
    return combine([aggregate(x, mask, mode, row_weights)])


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[Array, dict]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
# A registered loss declares what it needs beyond the common inputs as attributes of the function,
# and the update asks these, never a loss's name:
#   ``aggregation``: a sequence-level loss's own aggregation mode (``loss_aggregation``);
#   ``uses_noise``: it reads ``noise``, uniform [B, L] drawn from the update's key (``needs_noise``);
#   ``batch_statistics(hparams) -> bool``: under these settings it reads statistics of the whole
#     mini-batch under the current policy (``needs_batch_statistics``);
#   ``uses_behaviour_logp``: it reads ``behaviour_logp``, the log-probs recorded when the tokens were
#     sampled (``uses_behaviour_logp``).


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo_clip_loss(logp, old_logp, advantages, loss_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28,
                  clip_ratio_c=3.0, **_):
    """PPO clipped surrogate with asymmetric clip range and dual clip.

        delta = clamp(logp - old_logp, -20, 20);  rho = exp(delta)
        L1 = -A rho;  L2 = -A clip(rho, 1 - eps_low, 1 + eps_high);  Lc = max(L1, L2)
        L  = min(Lc, -A c) if A < 0 else Lc        (dual clip bounds the loss of negative advantages)

    Args: logp, old_logp, advantages float ``[B, L]``; loss_mask ``[B, L]``; ``clip_ratio_c > 1``
      (``None`` disables the dual clip).
    Returns: per-token loss ``[B, L]`` (0 outside the mask) and scalar metrics, token-means over the
      mask: ``pg_clipfrac`` (fraction with L2 > L1), ``pg_clipfrac_lower`` (fraction where the dual
      clip binds), ``ppo_kl`` (mean of old_logp - logp, the approximate KL).
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {clip_ratio_c}; use None to disable it.")
    _check_shapes("ppo_clip_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_max = jnp.maximum(loss_unclipped, loss_clipped)
    if clip_ratio_c is None:
        loss = loss_max
        dual_binds = jnp.zeros_like(loss, bool)
    else:
        loss_dual = -advantages * clip_ratio_c
        dual_binds = (advantages < 0) & (loss_max > loss_dual)
        loss = jnp.where(advantages < 0, jnp.minimum(loss_max, loss_dual), loss_max)
    mask = loss_mask.astype(bool)
    metrics = {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_lower": masked_mean(dual_binds.astype(jnp.float32), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return jnp.where(mask, loss, 0.0), metrics


def _ratio_metrics(log_ratio, mask, clipfrac=None, clipfrac_lower=None):
    zero = jnp.zeros((), jnp.float32)
    return {"pg_clipfrac": zero if clipfrac is None else masked_mean(clipfrac.astype(jnp.float32), mask),
            "pg_clipfrac_lower": zero if clipfrac_lower is None else masked_mean(clipfrac_lower.astype(jnp.float32), mask),
            "ppo_kl": masked_mean(-log_ratio, mask)}


def sequence_level(fn):
    """Marks a policy loss whose objective is a mean over sequences: whatever ``starpo.loss_agg_mode``
    says, its terms are aggregated ``seq-mean-token-mean`` (verl fixes the aggregation of GSPO and
    GMPO the same way; see ``StarPOConfig.actor_loss_agg_mode``)."""
    fn.aggregation = "seq-mean-token-mean"
    return fn


@POLICY_LOSSES.register("gspo")
@sequence_level
def gspo_loss(logp, old_logp, advantages, loss_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28, **_):
    """GSPO (Zheng et al., 2025, arXiv 2507.18071; verl's ``gspo``): a sequence-level importance ratio.

        s_i      = exp(mean_{t in y_i} (logp - old_logp))          (length-normalised sequence ratio)
        s_{i,t}  = sg(s_i) * pi(y_t) / sg(pi(y_t))                 (its value, with token gradients)
        L_{i,t}  = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    ``log s_{i,t}`` is clamped at 10. Aggregated over sequences (``seq-mean-token-mean``). GSPO's
    paper uses far tighter ranges (3e-4 / 4e-4) than token-level PPO: set ``clip_ratio_low/high``.
    Metrics: ``pg_clipfrac`` (tokens where the clipped term is larger), ``ppo_kl``;
    ``pg_clipfrac_lower`` is 0 (no dual clip).
    """
    _check_shapes("gspo_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    log_ratio = logp - old_logp
    seq_log_ratio = masked_row_mean(log_ratio, mask)
    log_s = jnp.minimum(logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)[:, None], 10.0)
    ratio = jnp.exp(log_s)
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = jnp.maximum(l1, l2)
    return jnp.where(mask, loss, 0.0), _ratio_metrics(log_ratio, mask, clipfrac=l2 > l1)


@POLICY_LOSSES.register("gpg")
def gpg_loss(logp, old_logp, advantages, loss_mask, **_):
    """GPG (Chu et al., 2025; verl's ``gpg``): the plain policy gradient ``L = -A logp``, no ratio and
    no clipping (one optimizer step per batch is what it assumes). ``ppo_kl`` is still reported."""
    _check_shapes("gpg_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    return jnp.where(mask, -advantages * logp, 0.0), _ratio_metrics(logp - old_logp, mask)


def _covariance(advantages, logp, mask):
    """Per-token centred product ``(A - mean A)(logp - mean logp)`` over the mask (no gradient)."""
    logp = jax.lax.stop_gradient(logp)
    return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


@POLICY_LOSSES.register("clip_cov")
def clip_cov_loss(logp, old_logp, advantages, loss_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28,
                  clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, noise=None, **_):
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's
    ``clip_cov``): PPO's clipped surrogate (no dual clip, no log-ratio clamp), with the gradient of
    a few high-covariance tokens cut. Among the tokens the PPO clip left alone whose
    ``cov = (A - mean A)(logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``,
    ``max(1, int(clip_cov_ratio * tokens))`` are drawn at random and their loss set to 0.

    ``noise`` (uniform ``[B, L]``, from the update's key) orders the draw; without it the first
    candidates in row-major order are taken. Statistics are over the (micro-)batch the loss sees, as
    in verl, so unlike the other losses this one depends on ``starpo.micro_batch_size``.
    Metrics: ``pg_clipfrac`` = fraction of tokens whose gradient was cut; ``ppo_kl``.
    """
    _check_shapes("clip_cov_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    cov = _covariance(advantages, logp, mask)
    candidate = mask & ~(l2 > l1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_clip = jnp.maximum(jnp.floor(clip_cov_ratio * jnp.sum(mask)), 1.0)
    order = jnp.arange(mask.size, dtype=jnp.float32).reshape(mask.shape) / mask.size if noise is None else noise
    flat = jnp.where(candidate, order, 2.0).reshape(-1)
    rank = jnp.zeros(flat.shape, jnp.int32).at[jnp.argsort(flat)].set(jnp.arange(flat.size, dtype=jnp.int32))
    cut = candidate & (rank.reshape(mask.shape) < n_clip)
    loss = jnp.where(cut, 0.0, jnp.maximum(l1, l2))
    return jnp.where(mask, loss, 0.0), _ratio_metrics(log_ratio, mask, clipfrac=cut)


clip_cov_loss.uses_noise = True


@POLICY_LOSSES.register("kl_cov")
def kl_cov_loss(logp, old_logp, advantages, loss_mask, *, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, **_):
    """KL-Cov (Cui et al., 2025; verl's ``kl_cov``): the unclipped surrogate ``-A rho``, plus
    ``ppo_kl_coef * |logp - old_logp|`` on the ``max(1, int(kl_cov_ratio * tokens))`` tokens with the
    largest covariance ``(A - mean A)(logp - mean logp)``. Statistics are over the (micro-)batch.
    Metrics: ``ppo_kl`` is the mean ``|logp - old_logp|`` (as verl reports it); clip fractions 0.
    """
    _check_shapes("kl_cov_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    log_ratio = logp - old_logp
    l1 = -advantages * jnp.exp(log_ratio)
    cov = jnp.where(mask, _covariance(advantages, logp, mask), -jnp.inf).reshape(-1)
    k = jnp.maximum(jnp.floor(jnp.sum(mask) * kl_cov_ratio), 1.0)
    rank = jnp.zeros(cov.shape, jnp.int32).at[jnp.argsort(-cov)].set(jnp.arange(cov.size, dtype=jnp.int32))
    top = mask & (rank.reshape(mask.shape) < k)
    # |d| with the subgradient 0 at d = 0 (torch's), not jnp.abs's 1: on-policy the penalty is flat.
    abs_kl = log_ratio * jax.lax.stop_gradient(jnp.sign(log_ratio))
    loss = jnp.where(top, l1 + ppo_kl_coef * abs_kl, l1)
    metrics = _ratio_metrics(log_ratio, mask)
    metrics["ppo_kl"] = masked_mean(jnp.abs(log_ratio), mask)
    return jnp.where(mask, loss, 0.0), metrics


@POLICY_LOSSES.register("geo_mean")
@sequence_level
def geo_mean_loss(logp, old_logp, advantages, loss_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28, **_):
    """GMPO, geometric-mean policy optimisation (Zhao et al., 2025, arXiv 2507.20673; verl's
    ``geo_mean``). Per token ``d = logp - old_logp`` is clipped to ``[-eps_low, eps_high]`` on the
    pessimistic side of the advantage's sign (``sgn(A) min(sgn(A) d, sgn(A) clip(d))``); per sequence

        rho_i = exp(mean_t d_t^clip),   A_i = mean_t A_t,   L_i = -A_i rho_i

    and the loss is the mean over sequences (``seq-mean-token-mean`` of ``L_i`` spread evenly over the
    row's tokens). Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = tokens clipped with A > 0 / A < 0.
    """
    _check_shapes("geo_mean_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    d = logp - old_logp
    d_clip = jnp.clip(d, -clip_ratio_low, clip_ratio_high)
    sgn = jnp.sign(advantages)
    d_min = sgn * jnp.minimum(sgn * d, sgn * d_clip)
    m = mask.astype(jnp.float32)
    n = jnp.sum(m, axis=-1)
    rho = jnp.exp(jnp.sum(jnp.where(mask, d_min, 0.0), axis=-1) / (n + 1e-8))
    adv = jnp.sum(jnp.where(mask, advantages, 0.0), axis=-1) / (n + 1e-8)
    per_row = -adv * rho
    clipped = d != d_clip
    # Every token of row i carries L_i, so the row's token mean (seq-mean-token-mean) is L_i.
    loss = jnp.where(mask, per_row[:, None], 0.0)
    return loss, _ratio_metrics(d, mask, clipfrac=clipped & (advantages > 0), clipfrac_lower=clipped & (advantages < 0))


ROLLOUT_IS_LEVELS = ("token", "sequence", "none")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric", "none")


def _masked_sum_rows(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0), axis=-1, keepdims=True)


def rollout_correction_terms(logp, old_logp, loss_mask, *, rollout_is="token", rollout_is_threshold=2.0,
                             rollout_rs="none", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5,
                             rollout_token_veto_threshold=0.0, **_):
    """verl's rollout correction (``compute_rollout_correction_and_rejection_mask``, v0.7): importance
    weights and the tokens rejection sampling and the veto leave in the batch. No gradient flows.

    With ``d = logp - old_logp`` per token (``old_logp``: the rollout policy's):
      * IS weight (``rollout_is``): token ``exp(clip(d, ±20))``; sequence ``exp(clip(sum_t d, ±20))``;
        ``none`` 1. Truncated at ``rollout_is_threshold``; 0 outside the mask.
      * rejection (``rollout_rs``): the token's / the sequence's ``exp(clip(sum d))`` / the geometric
        mean ``exp(clip(mean_t d))`` must lie in ``[rollout_rs_threshold_lower, rollout_rs_threshold]``.
      * veto (``rollout_token_veto_threshold`` > 0): a sequence holding any token with
        ``exp(d) < threshold`` is rejected whole.
    Returns a dict of ``[B, L]`` arrays: ``weights`` (truncated), ``truncated``, ``kept`` (mask tokens
    neither rejected nor vetoed), and the batch normaliser's parts, summable over micro-batches:
    ``weight_sum`` / ``weight_count`` (token level: sum of weights / tokens; sequence level: sum of
    the rows' weights / rows with tokens).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"starpo.rollout_is={rollout_is!r}; allowed: {', '.join(ROLLOUT_IS_LEVELS)}.")
    if rollout_rs not in ROLLOUT_RS_LEVELS:
        raise ValueError(f"starpo.rollout_rs={rollout_rs!r}; allowed: {', '.join(ROLLOUT_RS_LEVELS)}.")
    mask = loss_mask.astype(bool)
    d = jax.lax.stop_gradient(logp - old_logp)
    n_row = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
    seq_sum = _masked_sum_rows(d, mask)
    level_ratio = {
        "token": jnp.exp(jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
        "sequence": jnp.broadcast_to(jnp.exp(jnp.clip(seq_sum, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), d.shape),
        "geometric": jnp.broadcast_to(jnp.exp(jnp.clip(seq_sum / jnp.maximum(n_row, 1.0), -LOG_RATIO_CLAMP,
                                                       LOG_RATIO_CLAMP)), d.shape),
        "none": jnp.ones_like(d),
    }
    ratio = level_ratio[rollout_is]
    truncated = mask & (ratio > rollout_is_threshold) & (rollout_is != "none")
    weights = jnp.where(mask, ratio if rollout_is == "none" else jnp.minimum(ratio, rollout_is_threshold), 0.0)
    rs_ratio = level_ratio[rollout_rs]
    rejected = (rs_ratio > rollout_rs_threshold) | (rs_ratio < rollout_rs_threshold_lower)
    rejected = mask & rejected & (rollout_rs != "none")
    if rollout_token_veto_threshold > 0:
        catastrophic = mask & (d < jnp.log(jnp.float32(rollout_token_veto_threshold)))
        rejected = rejected | (mask & jnp.any(catastrophic, axis=-1, keepdims=True))
    has = n_row[:, 0] > 0
    if rollout_is == "sequence":
        row_w = jnp.sum(weights, axis=-1) / jnp.maximum(n_row[:, 0], 1.0)
        weight_sum, weight_count = jnp.sum(jnp.where(has, row_w, 0.0)), jnp.sum(has).astype(jnp.float32)
    else:
        weight_sum, weight_count = jnp.sum(weights), jnp.sum(mask).astype(jnp.float32)
    return {"weights": weights, "truncated": truncated, "kept": mask & ~rejected,
            "weight_sum": weight_sum, "weight_count": weight_count}


def needs_batch_statistics(policy_loss_name: str, hparams: dict) -> bool:
    """True when the policy loss depends on statistics of the whole (mini-)batch under the current
    policy (its ``batch_statistics`` says so; e.g. rollout correction's rejection, veto and weight
    normalisation): the update then measures them in a forward pass over the mini-batch before its
    gradient pass (exact under micro-batching)."""
    test = getattr(POLICY_LOSSES.get(policy_loss_name), "batch_statistics", None)
    return bool(test is not None and test(hparams))


def needs_noise(policy_loss_name: str) -> bool:
    """True when the policy loss reads ``noise`` (uniform ``[B, L]`` from the update's key)."""
    return bool(getattr(POLICY_LOSSES.get(policy_loss_name), "uses_noise", False))


def _rollout_correction_batch_statistics(hparams: dict) -> bool:
    return (hparams.get("rollout_rs", "none") != "none" or hparams.get("rollout_token_veto_threshold", 0.0) > 0
            or bool(hparams.get("rollout_is_batch_normalize", False)))


@POLICY_LOSSES.register("rollout_correction")
def rollout_correction_loss(logp, old_logp, advantages, loss_mask, *, rollout_is="token", rollout_is_threshold=2.0,
                            rollout_rs="none", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5,
                            rollout_token_veto_threshold=0.0, rollout_is_batch_normalize=False, kept_mask=None,
                            is_weight_mean=None, **_):
    """Policy gradient with rollout importance correction, no PPO clip (verl's ``bypass_mode`` with
    ``loss_type='reinforce'``, where the old log-probs *are* the rollout policy's):

        L = -A logp sg(w)    on the kept tokens (``rollout_correction_terms``), 0 elsewhere

    ``w`` is the truncated IS weight, divided by its batch mean with ``rollout_is_batch_normalize``
    (token level: over the batch's tokens; sequence level: over its sequences). Rejected and vetoed
    tokens leave the objective entirely, as in verl: the actor objective aggregates this term over
    the kept tokens (its own denominator; the entropy and KL terms keep the full mask) and
    ``ppo_kl`` is measured on them. Here ``old_logp`` are the sampling policy's log-probs recomputed by
    the trainer, so ``w`` corrects the drift inside one update (several mini-batches or PPO epochs).

    ``kept_mask`` / ``is_weight_mean`` (``[B, L]`` / scalar): the mini-batch's kept tokens and weight
    mean, measured by the update before its gradient pass (``needs_batch_statistics``); without them
    they are this batch's own. Metrics: ``ppo_kl``; ``pg_clipfrac`` = fraction of tokens whose weight
    was truncated, ``pg_clipfrac_lower`` = fraction rejected; ``kept_mask`` (the tokens the term
    aggregates over) and ``kept_count``.
    """
    _check_shapes("rollout_correction_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask)
    mask = loss_mask.astype(bool)
    terms = rollout_correction_terms(logp, old_logp, mask, rollout_is=rollout_is,
                                     rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs,
                                     rollout_rs_threshold=rollout_rs_threshold,
                                     rollout_rs_threshold_lower=rollout_rs_threshold_lower,
                                     rollout_token_veto_threshold=rollout_token_veto_threshold)
    kept = terms["kept"] if kept_mask is None else mask & kept_mask.astype(bool)
    weight = terms["weights"]
    if rollout_is_batch_normalize:
        mean = (terms["weight_sum"] / jnp.maximum(terms["weight_count"], 1.0) if is_weight_mean is None
                else jnp.asarray(is_weight_mean, jnp.float32))
        weight = jnp.where(mean > 1e-8, weight / jnp.where(mean > 1e-8, mean, 1.0), weight)
    loss = jnp.where(kept, -advantages * logp * jax.lax.stop_gradient(weight), 0.0)
    metrics = _ratio_metrics(logp - old_logp, kept, clipfrac=terms["truncated"])
    metrics["pg_clipfrac"] = masked_mean(terms["truncated"].astype(jnp.float32), mask)
    metrics["pg_clipfrac_lower"] = masked_mean((mask & ~kept).astype(jnp.float32), mask)
    metrics["kept_mask"] = kept
    metrics["kept_count"] = jnp.sum(kept).astype(jnp.float32)
    return loss, metrics


rollout_correction_loss.batch_statistics = _rollout_correction_batch_statistics


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo_loss(logp, old_logp, advantages, loss_mask, *, behaviour_logp=None, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, clip_ratio_c=3.0, decoupled_weight_cap=0.0, **_):
    """AReaL's decoupled PPO objective (Fu et al., 2025, "AReaL", arXiv 2505.24298, eq. 5), for batches
    sampled by an older policy than the one the update starts from (asynchronous rollout):

        rho = pi_theta / pi_prox                       (``logp - old_logp``; the clip is around pi_prox)
        w   = pi_prox / pi_behav                       (``old_logp - behaviour_logp``; no gradient)
        L   = w * PPO(rho, A)                          (``ppo_clip_loss``: asymmetric and dual clip)

    ``old_logp`` are the proximal policy's (the parameters this update starts from, scored by the
    trainer); ``behaviour_logp`` the policy's that sampled the tokens (the rollout's, recorded at
    sampling). On a synchronous batch the two agree and ``w`` is 1 up to the sampler's numerics.
    ``decoupled_weight_cap`` > 0: a token whose ``w`` exceeds it contributes 0 (it stays in the
    denominator, as AReaL's ``behav_imp_weight_cap``); 0 = no cap. ``|log w|`` is clamped at 20.

    Metrics: PPO's (``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` against pi_prox), plus
    ``behaviour_weight_mean`` / ``behaviour_weight_max`` over the mask (before the cap) and
    ``behaviour_capped`` (the fraction of tokens the cap removed).
    """
    if behaviour_logp is None:
        raise ValueError("policy_loss='decoupled_ppo' needs the behaviour policy's log-probs (behaviour_logp "
                         "[B, L], the rollout's sampler_logprobs); the StarPO update passes them")
    _check_shapes("decoupled_ppo_loss", logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask,
                  behaviour_logp=behaviour_logp)
    ppo, metrics = ppo_clip_loss(logp, old_logp, advantages, loss_mask, clip_ratio_low=clip_ratio_low,
                                 clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    mask = loss_mask.astype(bool)
    log_w = jnp.clip(jax.lax.stop_gradient(old_logp - behaviour_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = jnp.exp(log_w)
    capped = mask & (weight > decoupled_weight_cap) if decoupled_weight_cap > 0 else jnp.zeros_like(mask)
    loss = jnp.where(mask & ~capped, weight * ppo, 0.0)
    metrics = dict(metrics)
    metrics["behaviour_weight_mean"] = masked_mean(weight, mask)
    metrics["behaviour_weight_max"] = jnp.max(jnp.where(mask, weight, 0.0))
    metrics["behaviour_capped"] = masked_mean(capped.astype(jnp.float32), mask)
    return loss, metrics


decoupled_ppo_loss.uses_behaviour_logp = True


def uses_behaviour_logp(name: str) -> bool:
    """Whether the policy loss ``name`` reads the sampling policy's log-probs (``behaviour_logp``)."""
    return bool(getattr(POLICY_LOSSES.get(name), "uses_behaviour_logp", False))


def policy_loss(name: str, logp, old_logp, advantages, loss_mask, **hparams):
    """Looks up ``name`` in ``POLICY_LOSSES`` and applies it; see ``ppo_clip_loss`` for the contract.

    Every loss takes every hyper-parameter of ``StarPOConfig.policy_loss_hparams`` and ignores those
    it does not use, so one call site serves them all.
    """
    return POLICY_LOSSES.get(name)(logp, old_logp, advantages, loss_mask, **hparams)


def loss_aggregation(policy_loss_name: str, loss_agg_mode: str) -> str:
    """The aggregation the actor objective really uses: a sequence-level loss's own
    (``sequence_level``), else ``loss_agg_mode``."""
    return getattr(POLICY_LOSSES.get(policy_loss_name), "aggregation", loss_agg_mode)


# ---------------------------------------------------------------------------------------------
# KL estimators (per token, between the current policy and the reference)
# ---------------------------------------------------------------------------------------------

KLFn = Callable[[Array, Array], Array]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def _k1(logp, ref_logp):
    return logp - ref_logp


def _abs(logp, ref_logp):
    return jnp.abs(logp - ref_logp)


def _k2(logp, ref_logp):
    return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp, ref_logp):
    d = jnp.clip(ref_logp - logp, -K3_DELTA_CLAMP, K3_DELTA_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def _straight_through(estimator: KLFn) -> KLFn:
    """Forward value of ``estimator`` with the gradient of k2 (an unbiased KL gradient)."""

    def fn(logp, ref_logp):
        k2 = _k2(logp, ref_logp)
        return k2 + jax.lax.stop_gradient(estimator(logp, ref_logp) - k2)

    return fn


for _names, _fn in ((("kl", "k1"), _k1), (("abs",), _abs), (("mse", "k2"), _k2),
                    (("low_var_kl", "k3"), _k3)):
    for _name in _names:
        KL_ESTIMATORS.add(_name, _fn)
    for _name in _names:
        KL_ESTIMATORS.add(_name + "+", _straight_through(_fn))


def kl_penalty(name: str, logp: Array, ref_logp: Array) -> Array:
    """Per-token KL estimate ``[B, L]`` with estimator ``name`` (registry ``KL_ESTIMATORS``).

    ``kl``/``k1``: logp - ref; ``abs``: |logp - ref|; ``mse``/``k2``: (logp - ref)^2 / 2;
    ``low_var_kl``/``k3``: d = clamp(ref - logp, +-20), clamp(e^d - d - 1, +-10). A trailing ``+``
    keeps the forward value and takes the k2 gradient (straight-through).
    """
    return KL_ESTIMATORS.get(name)(logp, ref_logp)


def apply_kl_in_reward(token_rewards, logp, ref_logp, loss_mask, *, beta, estimator="kl"):
    """KL-in-reward shaping ``r <- r - beta * kl * m``.

    Returns ``(rewards [B, L], current_kl)`` where ``current_kl`` is the batch mean of per-sequence
    token-mean KL (rows without sampled tokens excluded) — the quantity the adaptive controller reads.
    """
    m = loss_mask.astype(jnp.float32)
    kl = jax.lax.stop_gradient(kl_penalty(estimator, logp, ref_logp)) * m
    num, den = seq_mean_token_mean(kl, m)
    current_kl = num / jnp.maximum(den, 1.0)
    return token_rewards - beta * kl, current_kl


def adaptive_kl_coef(beta, current_kl, n_steps, *, target_kl, horizon):
    """Adaptive KL controller step: ``beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``."""
    error = jnp.clip(current_kl / target_kl - 1.0, -0.2, 0.2)
    return beta * (1.0 + error * n_steps / horizon)


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def value_loss(values, old_values, returns, loss_mask, *, cliprange_value=0.5):
    """Clipped value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``, ``v_clip = clamp(v, v_old +- c)``.

    Args: values (current critic), old_values (critic at rollout time), returns float ``[B, L]``
      (all target-aligned, see ``advantages.align_to_targets``); loss_mask ``[B, L]``.
    Returns: per-token loss ``[B, L]`` (0 outside the mask; aggregate it with ``aggregate``) and scalar
      metrics over the mask: ``vf_clipfrac`` (clipped term larger), ``vpred_mean``.
    """
    _check_shapes("value_loss", values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    v_clipped = old_values + jnp.clip(values - old_values, -cliprange_value, cliprange_value)
    loss_plain = jnp.square(values - returns)
    loss_clipped = jnp.square(v_clipped - returns)
    mask = loss_mask.astype(bool)
    metrics = {
        "vf_clipfrac": masked_mean((loss_clipped > loss_plain).astype(jnp.float32), mask),
        "vpred_mean": masked_mean(values, mask),
    }
    return jnp.where(mask, 0.5 * jnp.maximum(loss_plain, loss_clipped), 0.0), metrics


# ---------------------------------------------------------------------------------------------
# Whole objectives as (numerator, denominator): what one micro-batch contributes
# ---------------------------------------------------------------------------------------------


def actor_objective(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    loss_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    row_weights: Optional[Array] = None,
    policy_loss_name: str = "ppo",
    entropy: Optional[Array] = None,
    entropy_coeff: float = 0.0,
    ref_logp: Optional[Array] = None,
    kl_type: str = "kl",
    kl_coef: float = 0.0,
    **policy_hparams,
) -> tuple[Array, Array, dict]:
    """Actor loss of one (micro-)batch as ``(numerator, denominator, metrics)``.

        loss = agg(pg_loss) - entropy_coeff * agg(entropy) + kl_coef * agg(kl(logp, ref_logp))

    All three terms share one mask and one aggregation mode, hence one denominator, so the objective
    is a single numerator over it: ``combine`` the pairs of all micro-batches (or divide each
    numerator by the total ``loss_denominator``) to get the exact full-batch loss and gradient.
    ``entropy`` (``[B, L]``, per-token entropies from ``logprobs.py``) and ``ref_logp`` are only needed when their
    coefficient is non-zero. ``policy_hparams`` go to the policy loss (``clip_ratio_low``, ...).

    A policy loss that rejects tokens (``rollout_correction`` with rejection or the veto; it returns
    ``kept_mask``) aggregates its term over the kept tokens, with its own denominator (``pg_den``),
    as verl does; the entropy and KL terms keep ``loss_mask``. The returned numerator then makes
    ``num / den`` this batch's objective; across micro-batches the exact objective is
    ``sum pg_num / sum pg_den + sum rest_num / sum den`` (what the StarPO update computes).

    Metrics (this micro-batch's values): ``pg_loss``, ``entropy`` (if given), ``kl_loss`` (if
    ``ref_logp`` is given) and the policy loss's own metrics (``pg_clipfrac``, ``pg_clipfrac_lower``,
    ``ppo_kl``); ``pg_num``, ``entropy_num``, ``kl_num`` are the terms' numerators, which
    accumulate exactly over micro-batches (the StarPO update sums them for its metrics).
    """
    per_token, metrics = policy_loss(policy_loss_name, logp, old_logp, advantages, loss_mask, **policy_hparams)
    loss_agg_mode = loss_aggregation(policy_loss_name, loss_agg_mode)
    metrics = dict(metrics)
    kept = metrics.pop("kept_mask", None)
    num, den = aggregate(per_token, loss_mask, loss_agg_mode, row_weights)
    safe_den = jnp.maximum(den, 1e-12)
    metrics["pg_num"] = num
    metrics["pg_loss"] = num / safe_den
    if kept is not None:  # a loss that rejects tokens: its term is aggregated over the kept ones
        num, pg_den = aggregate(per_token, kept, loss_agg_mode, row_weights)
        metrics["pg_num"], metrics["pg_den"] = num, pg_den
        metrics["pg_loss"] = jnp.where(pg_den > 0, num / jnp.maximum(pg_den, 1e-12), 0.0)
        num = metrics["pg_loss"] * den  # so that num / den is this batch's objective; see below
    if entropy is not None:
        ent_num, _ = aggregate(entropy, loss_mask, loss_agg_mode, row_weights)
        metrics["entropy_num"] = ent_num
        metrics["entropy"] = ent_num / safe_den
        num = num - entropy_coeff * ent_num
    elif entropy_coeff != 0.0:
        raise ValueError("entropy_coeff is non-zero but no per-token entropy [B, L] was passed.")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef is non-zero but no reference log-probs (ref_logp [B, L]) were passed.")
    if ref_logp is not None:
        kl_num, _ = aggregate(kl_penalty(kl_type, logp, ref_logp), loss_mask, loss_agg_mode, row_weights)
        metrics["kl_num"] = kl_num
        metrics["kl_loss"] = kl_num / safe_den
        num = num + kl_coef * kl_num
    if kept is not None:
        metrics["rest_num"] = num - metrics["pg_loss"] * den
    return num, den, metrics


def critic_objective(
    values: Array,
    old_values: Array,
    returns: Array,
    loss_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    row_weights: Optional[Array] = None,
    cliprange_value: float = 0.5,
) -> tuple[Array, Array, dict]:
    """Clipped value loss of one (micro-)batch as ``(numerator, denominator, metrics)``.

    Metrics: ``vf_loss`` (this micro-batch's aggregate), ``vf_clipfrac``, ``vpred_mean``.
    """
    per_token, metrics = value_loss(values, old_values, returns, loss_mask, cliprange_value=cliprange_value)
    num, den = aggregate(per_token, loss_mask, loss_agg_mode, row_weights)
    metrics = dict(metrics)
    metrics["vf_loss"] = num / jnp.maximum(den, 1e-12)
    return num, den, metrics
