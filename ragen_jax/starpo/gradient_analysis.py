"""RAGEN-2's gradient analysis: where the policy gradient of a batch comes from, by reward spread.

RAGEN-2 argues that groups whose episodes all scored alike carry almost no task signal, so their
share of the update is regulariser noise (entropy bonus, KL) — the reason its SNR filter helps. This
module measures that on a real batch, without changing any parameter: the batch's groups are put in
buckets by the spread of their episode scores (the group's reward std), and for every bucket the
gradient of each loss term is taken separately.

Buckets (RAGEN's ``gradient_reporter``): ``quantile`` — the groups sorted by reward std and cut into
``num_buckets`` equal-count buckets, the remainder going to the last; ``fixed_rv`` — std in
``[0, 1), [1, 2), …, [num_buckets - 1, ∞)``. Plus ``all``. Each is measured twice: on the whole
rollout batch (``grad_norm_prefilter/…``, advantages computed as if the filter kept everything) and on
what the SNR filter keeps (``grad_norm/…``, the batch the update trains on).

Per bucket ``b`` and component ``c`` in task (the policy loss), entropy (the entropy bonus,
``-entropy_coeff · H``) and kl (``kl_coef · KL`` when a KL loss is configured), each aggregated over the
bucket's rows with the actor's aggregation mode:
  ``grad_norm/b/c``            the global norm of that term's gradient,
  ``grad_norm/b/per_sample/c`` divided by the bucket's episodes, ``grad_norm/b/per_token/c`` by its tokens,
  ``grad_norm/b/loss/c``       the term's value,
  ``grad_norm/b/reward_std_{mean,min,max}``, ``grad_norm/b/sample_count``, ``grad_norm/b/sample_pct``.
A bucket with no episode reports zeros. All of it is one compiled function of (train state, batch).

``cfg``: the ``config.starpo`` section (``ragen_jax.config.StarPOConfig``), ``filter_cfg``: a ``FilterConfig``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ragen_jax.registry import Registry
from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.rollout.turn_rows import turn_rows
from ragen_jax.starpo import advantages as adv_lib, losses, reductions, update as upd
from ragen_jax.starpo.logprobs import sequence_logprobs

BUCKETINGS = Registry("gradient-analysis bucketing")
COMPONENTS = ("task", "entropy", "kl")


@BUCKETINGS.register("quantile")
def quantile_buckets(group_std: jax.Array, considered: jax.Array, num_buckets: int) -> jax.Array:
    """int32 ``[G]`` bucket of each considered group: rank by std (ties by index) among the considered
    groups, ``num_buckets`` buckets of ``n // num_buckets`` groups, the remainder in the last one
    (with fewer groups than buckets, one group each); -1 for groups not considered."""
    n = jnp.sum(considered)
    key = jnp.where(considered, group_std, jnp.inf)
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    size = jnp.maximum(n // num_buckets, 1)
    return jnp.where(considered, jnp.minimum(rank // size, num_buckets - 1), -1).astype(jnp.int32)


@BUCKETINGS.register("fixed_rv")
def fixed_rv_buckets(group_std: jax.Array, considered: jax.Array, num_buckets: int) -> jax.Array:
    """int32 ``[G]``: std in ``[k, k + 1)`` goes to bucket ``k``, the last bucket open-ended; -1 for
    groups not considered."""
    bucket = jnp.minimum(jnp.floor(group_std), num_buckets - 1).astype(jnp.int32)
    return jnp.where(considered, bucket, -1)


def bucket_names(bucketing: str, num_buckets: int) -> tuple[str, ...]:
    """The bucket labels used in the metric names (``q1``… for quantiles, ``rv0-1``… for fixed)."""
    if bucketing == "quantile":
        return tuple(f"q{k + 1}" for k in range(num_buckets))
    return tuple(f"rv{k}-{k + 1}" for k in range(num_buckets - 1)) + (f"rv{num_buckets - 1}+",)


def loss_terms(graphdefs, cfg, shared_prefix_len: int, params, rest, data: dict, mask) -> dict:
    """The three loss terms (task, entropy, KL; each aggregated over ``mask [R, L]``) of the rows ``data``."""
    agg = cfg.actor_loss_agg_mode
    policy = nnx.merge(graphdefs.policy, params, rest)
    logp, entropy, _ = sequence_logprobs(policy, data["tokens"], chunk_size=cfg.logprob_chunk_size,
                                         temperature=cfg.scoring_temperature, shared_prefix_len=shared_prefix_len)
    behaviour = {"behaviour_logp": data["behaviour_logp"]} if "behaviour_logp" in data else {}
    per_token, _ = losses.policy_loss(cfg.policy_loss, logp, data["old_logp"], data["advantages"], mask,
                                      **cfg.policy_loss_hparams, **behaviour)
    out = {"task": losses.aggregate_mean(per_token, mask, agg),
           "entropy": -cfg.entropy_coeff * losses.aggregate_mean(entropy, mask, agg)}
    if cfg.use_kl_loss:
        out["kl"] = cfg.kl_coef * losses.aggregate_mean(losses.kl_penalty(cfg.kl_type, logp, data["ref_logp"]),
                                                        mask, agg)
    return out


def measure_terms(graphdefs, cfg, shared_prefix_len: int, state, data: dict, row_mask):
    """Gradient norms and values of each loss term over the rows ``row_mask [R]`` (one forward, one VJP
    per term). -> ``({term: (norm, value)}, tokens)``."""
    mask = data["loss_mask"] & row_mask[:, None]
    values, vjp = jax.vjp(lambda p: loss_terms(graphdefs, cfg, shared_prefix_len, p, state.policy_rest, data, mask),
                          state.params)
    out = {}
    for name, value in values.items():
        cot = {k: jnp.asarray(1.0 if k == name else 0.0, v.dtype) for k, v in values.items()}
        (grad,) = vjp(cot)
        out[name] = (optax.global_norm(grad), value)
    return out, jnp.sum(mask).astype(jnp.float32)


def _bucket_metrics(p: str, measured: dict, tokens, groups, group_std, episodes, total_episodes) -> dict:
    """One bucket's metrics under the prefix ``p``: each term's gradient norm (whole, per episode, per
    token) and value, the bucket's reward-std range and its share of the episodes."""
    metrics = {}
    for comp, (norm, value) in measured.items():
        metrics[p + comp] = norm
        metrics[p + "per_sample/" + comp] = norm / jnp.maximum(episodes, 1.0)
        metrics[p + "per_token/" + comp] = norm / jnp.maximum(tokens, 1.0)
        metrics[p + "loss/" + comp] = value
    std_in = jnp.where(groups, group_std, 0.0)
    metrics[p + "reward_std_mean"] = jnp.sum(std_in) / jnp.maximum(jnp.sum(groups), 1)
    metrics[p + "reward_std_min"] = jnp.where(jnp.any(groups), jnp.min(jnp.where(groups, group_std, jnp.inf)), 0.0)
    metrics[p + "reward_std_max"] = jnp.max(std_in)
    metrics[p + "sample_count"] = episodes
    metrics[p + "sample_pct"] = episodes / total_episodes
    return metrics


