"""StarPO losses: PPO policy loss, KL estimators, value loss and exact loss aggregation.

All ``[B, L]`` arrays follow the token-axis convention of ``advantages.py``: index ``t`` is about
token ``t`` as a target (its log-prob and entropy come from the logits at ``t - 1``, as
``starpo/logprobs.py`` computes them).

Aggregation is exact under micro-batching. Every aggregation mode returns ``(numerator,
denominator)`` whose denominators depend on the masks only, so for a batch split into micro-batches

    sum_i numerator_i / sum_i denominator_i  ==  full-batch aggregate.

The update step computes ``D = sum_i loss_denominator(mask_i, mode)`` once, then differentiates
``numerator_i / D`` on each micro-batch and adds the gradients: the accumulated gradient is the
full-batch gradient (not the original's per-micro-batch token-mean, spec §5.4 ⚠).

A full actor objective is assembled as (each term aggregated with the same mode):

    policy_loss = agg(pg_loss) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(logp, ref))
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from ragen_jax.starpo.registry import Registry

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


def _masked_mean(x: Array, mask: Array) -> Array:
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x, 0.0) * m) / jnp.maximum(jnp.sum(m), 1.0)


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
    """Token sum over a constant normaliser (Dr. GRPO): ``sum_b w_b sum_t m x / (sum_b w_b * L)``.

    ``L`` is the static sequence width, so every row counts the same whatever its length.

    This is the Dr. GRPO paper's objective (Liu et al., 2025: the ``1/|o_i|`` of GRPO replaced by a
    constant, the mean over the group's ``G`` responses kept). verl v0.6.1's ``agg_loss`` under the
    same name divides by ``L`` only — ``sum_b sum_t m x / L``, no mean over rows — so its loss (and
    gradient) is ours times the number of rows: a learning-rate scale at a fixed batch size, to
    which AdamW is invariant up to ``eps`` and gradient clipping. Multiply the learning rate (or
    ``grad_clip``) by the rows per mini-batch to match a verl run exactly.
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


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo_clip_loss(logp, old_logp, advantages, loss_mask, *, clip_ratio_low=0.2, clip_ratio_high=0.28,
                  clip_ratio_c=3.0):
    """PPO clipped surrogate with asymmetric clip range and dual clip (spec §5.4).

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
        "pg_clipfrac": _masked_mean((loss_clipped > loss_unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_lower": _masked_mean(dual_binds.astype(jnp.float32), mask),
        "ppo_kl": _masked_mean(-log_ratio, mask),
    }
    return jnp.where(mask, loss, 0.0), metrics


def policy_loss(name: str, logp, old_logp, advantages, loss_mask, **hparams):
    """Looks up ``name`` in ``POLICY_LOSSES`` and applies it; see ``ppo_clip_loss`` for the contract."""
    return POLICY_LOSSES.get(name)(logp, old_logp, advantages, loss_mask, **hparams)


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
    """KL-in-reward shaping ``r <- r - beta * kl * m`` (spec §5.4).

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
        "vf_clipfrac": _masked_mean((loss_clipped > loss_plain).astype(jnp.float32), mask),
        "vpred_mean": _masked_mean(values, mask),
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

    Metrics (this micro-batch's values): ``pg_loss``, ``entropy`` (if given), ``kl_loss`` (if
    ``ref_logp`` is given) and the policy loss's own metrics (``pg_clipfrac``, ``pg_clipfrac_lower``,
    ``ppo_kl``); ``pg_num``, ``entropy_num``, ``kl_num`` are the terms' numerators, which
    accumulate exactly over micro-batches (the StarPO update sums them for its metrics).
    """
    per_token, metrics = policy_loss(policy_loss_name, logp, old_logp, advantages, loss_mask, **policy_hparams)
    num, den = aggregate(per_token, loss_mask, loss_agg_mode, row_weights)
    metrics = dict(metrics)
    safe_den = jnp.maximum(den, 1e-12)
    metrics["pg_num"] = num
    metrics["pg_loss"] = num / safe_den
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