def analyse_buckets(measure, bucketing: str, num_buckets: int, group_size: int, data: dict, rows_per_episode: int,
                    group_std, considered, prefix: str) -> dict:
    """Every bucket's metrics (and ``all``'s) for one view of the batch; ``measure(row_mask)`` is
    ``measure_terms`` on the update batch ``data``."""
    names = bucket_names(bucketing, num_buckets) + ("all",)
    buckets = BUCKETINGS.get(bucketing)(group_std, considered, num_buckets)  # [G]
    episode_bucket = jnp.repeat(buckets, group_size)  # [B]
    row_bucket = jnp.repeat(episode_bucket, rows_per_episode)  # rows of the update batch
    considered_rows = jnp.repeat(jnp.repeat(considered, group_size), rows_per_episode)
    total_episodes = jnp.maximum(jnp.sum(considered).astype(jnp.float32) * group_size, 1.0)
    metrics = {}
    # One bucket at a time (lax.map): the buckets' forward and backward passes over the whole
    # batch never hold their activations at once (unrolled, Sokoban's batch needed > 22 GB).
    row_masks = jnp.stack([considered_rows if name == "all" else row_bucket == k for k, name in enumerate(names)])
    measured_all, tokens_all = jax.lax.map(measure, row_masks)
    for k, name in enumerate(names):
        groups = considered if name == "all" else buckets == k
        episodes = jnp.sum(groups).astype(jnp.float32) * group_size
        measured = {comp: (norm[k], value[k]) for comp, (norm, value) in measured_all.items()}
        metrics.update(_bucket_metrics(f"{prefix}/{name}/", measured, tokens_all[k], groups, group_std, episodes,
                                       total_episodes))
    return metrics


def make_gradient_analysis(graphdefs, cfg, filter_cfg, *, group_size: int,
                           bucketing: str = "quantile", num_buckets: int = 6, shared_prefix_len: int = 0,
                           per_turn_rows=None, jit: bool = True, placement=None):
    """Builds ``analyse(train_state, trajectory) -> metrics`` (float32 scalars; nothing is updated).

    The arguments are ``make_update_step``'s; ``bucketing`` (quantile | fixed_rv) and ``num_buckets``
    choose the buckets. The batch must be the one the update would see next (same state).
    """
    BUCKETINGS.validate(bucketing)
    if not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets must be a positive int, got {num_buckets!r}.")
    critic_values = upd.make_loss_fn(graphdefs, cfg, shared_prefix_len)[1]

    def analyse(state, traj: Trajectory):
        batch = traj.batch_size
        _, mini_size = cfg.mini_batch_layout(batch)
        _, micro_size = cfg.micro_batch_layout(mini_size)
        traj, _ = upd.shape_rewards(cfg, traj)
        loss_mask = traj.loss_mask.astype(bool)
        rows = None if per_turn_rows is None else turn_rows(traj, *per_turn_rows)
        old = upd.score_batch(graphdefs, cfg, critic_values, state, traj, rows, micro_size, shared_prefix_len)
        filt = upd.filter_groups(filter_cfg, traj, old, loss_mask, group_size)
        scores = adv_lib.episode_scores(traj.token_rewards)
        group_std = reductions.group_std(reductions.group_view(scores, group_size))
        metrics = {}
        keep_all = filt.replace(row_weights=jnp.ones_like(filt.row_weights), kept_ratio=jnp.ones_like(filt.kept_ratio))
        for prefix, f, considered in (("grad_norm_prefilter", keep_all, jnp.ones_like(group_std, bool)),
                                      ("grad_norm", filt, filt.group_weights > 0)):
            train_mask = loss_mask & (f.row_weights > 0)[:, None]
            advantages, returns, _ = upd.estimate_advantages(cfg, filter_cfg, traj, old, f, loss_mask, train_mask,
                                                            group_size)
            data, rows_per_episode = upd.update_batch(cfg, traj, train_mask, f.row_weights, old, advantages, returns,
                                                      rows)
            measure = lambda m, data=data: measure_terms(graphdefs, cfg, shared_prefix_len, state, data, m)
            metrics.update(analyse_buckets(measure, bucketing, num_buckets, group_size, data, rows_per_episode,
                                           group_std, considered, prefix))
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    if not jit:
        return analyse
    if placement is None:
        return jax.jit(analyse)
    return placement.jit(analyse, out_shardings=placement.replicated)
