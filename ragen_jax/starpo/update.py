"""The StarPO update step: one jitted function from a ``Trajectory`` batch to new parameters + metrics.

    graphdefs, state = init_train_state(policy, starpo_cfg, key=key, critic=critic)
    update = make_update_step(graphdefs, starpo_cfg, filter_cfg, collapse_cfg, group_size=16)
    state, metrics = update(state, trajectory)           # or update(state, trajectory, key)

``cfg`` / ``starpo_cfg`` is the ``config.starpo`` section (``ragen_jax.config.StarPOConfig``),
``filter_cfg`` a ``FilterConfig``, ``collapse_cfg`` a ``CollapseConfig``: the config package sits
above this step (it checks their names against the registries here), so they are not imported.

Inside that one compiled function, top to bottom:

  1. old log-probs of the sampled tokens under the current policy (at the rollout's temperature, recomputed, compared
     with the sampler's), reference log-probs when a KL term is used, critic values;
  2. collapse diagnostics (MI proxy) on the pre-filter batch, under ``lax.cond`` on the step counter;
  3. SNR filter: a weight per group, repeated over its rows (0 = dropped; nothing is gathered out);
  4. episode scores → reward normalisation → (optional KL-in-reward) → advantages and returns;
  5. ``ppo_epochs`` × mini-batches (``lax.scan``), each an optimizer step whose gradient is
     accumulated over micro-batches (``lax.scan``) from (numerator, denominator) losses, so
     token-mean stays exact under accumulation (not the original's per-micro-batch mean):
     clipped policy loss − entropy bonus + KL loss, and the clipped value loss on the critic. Rows
     are permuted so the kept ones come first: mini-batches made only of filtered-out rows have no
     token and are skipped, so the number of optimizer steps follows the kept batch; a last, partly
     filled mini-batch is averaged over its own tokens (the original instead pads the batch with
     duplicated samples, which biases group statistics);
  6. global-norm clipping → AdamW with linear warm-up; a non-finite gradient, a mini-batch with no
     kept token, or a batch the filter emptied leaves parameters and optimizer state untouched and is
     counted;
  7. metrics.

Each stage is a module-level pure function (``score_batch``, ``diagnose_collapse``,
``apply_filter``, ``estimate_advantages``, ``training_data``, ``train_on_batch`` over
``make_mini_batch_step``'s optimizer step, ``advance_counters``); ``StarPOUpdate.__call__`` calls
them in this order, reading the batch layout from an ``UpdatePlan``. ``make_update_step`` checks the
train state against the configuration, builds a ``StarPOUpdate`` and compiles it.

Models are used functionally: ``nnx.split`` outside, ``nnx.merge(graphdef, params, rest)`` inside.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from ragen_jax.models.lora import has_lora
from ragen_jax.rollout.turn_rows import turn_rows
from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.starpo import advantages as adv_lib
from ragen_jax.starpo import collapse as collapse_lib
from ragen_jax.starpo import losses
from ragen_jax.starpo import overlong, reductions
from ragen_jax.starpo import snr_filter
from ragen_jax.starpo.logprobs import (make_logprob_fn, make_prefix_cached_cross_scorer, positions_for,
                                      frozen_rows_residual, score_slots, sequence_logprobs, unscored_count)

PyTree = Any


class Graphdefs(NamedTuple):
    """Static halves of the models (``nnx.split``); the array halves live in ``TrainState``."""

    policy: Any
    critic: Any  # None | a ValueHead (shared trunk) | a Critic (own trunk)
    reference: Any  # None | the reference Decoder (same class as the policy)


@struct.dataclass
class TrainState:
    params: PyTree  # policy nnx.Param state
    opt_state: PyTree
    critic_params: PyTree  # None without a critic
    critic_opt_state: PyTree
    ref_params: PyTree  # None unless a KL term needs reference log-probs
    rest: PyTree  # non-Param state of (policy, critic, reference), carried unchanged
    step: jax.Array  # int32 [] update calls so far
    optimizer_steps: jax.Array  # int32 [] actor optimizer steps actually applied (drives the warm-up)
    critic_optimizer_steps: jax.Array  # int32 []
    key: jax.Array  # PRNG key, advanced on every call that is not given one
    collapse: collapse_lib.CollapseState
    consecutive_empty: jax.Array  # int32 [] consecutive updates the SNR filter left empty
    num_empty_skipped: jax.Array  # int32 [] updates skipped because the filter kept nothing
    num_nonfinite_skipped: jax.Array  # int32 [] optimizer steps skipped for a non-finite gradient

    # ``rest`` stays a plain (policy, critic, reference) tuple so checkpoints keep their layout; these
    # name its parts.
    @property
    def policy_rest(self) -> PyTree:
        """The policy's non-Param state; with LoRA the frozen pretrained base (``params`` holds the adapters)."""
        return self.rest[0]

    @property
    def critic_rest(self) -> PyTree:
        return self.rest[1]

    @property
    def reference_rest(self) -> PyTree:
        return self.rest[2]

    def with_policy_rest(self, policy_rest: PyTree) -> "TrainState":
        return self.replace(rest=(policy_rest,) + tuple(self.rest[1:]))


# ---------------------------------------------------------------------------------------------------
# Optimizer and state


def learning_rate_schedule(lr: float, warmup_steps: int, schedule: str = "constant", decay_steps: int = 0,
                           min_lr_ratio: float = 0.0) -> optax.Schedule:
    """Linear warm-up to ``lr`` over ``warmup_steps`` optimizer steps (first step lr/warmup), then
    constant, or (``schedule="cosine"``) a cosine decay to ``min_lr_ratio * lr`` over the next
    ``decay_steps`` optimizer steps, constant after that."""
    if schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=min_lr_ratio)
    else:
        after = optax.constant_schedule(lr)
    if warmup_steps <= 1:
        return after
    warm = optax.linear_schedule(lr / warmup_steps, lr, warmup_steps - 1)
    return optax.join_schedules([warm, after], [warmup_steps - 1])


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run in float32 whatever the parameters' dtype: its state (AdamW's two moments) is
    float32, gradients are upcast before it and its updates cast back to each parameter's dtype.

    With ``model.param_dtype=bfloat16`` this is "bf16 parameters, fp32 optimizer state": 10 bytes per
    parameter instead of 12 with float32 weights (bfloat16 moments would be 6, but lose the second
    moment's precision). The weights themselves keep bfloat16's: an update smaller than half a
    weight's bfloat16 spacing (0.2–0.4% of its magnitude) rounds away, which at RAGEN's actor_lr=1e-6 is
    most of them — for fine-tuning prefer ``param_dtype=float32`` with ``dtype=bfloat16`` compute.
    With float32 parameters the casts are the identity.
    """
    def to_f32(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return inner.init(to_f32(params))

    def update(updates, state, params=None):
        new, state = inner.update(to_f32(updates), state, None if params is None else to_f32(params))
        return jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates), state

    return optax.GradientTransformation(init, update)


def make_optimizer(lr: float, cfg) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (decoupled weight decay on every parameter, as torch's AdamW),
    with float32 state and arithmetic (``in_float32``)."""
    return in_float32(optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate_schedule(lr, cfg.warmup_steps, cfg.lr_schedule, cfg.lr_decay_steps, cfg.min_lr_ratio),
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        ),
    ))


def init_train_state(
    policy: nnx.Module,
    cfg,
    *,
    key: jax.Array,
    critic: Optional[nnx.Module] = None,
    reference: Optional[nnx.Module] = None,
) -> tuple[Graphdefs, TrainState]:
    """Splits the models and builds the optimizer states.

    Args:
      policy: the Decoder being trained.
      critic: ``critic_mode='shared'``: a ``ValueHead`` read on the policy's hidden states;
        ``'separate'``: a ``Critic`` (own trunk + head); ``'none'``: must be None.
      reference: the frozen model of the KL terms; None = a copy of the policy as it is now.
      key: PRNG key of the pair sampling / shuffling.
    """
    mode = cfg.critic_mode
    if mode == "none" and critic is not None:
        raise ValueError(f"starpo.critic resolves to 'none' for adv_estimator={cfg.adv_estimator!r}, but a "
                         "critic module was given; drop it or pick an estimator that uses one (gae).")
    if mode != "none" and critic is None:
        kind = "models.ValueHead(cfg, rngs=...)" if mode == "shared" else "models.Critic(cfg, rngs=...)"
        raise ValueError(f"starpo.critic={mode!r} needs a critic module: pass critic={kind}.")
    if mode == "shared" and not hasattr(critic, "score"):
        raise ValueError("starpo.critic='shared' reads a value head on the policy's hidden states: pass a "
                         f"models.ValueHead, not a {type(critic).__name__}.")
    if mode == "separate" and not hasattr(critic, "trunk"):
        raise ValueError("starpo.critic='separate' needs its own trunk: pass a models.Critic, not a "
                         f"{type(critic).__name__}.")

    if reference is not None and not cfg.uses_reference:
        raise ValueError("a reference model was given but no KL term uses it; set starpo.use_kl_loss=True "
                         "or starpo.kl_in_reward=True, or drop the reference.")
    lora = has_lora(policy)
    # With LoRA adapters only they are trained (and hold optimizer state); the base rides in ``rest``.
    policy_gd, params, policy_rest = nnx.split(policy, nnx.LoRAParam if lora else nnx.Param, ...)
    critic_gd = critic_params = critic_rest = critic_opt = None
    if critic is not None:
        critic_gd, critic_params, critic_rest = nnx.split(critic, nnx.Param, ...)
        critic_opt = make_optimizer(cfg.critic_lr, cfg).init(critic_params)
    ref_gd = ref_params = ref_rest = None
    if cfg.uses_reference:
        if reference is None and lora:
            # The frozen base is the reference: the policy's own base weights with zero adapters
            # (``ref_rest`` None = read ``policy_rest``, so the base is held once).
            ref_gd, ref_params, ref_rest = policy_gd, jax.tree.map(jnp.zeros_like, params), None
        elif reference is None:
            ref_gd, ref_params, ref_rest = policy_gd, jax.tree.map(jnp.copy, params), policy_rest
        else:
            ref_gd, ref_params, ref_rest = nnx.split(reference, nnx.Param, ...)
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(
        params=params,
        opt_state=make_optimizer(cfg.actor_lr, cfg).init(params),
        critic_params=critic_params,
        critic_opt_state=critic_opt,
        ref_params=ref_params,
        rest=(policy_rest, critic_rest, ref_rest),
        step=zero,
        optimizer_steps=zero,
        critic_optimizer_steps=zero,
        key=key,
        collapse=collapse_lib.init_collapse_state(),
        consecutive_empty=zero,
        num_empty_skipped=zero,
        num_nonfinite_skipped=zero,
    )
    # Every leaf gets its own buffer (shared zeros would break buffer donation in the update).
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), state)
    return Graphdefs(policy_gd, critic_gd, ref_gd), state


# ---------------------------------------------------------------------------------------------------
# Helpers


def _rows_in_chunks(fn, arrays: dict, rows_per_chunk: int) -> dict:
    """Applies ``fn`` (dict of [m, ...] -> dict of [m, ...]) to ``rows_per_chunk`` rows at a time."""
    batch = jax.tree.leaves(arrays)[0].shape[0]
    n = batch // rows_per_chunk
    chunked = jax.tree.map(lambda x: x.reshape((n, rows_per_chunk) + x.shape[1:]), arrays)
    out = jax.lax.map(fn, chunked)
    return jax.tree.map(lambda x: x.reshape((batch,) + x.shape[2:]), out)


def _select(pred: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _all_finite(tree: PyTree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.ones((), bool)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


# ---------------------------------------------------------------------------------------------------
# The update step


def frozen_layers_kept(updates: PyTree, frozen_layers: int) -> PyTree:
    """``updates`` with every entry of layers ``< frozen_layers`` zeroed (``ModelConfig.lora_top_layers``):
    their gradient is zero already, and this keeps AdamW's decoupled weight decay off them too.
    Layers are ``("layers", i, ...)`` in a looped model, a leading [L] axis under ``("layers", ...)``
    in a scanned one."""
    if not frozen_layers:
        return updates

    def keep(path, u):
        keys = [getattr(k, "key", None) for k in path]
        if len(keys) < 2 or keys[0] != "layers":
            return u
        if isinstance(keys[1], int):
            return jnp.zeros_like(u) if keys[1] < frozen_layers else u
        trained = (jnp.arange(u.shape[0]) >= frozen_layers).reshape((-1,) + (1,) * (u.ndim - 1))
        return jnp.where(trained, u, jnp.zeros_like(u))

    return jax.tree_util.tree_map_with_path(keep, updates)


def _guarded_step(tx, grads, opt_state, params, has_tokens, frozen_layers: int = 0):
    """One optax step applied only when there were tokens and every gradient is finite.

    Returns ``(params, opt_state, grad_norm, finite, applied)``; when not applied, params and optimizer
    state are returned unchanged, so a NaN/inf gradient never reaches the weights. The layers below
    ``frozen_layers`` are left as they are (``frozen_layers_kept``).
    """
    grad_norm = optax.global_norm(grads)
    finite = _all_finite(grads)
    applied = has_tokens & finite
    updates, new_opt = tx.update(grads, opt_state, params)
    updates = frozen_layers_kept(updates, frozen_layers)
    params = _select(applied, optax.apply_updates(params, updates), params)
    opt_state = _select(applied, new_opt, opt_state)
    return params, opt_state, grad_norm, finite, applied


def make_batch_statistics(graphdefs: Graphdefs, cfg, shared_prefix_len: int = 0):
    """``batch_statistics(params, rest, mb) -> (sums, kept [m, L])``: what a batch-dependent policy
    loss (``losses.needs_batch_statistics``) needs of the whole mini-batch under the current
    parameters, for one micro-batch (forward only): the tokens it keeps, their share of the policy
    term's denominator and the IS weights' sums."""
    chunk = cfg.logprob_chunk_size
    policy_hparams = cfg.policy_loss_hparams

    def batch_statistics(params, rest, mb):
        policy = nnx.merge(graphdefs.policy, params, rest[0])
        logp, _, _ = sequence_logprobs(policy, mb["tokens"], chunk_size=chunk, temperature=cfg.scoring_temperature,
                                       shared_prefix_len=shared_prefix_len, slots=mb.get("score_slots"))
        terms = losses.rollout_correction_terms(jax.lax.stop_gradient(logp), mb["old_logp"], mb["loss_mask"],
                                                **policy_hparams)
        sums = {"pg_den": losses.loss_denominator(terms["kept"], cfg.actor_loss_agg_mode, mb["row_weights"]),
                "weight_sum": terms["weight_sum"], "weight_count": terms["weight_count"]}
        return sums, terms["kept"]

    return batch_statistics


def make_loss_fn(graphdefs: Graphdefs, cfg, shared_prefix_len: int = 0, single_pass: bool = False):
    """Returns ``(loss_fn, critic_values)``.

    ``loss_fn(params, critic_params, rest, mb, den, value_den) -> (loss, aux)`` is one micro-batch's
    share of the mini-batch objective: ``losses.actor_objective``'s numerator (clipped policy loss −
    entropy_coeff · entropy + kl_coef · KL) divided by the mini-batch denominator ``den``, plus
    ``losses.critic_objective``'s clipped value loss numerator over ``value_den`` (token-mean). Summing its
    gradients over the micro-batches of a mini-batch gives exactly the gradient of the mini-batch
    aggregate. ``mb`` holds ``tokens``, ``loss_mask``, ``row_weights``, ``old_logp``, ``advantages``
    (+ ``ref_logp`` with a KL loss,
    ``old_values`` and ``returns`` with a critic), all ``[m, ...]``. ``shared_prefix_len``: see
    ``make_update_step``. ``single_pass`` (see ``is_single_pass``): the old log-probs are this forward's
    own, stop-gradient, and ``mb`` holds ``sampler_logp`` instead of ``old_logp``; the aux then also
    carries the sampler agreement (``sampler_diff_sum`` and ``sampler_diff_max`` over the mask).
    """
    mode = cfg.critic_mode
    chunk = cfg.logprob_chunk_size
    policy_hparams = cfg.policy_loss_hparams
    uses_behaviour = losses.uses_behaviour_logp(cfg.policy_loss)

    def critic_values(critic_params, critic_rest, tokens, policy_hidden):
        """Values ``V(tokens[:t])`` [B, L] aligned to targets (the value head read at t - 1)."""
        critic = nnx.merge(graphdefs.critic, critic_params, critic_rest)
        if mode == "shared":
            # The value loss trains the head only; the policy's trunk sees the policy loss alone.
            raw = critic(jax.lax.stop_gradient(policy_hidden))
        else:
            raw, _ = critic(tokens, positions_for(tokens))
        return adv_lib.align_to_targets(raw.astype(jnp.float32))

    def micro_loss(params, critic_params, rest, mb, den, value_den, pg_den=None, is_weight_mean=None):
        """Loss of one micro-batch as its share of the mini-batch aggregate: numerator / (mini-batch den).
        ``pg_den`` / ``is_weight_mean``: a batch-dependent policy loss's mini-batch statistics (its
        kept tokens come in ``mb["kept_mask"]``); its term is then ``pg_num / pg_den``."""
        policy = nnx.merge(graphdefs.policy, params, rest[0])
        logp, entropy, hidden = sequence_logprobs(policy, mb["tokens"], chunk_size=chunk,
                                                  temperature=cfg.scoring_temperature,
                                                  shared_prefix_len=shared_prefix_len, slots=mb.get("score_slots"),
                                                  lower=mb.get("frozen_residual"))
        mask, row_w = mb["loss_mask"], mb["row_weights"]
        old_logp = jax.lax.stop_gradient(logp) if single_pass else mb["old_logp"]
        batch_terms = {} if pg_den is None else {"kept_mask": mb["kept_mask"], "is_weight_mean": is_weight_mean}
        behaviour = {"behaviour_logp": mb["behaviour_logp"]} if uses_behaviour else {}
        actor_num, _, terms = losses.actor_objective(
            logp, old_logp, mb["advantages"], mask, loss_agg_mode=cfg.actor_loss_agg_mode, row_weights=row_w,
            policy_loss_name=cfg.policy_loss, entropy=entropy, entropy_coeff=cfg.entropy_coeff,
            # kl_coef weighs the KL loss only when use_kl_loss is on (verl's kl_loss_coef): switching the
            # loss off on a config that sets a coefficient must not demand reference log-probs.
            ref_logp=mb["ref_logp"] if cfg.use_kl_loss else None, kl_type=cfg.kl_type,
            kl_coef=cfg.kl_coef if cfg.use_kl_loss else 0.0,
            noise=mb.get("policy_noise"), **policy_hparams, **batch_terms, **behaviour)
        if pg_den is None:
            loss = _safe_div(actor_num, den)
        else:  # rejected tokens leave the policy term's denominator (the other terms keep the mask)
            loss = _safe_div(terms["pg_num"], pg_den) + _safe_div(terms["rest_num"], den)
        aux = _actor_sums(terms, mask, cfg.use_kl_loss, uses_behaviour)
        n_tok = aux["n_tokens"]
        if single_pass:
            diff = jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp) - mb["sampler_logp"]), 0.0)
            aux["sampler_diff_sum"], aux["sampler_diff_max"] = jnp.sum(diff), jnp.max(diff)
        if mode != "none":
            values = critic_values(critic_params, rest[1], mb["tokens"], hidden)
            v_num, _, v_metrics = losses.critic_objective(values, mb["old_values"], mb["returns"], mask,
                                                          loss_agg_mode="token-mean", row_weights=row_w,
                                                          cliprange_value=cfg.cliprange_value)
            loss = loss + _safe_div(v_num, value_den)
            aux["vf_num"] = v_num
            aux["vf_clipfrac"] = v_metrics["vf_clipfrac"] * n_tok
            aux["vpred_mean"] = v_metrics["vpred_mean"] * n_tok
        return loss, aux

    return micro_loss, critic_values


def _actor_sums(terms: dict, mask, use_kl_loss: bool, uses_behaviour: bool) -> dict:
    """A micro-batch's actor terms as sums that accumulate over micro-batches: the numerators, and the
    per-token metrics weighted by their token counts (divided by the counts after accumulation)."""
    aux = {"pg_num": terms["pg_num"], "entropy_num": terms["entropy_num"]}
    if use_kl_loss:
        aux["kl_num"] = terms["kl_num"]
    n_tok = jnp.sum(mask.astype(jnp.float32))
    for name in ("pg_clipfrac", "pg_clipfrac_lower"):
        aux[name] = terms[name] * n_tok
    n_kl = terms.get("kept_count", n_tok)  # ppo_kl is over the tokens the policy term keeps
    aux["ppo_kl"] = terms["ppo_kl"] * n_kl
    aux["n_kl_tokens"] = n_kl
    aux["n_tokens"] = n_tok
    if uses_behaviour:  # the decoupled objective's weights pi_prox / pi_behav
        aux["behaviour_weight_sum"] = terms["behaviour_weight_mean"] * n_tok
        aux["behaviour_capped"] = terms["behaviour_capped"] * n_tok
        aux["behaviour_weight_max"] = terms["behaviour_weight_max"]  # a maximum: accumulated as one
    return aux


def is_single_pass(cfg, filter_cfg, num_mini: int, per_turn: bool) -> bool:
    """True when the update is one optimizer step on the whole batch from the parameters that sampled it
    (one epoch, one mini-batch) and nothing else reads the pre-update scores: no critic, no reference, no
    KL in the reward, no entropy-based SNR filter, whole transcripts. The old log-probs are then exactly
    the loss pass's own (ratio 1), so the separate scoring forward is skipped: a third less compute,
    the same update (Tunix's GRPO learner with ``num_iterations=1`` makes the same saving).
    Per-turn rows keep the scoring pass: the single pass measures the sampler agreement only on the
    rows it trains on, and a batch the filter empties would then report none; on the SmolLM2 step
    the single pass saved 2 of 42 s (``benchmarks/results_llm_step.md``)."""
    return (cfg.ppo_epochs == 1 and num_mini == 1 and cfg.critic_mode == "none" and not cfg.uses_reference
            and not cfg.kl_in_reward and snr_filter.GROUP_SCORES.get(filter_cfg.metric).source != "entropy"
            and not per_turn and not losses.needs_batch_statistics(cfg.policy_loss, cfg.policy_loss_hparams))


# ---------------------------------------------------------------------------------------------------
# The stages of one update (module-level and pure: each reads its inputs from its arguments)


def score_batch(graphdefs: Graphdefs, cfg, critic_values, state: TrainState, traj: Trajectory,
                rows, micro_size: int, shared_prefix_len: int, max_scored: int = 0,
                keep_frozen: bool = False) -> dict:
    """Stage 1, no gradient: old log-probs (at the sampling temperature) and entropies, reference log-probs when a
    KL term needs them, critic values; each float32 ``[B, L]`` on the transcript. On per-turn rows
    (``rows``) every reply is scored in the window it was sampled in, then written back. ``max_scored``
    > 0: log-probs and entropies at the sampled tokens only (at most that many a row), 0 elsewhere.
    ``keep_frozen``: also ``frozen_residual`` ``[rows, L(-P), D]``, the rows' residual stream after the
    frozen layers (row layout, not written back), for the loss pass to start from."""
    policy_rest, critic_rest, ref_rest = state.rest
    chunk = cfg.logprob_chunk_size

    def score_rows(chunk_rows):
        policy = nnx.merge(graphdefs.policy, state.params, policy_rest)
        slots = chunk_rows.get("score_slots")
        out = {}
        if keep_frozen:  # the loss pass starts from it (starpo.keep_frozen_residual)
            out["frozen_residual"] = frozen_rows_residual(policy, chunk_rows["tokens"],
                                                          shared_prefix_len=shared_prefix_len)
        logp, entropy, hidden = sequence_logprobs(policy, chunk_rows["tokens"], chunk_size=chunk,
                                                  temperature=cfg.scoring_temperature,
                                                  shared_prefix_len=shared_prefix_len, slots=slots,
                                                  lower=out.get("frozen_residual"))
        out.update(logp=logp, entropy=entropy)
        if cfg.uses_reference:
            ref = nnx.merge(graphdefs.reference, state.ref_params, policy_rest if ref_rest is None else ref_rest)
            out["ref_logp"], _, _ = sequence_logprobs(ref, chunk_rows["tokens"], chunk_size=chunk,
                                                      temperature=cfg.scoring_temperature,
                                                      with_entropy=False, shared_prefix_len=shared_prefix_len,
                                                      slots=slots)
        if cfg.critic_mode != "none":
            out["values"] = critic_values(state.critic_params, critic_rest, chunk_rows["tokens"], hidden)
        return out

    view = traj if rows is None else rows.view
    inputs = {"tokens": view.tokens}
    if max_scored:
        inputs["score_slots"] = score_slots(view.loss_mask.astype(bool), max_scored)
    if rows is None:
        old = _rows_in_chunks(score_rows, inputs, micro_size)
    else:
        old = _rows_in_chunks(score_rows, inputs, micro_size * traj.max_turns)
        old = {k: v if k == "frozen_residual" else rows.scatter(v, traj.sampler_logprobs) for k, v in old.items()}
    return jax.lax.stop_gradient(old)


def sampler_agreement(cfg, old: dict, traj: Trajectory, loss_mask: jax.Array) -> dict:
    """How far the recomputed log-probs are from the sampler's (0 up to float error), and the
    reference KL: the first metrics of an update."""
    sampled = loss_mask & traj.valid_mask
    diff = jnp.abs(old["logp"] - traj.sampler_logprobs)
    metrics = {"actor/sampler_logprob_abs_diff_mean": reductions.masked_mean(diff, sampled),
               "actor/sampler_logprob_abs_diff_max": jnp.max(jnp.where(sampled, diff, 0.0))}
    if cfg.uses_reference:
        metrics["actor/ref_kl"] = reductions.masked_mean(old["logp"] - old["ref_logp"], loss_mask)
    return metrics


def diagnose_collapse(graphdefs: Graphdefs, cfg, collapse_cfg, state: TrainState,
                      traj: Trajectory, rows, key: jax.Array, num_groups: int):
    """Stage 2: the MI proxy on the pre-filter batch, scored by the policy before this update
    (computed on the steps ``collapse.should_compute`` picks). -> ``(metrics, collapse state)``."""
    policy = nnx.merge(graphdefs.policy, state.params, state.policy_rest)
    chunk = cfg.logprob_chunk_size
    cross_fn = make_prefix_cached_cross_scorer(policy, logprob_chunk_size=chunk) if collapse_cfg.prefix_cache else None
    return collapse_lib.maybe_collapse_metrics(make_logprob_fn(policy, chunk_size=chunk), traj, state.collapse, key,
                                               state.step, collapse_cfg, num_groups=num_groups, cross_fn=cross_fn,
                                               turn_rows=rows)


def filter_groups(filter_cfg, traj: Trajectory, old: dict, loss_mask: jax.Array, group_size: int):
    """Stage 3: the SNR filter over groups, on the raw episode scores (normalised scores would all
    have the same spread). -> ``snr_filter`` result: ``row_weights [B]`` (0 = dropped), metrics."""
    return snr_filter.rollout_filter(
        group_size=group_size,
        episode_scores=adv_lib.episode_scores(traj.token_rewards),
        response_lengths=traj.response_length,
        row_entropy=snr_filter.row_mean_entropy(old["entropy"], loss_mask) if "entropy" in old else None,
        metric=filter_cfg.metric,
        strategy=filter_cfg.strategy,
        value=filter_cfg.value,
        filter_type=filter_cfg.filter_type,
        include_zero=filter_cfg.include_zero,
        top_p_mode=filter_cfg.top_p_mode,
        selection_eps=filter_cfg.eps,
    )


def shape_rewards(cfg, traj: Trajectory) -> tuple[Trajectory, dict]:
    """Stage 0: reward shaping before anything reads a reward — DAPO's overlong penalty
    (``overlong_buffer_len`` > 0). -> ``(trajectory, metrics)``."""
    if not cfg.overlong_buffer_len:
        return traj, {}
    if cfg.overlong_max_len is None:
        raise ValueError("starpo.overlong_buffer_len is set but starpo.overlong_max_len is None; a run's "
                         "configuration sets it to rollout.max_new_tokens (set it when building the update alone).")
    traj, penalty = overlong.shape_overlong(traj, max_len=cfg.overlong_max_len, buffer_len=cfg.overlong_buffer_len,
                                            factor=cfg.overlong_penalty_factor)
    turns = jnp.maximum(jnp.sum(traj.turn_mask), 1)
    return traj, {"rollout/overlong_penalty_mean": jnp.sum(penalty) / turns,
                  "rollout/overlong_penalised_turns": jnp.sum(penalty < 0) / turns}


def advantage_extras(cfg, traj: Trajectory, group_size: int = 1) -> dict:
    """What the configured estimator reads beyond token rewards and its settings, as its registry
    entry declares them (``advantages.estimator_inputs``)."""
    return adv_lib.estimator_inputs(cfg, traj, group_size)


def estimate_advantages(cfg, filter_cfg, traj: Trajectory, old: dict, filt,
                        loss_mask: jax.Array, train_mask: jax.Array, group_size: int):
    """Stage 4: episode scores → reward normalisation → (KL in the reward) → advantages and returns.

    -> ``(advantages [B, L], returns [B, L], metrics)``; advantages are scaled by the filter's
    ``loss_scaling`` of the kept ratio."""
    metrics = {}
    kept = filt.row_weights > 0
    scores = adv_lib.episode_scores(traj.token_rewards)
    norm_scores = adv_lib.normalize_scores(scores, method=cfg.reward_norm, group_size=group_size,
                                           grouping=cfg.reward_norm_grouping)
    if cfg.use_turn_scores:
        token_rewards = traj.token_rewards.astype(jnp.float32)
    else:
        token_rewards = adv_lib.place_at_last_token(norm_scores.astype(jnp.float32), loss_mask)
    if cfg.kl_in_reward:
        token_rewards, current_kl = losses.apply_kl_in_reward(
            token_rewards, old["logp"], old["ref_logp"], loss_mask, beta=cfg.kl_in_reward_coef,
            estimator=cfg.kl_type)
        metrics["actor/reward_kl_penalty"] = current_kl
    values = old.get("values")
    extras = advantage_extras(cfg, traj, group_size)
    advantages, returns = adv_lib.compute_advantages(
        cfg.estimator, token_rewards, values, train_mask, traj.turn_ids, group_size=group_size,
        gamma=cfg.gamma, lam=cfg.lam, high_level_gamma=cfg.high_level_gamma, whiten=cfg.whiten,
        grpo_length_weight=cfg.length_weighting, extras=extras)
    diagnostics = adv_lib.ADVANTAGE_ESTIMATORS.get(cfg.estimator).diagnostics
    if diagnostics is not None:
        metrics.update(diagnostics(extras, kept, group_size))
    advantages = advantages * snr_filter.filter_loss_scale(filter_cfg.loss_scaling, filt.kept_ratio)
    metrics.update(reductions.masked_stats(advantages, train_mask, "critic/advantages"))
    metrics.update(reductions.masked_stats(returns, train_mask, "critic/returns"))
    metrics.update(reductions.masked_stats(norm_scores, kept, "critic/score"))
    if values is not None:
        metrics.update(reductions.masked_stats(values, train_mask, "critic/values"))
    return advantages, returns, metrics


def update_batch(cfg, traj: Trajectory, train_mask: jax.Array, row_weights: jax.Array, old: dict,
                 advantages: jax.Array, returns: jax.Array, rows) -> tuple[dict, int]:
    """Stage 5's input: what the mini-batches are cut from, ``[R, ...]`` per key, and the rows per
    episode (1 on whole transcripts; ``max_turns`` on per-turn rows, episode-major, where a row
    trains only its own turn's tokens)."""
    data = {
        "tokens": traj.tokens,
        "loss_mask": train_mask,
        "row_weights": row_weights,
        "advantages": advantages,
    }
    if "logp" in old:
        data["old_logp"] = old["logp"]
    else:  # single pass: the loss forward supplies the old log-probs and compares them with the sampler's
        data["sampler_logp"] = traj.sampler_logprobs
    if losses.uses_behaviour_logp(cfg.policy_loss):  # the sampling policy's, for the decoupled objective
        data["behaviour_logp"] = traj.sampler_logprobs
    if cfg.use_kl_loss:
        data["ref_logp"] = old["ref_logp"]
    if cfg.critic_mode != "none":
        data["old_values"] = old.get("values")
        data["returns"] = returns
    if rows is None:
        if "frozen_residual" in old:
            data["frozen_residual"] = old["frozen_residual"]
        return data, 1
    row_w_rows = row_weights[rows.episode]  # [B*T]
    data = {k: row_w_rows if k == "row_weights" else rows.view.tokens if k == "tokens" else rows.gather(v)
            for k, v in data.items()}
    if "frozen_residual" in old:  # computed on the rows already
        data["frozen_residual"] = old["frozen_residual"]
    data["loss_mask"] = data["loss_mask"] & rows.view.loss_mask
    return data, traj.max_turns


def mini_batches_in_order(data: dict, kept: jax.Array, key: jax.Array, *, shuffle: bool, num_mini: int,
                          mini_size: int, rows_per_episode: int) -> dict:
    """One epoch's mini-batches ``[num_mini, mini_size * rows_per_episode, ...]``: kept rows first (in
    order, or shuffled among themselves), so dropped rows fill the last mini-batches, which then have
    no token and are skipped — the optimizer-step count follows the kept batch as in the original,
    without any shape change. An episode's turn rows stay together."""
    batch = kept.shape[0]
    tie = jax.random.uniform(key, (batch,)) if shuffle else jnp.arange(batch) / batch
    order = jnp.argsort(jnp.where(kept, 0.0, 2.0) + tie)
    if rows_per_episode > 1:
        order = (order[:, None] * rows_per_episode + jnp.arange(rows_per_episode)[None]).reshape(-1)
    return jax.tree.map(lambda x: x[order].reshape((num_mini, mini_size * rows_per_episode) + x.shape[1:]), data)


def advance_counters(state: TrainState, empty: jax.Array, counts: dict, filter_cfg):
    """Stage 7: the state's step counters and their metrics. -> ``(updates for state.replace, metrics)``."""
    consecutive_empty = jnp.where(empty, state.consecutive_empty + 1, 0)
    num_empty = state.num_empty_skipped + empty.astype(jnp.int32)
    num_nonfinite = state.num_nonfinite_skipped + counts["nonfinite"]
    updates = dict(step=state.step + 1, optimizer_steps=state.optimizer_steps + counts["applied"],
                   critic_optimizer_steps=state.critic_optimizer_steps + counts["critic_applied"],
                   consecutive_empty=consecutive_empty, num_empty_skipped=num_empty,
                   num_nonfinite_skipped=num_nonfinite)
    metrics = {
        "train/optimizer_steps": counts["applied"].astype(jnp.float32),
        "train/nonfinite_grad_skipped": counts["nonfinite"].astype(jnp.float32),
        "train/nonfinite_grad_skipped_total": num_nonfinite.astype(jnp.float32),
        "rollout/empty_after_filter": empty.astype(jnp.float32),
        "rollout/consecutive_empty_after_filter_steps": consecutive_empty.astype(jnp.float32),
        "rollout/empty_after_filter_total": num_empty.astype(jnp.float32),
        "early_stop/empty_filter": (consecutive_empty >= filter_cfg.empty_stop_steps).astype(jnp.float32),
    }
    return updates, metrics


# ---------------------------------------------------------------------------------------------------
# One optimizer step: a mini-batch's gradient accumulated over its micro-batches, then AdamW


def _mini_batch_statistics(batch_statistics, params, rest, micro: dict):
    """A batch-dependent policy loss's statistics of the whole mini-batch under the current policy
    (rejection, the veto and the weights' mean), measured once in a forward pass before the gradient
    pass uses them. -> ``(micro with kept_mask, pg_den, is_weight_mean)``."""
    def measure(acc, md):
        sums, kept_md = batch_statistics(params, rest, md)
        return jax.tree.map(jnp.add, acc, sums), kept_md

    zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("pg_den", "weight_sum", "weight_count")}
    sums, kept_masks = jax.lax.scan(measure, zero_sums, micro)
    return dict(micro, kept_mask=kept_masks), sums["pg_den"], _safe_div(sums["weight_sum"], sums["weight_count"])


def _accumulated_gradients(grad_fn, params, c_params, rest, micro: dict, loss_args: tuple, has_tokens, single: bool):
    """The mini-batch's gradients (policy, critic) and summed loss terms over its micro-batches
    ``[num_micro, m, ...]``; ``loss_args`` = ``(den, value_den, pg_den, is_weight_mean)``. A mini-batch
    with no token (filtered-out rows, or a batch the filter emptied) is not run at all: its
    forward/backward would be thrown away, and with a selective SNR filter that is most of them."""
    def accumulate(acc, md):
        (_, aux), grads = grad_fn(params, c_params, rest, md, *loss_args)
        grads, summed = jax.tree.map(jnp.add, acc, (grads, aux))
        for name in ("sampler_diff_max", "behaviour_weight_max"):  # maxima over the micro-batches, not sums
            if name in aux:
                summed[name] = jnp.maximum(acc[1][name], aux[name])
        return (grads, summed), None

    zero_aux = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        jax.eval_shape(lambda md: grad_fn(params, c_params, rest, md, *loss_args)[0][1],
                       jax.tree.map(lambda x: x[0], micro)),
    )
    zero_grads = jax.tree.map(jnp.zeros_like, (params, c_params))
    return jax.lax.cond(has_tokens, lambda _: jax.lax.scan(accumulate, (zero_grads, zero_aux), micro)[0],
                        lambda _: (zero_grads, zero_aux), None)


def _actor_step_metrics(cfg, aux: dict, den, pg_den, grad_norm, finite, single: bool) -> dict:
    """The policy's metrics of one optimizer step, from the summed loss terms."""
    metrics = {
        "actor/pg_loss": _safe_div(aux["pg_num"], den if pg_den is None else pg_den),
        "actor/entropy_loss": _safe_div(aux["entropy_num"], den),
        "actor/grad_norm": jnp.where(finite, grad_norm, 0.0),
        "actor/pg_clipfrac": _safe_div(aux["pg_clipfrac"], aux["n_tokens"]),
        "actor/pg_clipfrac_lower": _safe_div(aux["pg_clipfrac_lower"], aux["n_tokens"]),
        "actor/ppo_kl": _safe_div(aux["ppo_kl"], aux["n_kl_tokens"]),
    }
    if cfg.use_kl_loss:
        metrics["actor/kl_loss"] = _safe_div(aux["kl_num"], den)
    if "behaviour_weight_sum" in aux:
        metrics["actor/behaviour_weight_mean"] = _safe_div(aux["behaviour_weight_sum"], aux["n_tokens"])
        metrics["actor/behaviour_weight_max"] = aux["behaviour_weight_max"]
        metrics["actor/behaviour_capped"] = _safe_div(aux["behaviour_capped"], aux["n_tokens"])
    if single:
        metrics["actor/sampler_logprob_abs_diff_mean"] = _safe_div(aux["sampler_diff_sum"], aux["n_tokens"])
        metrics["actor/sampler_logprob_abs_diff_max"] = aux["sampler_diff_max"]
        metrics["actor/entropy"] = _safe_div(aux["entropy_num"], den)
    return metrics


def make_mini_batch_step(graphdefs: Graphdefs, cfg, shared_prefix_len: int = 0):
    """``mini_batch_step(carry, mb, *, num_micro, rest, skip, single) -> (carry, (metrics, applied))``:
    one optimizer step on a mini-batch ``mb`` (``[M, ...]`` per key), its gradient accumulated over
    ``num_micro`` micro-batches from (numerator, denominator) losses, so token-mean stays exact;
    global-norm clipping and AdamW on the policy (and the critic). ``carry`` = ``(params, opt_state,
    critic_params, critic_opt_state, counts)``; a step with no token, ``skip`` set, or a non-finite
    gradient leaves parameters and optimizer state untouched and is counted."""
    actor_tx = make_optimizer(cfg.actor_lr, cfg)
    critic_tx = make_optimizer(cfg.critic_lr, cfg)
    grad_fns = {flag: jax.value_and_grad(make_loss_fn(graphdefs, cfg, shared_prefix_len, single_pass=flag)[0],
                                         argnums=(0, 1), has_aux=True) for flag in (False, True)}
    batch_dependent = losses.needs_batch_statistics(cfg.policy_loss, cfg.policy_loss_hparams)
    batch_statistics = make_batch_statistics(graphdefs, cfg, shared_prefix_len)

    def mini_batch_step(carry, mb, *, num_micro: int, rest, skip: jax.Array, single: bool):
        params, opt_state, c_params, c_opt, counts = carry
        mask, row_w = mb["loss_mask"], mb["row_weights"]
        den = losses.loss_denominator(mask, cfg.actor_loss_agg_mode, row_w)
        value_den = losses.loss_denominator(mask, "token-mean", row_w)
        micro = jax.tree.map(lambda x: x.reshape((num_micro, x.shape[0] // num_micro) + x.shape[1:]), mb)
        pg_den = is_weight_mean = None
        if batch_dependent:
            micro, pg_den, is_weight_mean = _mini_batch_statistics(batch_statistics, params, rest, micro)
        has_tokens = (den > 0) & ~skip
        (grads, c_grads), aux = _accumulated_gradients(grad_fns[single], params, c_params, rest, micro,
                                                       (den, value_den, pg_den, is_weight_mean), has_tokens, single)
        frozen = nnx.merge(graphdefs.policy, params, rest[0]).cfg.frozen_layers
        params, opt_state, grad_norm, finite, apply = _guarded_step(actor_tx, grads, opt_state, params, has_tokens,
                                                                    frozen)
        nonfinite = has_tokens & ~finite
        metrics = _actor_step_metrics(cfg, aux, den, pg_den, grad_norm, finite, single)
        c_apply = jnp.zeros((), bool)
        if cfg.critic_mode != "none":
            c_params, c_opt, c_grad_norm, c_finite, c_apply = _guarded_step(critic_tx, c_grads, c_opt, c_params,
                                                                             has_tokens)
            nonfinite = nonfinite | (has_tokens & ~c_finite)
            metrics.update({
                "critic/vf_loss": _safe_div(aux["vf_num"], value_den),
                "critic/vf_clipfrac": _safe_div(aux["vf_clipfrac"], aux["n_tokens"]),
                "critic/vpred_mean": _safe_div(aux["vpred_mean"], aux["n_tokens"]),
                "critic/grad_norm": jnp.where(c_finite, c_grad_norm, 0.0),
            })
        # Metrics of a step that did not run must not leak NaN/inf into the averages.
        metrics = {k: jnp.where(apply, v, 0.0) for k, v in metrics.items()}
        counts = {
            "applied": counts["applied"] + apply.astype(jnp.int32),
            "critic_applied": counts["critic_applied"] + c_apply.astype(jnp.int32),
            "nonfinite": counts["nonfinite"] + nonfinite.astype(jnp.int32),
        }
        return (params, opt_state, c_params, c_opt, counts), (metrics, apply)

    return mini_batch_step


# ---------------------------------------------------------------------------------------------------
# The plan of one update and the stages that need it


@struct.dataclass
class UpdatePlan:
    """What one update does with a batch of this shape (all static under ``jit``): the mini- and
    micro-batch layout, whether the scoring forward is folded into the loss pass, and how many loss
    tokens a row holds."""

    batch: int = struct.field(pytree_node=False)
    num_groups: int = struct.field(pytree_node=False)
    num_mini: int = struct.field(pytree_node=False)
    mini_size: int = struct.field(pytree_node=False)
    num_micro: int = struct.field(pytree_node=False)
    micro_size: int = struct.field(pytree_node=False)
    single: bool = struct.field(pytree_node=False)  # ``is_single_pass``: stage 1 folded into the loss pass
    max_scored: int = struct.field(pytree_node=False)  # loss tokens a row holds at most; 0 = every position


def plan_update(cfg, filter_cfg, traj: Trajectory, rows, *, group_size: int, single_pass: Optional[bool],
                reply_tokens: int) -> UpdatePlan:
    """The ``UpdatePlan`` of ``traj`` (``rows``: its per-turn rows, or None on whole transcripts)."""
    batch, _ = traj.tokens.shape
    if batch % group_size:
        raise ValueError(f"Trajectory batch of {batch} rows is not a whole number of groups of "
                         f"group_size={group_size}.")
    num_mini, mini_size = cfg.mini_batch_layout(batch)
    num_micro, micro_size = cfg.micro_batch_layout(mini_size)
    single = single_pass is not False and is_single_pass(cfg, filter_cfg, num_mini, rows is not None)
    # The most loss tokens a row holds (a turn row: one reply; a transcript: one per turn).
    max_scored = reply_tokens * (1 if rows is not None else traj.max_turns) if cfg.logprobs_at == "loss_tokens" else 0
    return UpdatePlan(batch=batch, num_groups=batch // group_size, num_mini=num_mini, mini_size=mini_size,
                      num_micro=num_micro, micro_size=micro_size, single=single, max_scored=max_scored)


def apply_filter(cfg, filter_cfg, traj: Trajectory, old: dict, loss_mask: jax.Array, group_size: int):
    """Stage 3: the SNR filter's row weights, and DAPO's overlong filter (episodes that were cut off do
    not train). -> ``(filter result, metrics)``."""
    filt = filter_groups(filter_cfg, traj, old, loss_mask, group_size)
    metrics = dict(filt.metrics)
    if cfg.overlong_filter:
        cut = overlong.cut_episodes(traj)
        filt = filt.replace(row_weights=jnp.where(cut, 0.0, filt.row_weights),
                            is_empty=filt.is_empty | ~jnp.any(~cut & (filt.row_weights > 0)))
        metrics["rollout/overlong_filtered_rows"] = jnp.sum(cut).astype(jnp.float32)
    return filt, metrics


def training_data(cfg, plan: UpdatePlan, traj: Trajectory, train_mask, row_weights, old: dict, advantages,
                  returns, rows, key_shuffle):
    """Stage 5's input (``update_batch``) with what the loss pass reads beyond it: the loss tokens'
    slots, and the policy loss's noise when it draws one. -> ``(data, rows_per_episode, metrics)``."""
    metrics = {}
    data, rows_per_episode = update_batch(cfg, traj, train_mask, row_weights, old, advantages, returns, rows)
    if plan.max_scored:
        data["score_slots"] = score_slots(data["loss_mask"], plan.max_scored)
        # 0 while every reply fits the budget the trainer passed; a count here means loss tokens
        # were left out of the loss (a reply longer than reply_tokens).
        metrics["actor/unscored_loss_tokens"] = unscored_count(data["loss_mask"], plan.max_scored).astype(jnp.float32)
    if losses.needs_noise(cfg.policy_loss):  # e.g. the order in which Clip-Cov draws the tokens it cuts
        data["policy_noise"] = jax.random.uniform(jax.random.fold_in(key_shuffle, 1), data["loss_mask"].shape)
    return data, rows_per_episode, metrics


def train_on_batch(mini_batch_step, cfg, plan: UpdatePlan, state: TrainState, data: dict, kept, rows_per_episode: int,
                   skip, key_shuffle):
    """Stages 5–6: ``ppo_epochs`` × mini-batches (``lax.scan``), one optimizer step each.
    -> ``((params, opt_state, critic_params, critic_opt_state, counts), metrics)``, each metric the
    mean over the steps that were applied."""
    def epoch(carry, epoch_key):
        batches = mini_batches_in_order(data, kept, epoch_key, shuffle=cfg.shuffle, num_mini=plan.num_mini,
                                        mini_size=plan.mini_size, rows_per_episode=rows_per_episode)
        step = lambda c, mb: mini_batch_step(c, mb, num_micro=plan.num_micro, rest=state.rest, skip=skip,
                                             single=plan.single)
        return jax.lax.scan(step, carry, batches)

    counts0 = {k: jnp.zeros((), jnp.int32) for k in ("applied", "critic_applied", "nonfinite")}
    carry0 = (state.params, state.opt_state, state.critic_params, state.critic_opt_state, counts0)
    epoch_keys = jax.random.split(key_shuffle, cfg.ppo_epochs)
    carry, (step_metrics, applied) = jax.lax.scan(epoch, carry0, epoch_keys)
    n_applied = jnp.sum(applied)
    return carry, {name: _safe_div(jnp.sum(per_step), n_applied.astype(jnp.float32))
                   for name, per_step in step_metrics.items()}


# ---------------------------------------------------------------------------------------------------
# The update: the stages in order


@dataclasses.dataclass(frozen=True)
class StarPOUpdate:
    """What an update needs that does not change between calls: the configuration sections, the
    batch layout it was built for and the compiled pieces (``make_update_step`` builds it)."""

    graphdefs: Graphdefs
    cfg: Any
    filter_cfg: Any
    collapse_cfg: Any
    group_size: int
    shared_prefix_len: int
    per_turn_rows: Optional[tuple[int, int]]
    single_pass: Optional[bool]
    reply_tokens: int
    critic_values: Any
    mini_batch_step: Any
    actor_lr: Any

    def __call__(self, state: TrainState, traj: Trajectory, key: Optional[jax.Array] = None):
        cfg = self.cfg
        if key is None:
            next_key, key = jax.random.split(state.key)
        else:
            next_key = state.key
        key_collapse, key_shuffle = jax.random.split(key)
        traj, metrics0 = shape_rewards(cfg, traj)  # 0.
        loss_mask = traj.loss_mask.astype(bool)
        rows = None if self.per_turn_rows is None else turn_rows(traj, *self.per_turn_rows)
        plan = plan_update(cfg, self.filter_cfg, traj, rows, group_size=self.group_size,
                           single_pass=self.single_pass, reply_tokens=self.reply_tokens)
        if plan.single:  # 1. is folded into the loss pass
            old, metrics = {}, {}
        else:
            frozen = nnx.merge(self.graphdefs.policy, state.params, state.policy_rest).cfg.frozen_layers
            old = score_batch(self.graphdefs, cfg, self.critic_values, state, traj, rows, plan.micro_size,  # 1.
                              self.shared_prefix_len, plan.max_scored, cfg.keep_frozen_residual and frozen > 0)
            metrics = sampler_agreement(cfg, old, traj, loss_mask)
        metrics.update(metrics0)
        c_metrics, collapse_state = diagnose_collapse(self.graphdefs, cfg, self.collapse_cfg, state, traj, rows,  # 2.
                                                      key_collapse, plan.num_groups)
        metrics.update(c_metrics)
        filt, f_metrics = apply_filter(cfg, self.filter_cfg, traj, old, loss_mask, self.group_size)  # 3.
        metrics.update(f_metrics)
        kept = filt.row_weights > 0
        train_mask = loss_mask & kept[:, None]
        # Entropy of the policy on the tokens it will train on (the original measures it after filtering).
        if not plan.single:
            metrics["actor/entropy"] = losses.aggregate_mean(old["entropy"], train_mask, cfg.actor_loss_agg_mode)
        advantages, returns, a_metrics = estimate_advantages(cfg, self.filter_cfg, traj, old, filt, loss_mask,  # 4.
                                                             train_mask, self.group_size)
        metrics.update(a_metrics)
        data, rows_per_episode, d_metrics = training_data(cfg, plan, traj, train_mask, filt.row_weights, old,
                                                          advantages, returns, rows, key_shuffle)
        metrics.update(d_metrics)
        (params, opt_state, c_params, c_opt, counts), step_metrics = train_on_batch(  # 5.–6.
            self.mini_batch_step, cfg, plan, state, data, kept, rows_per_episode, filt.is_empty, key_shuffle)
        metrics.update(step_metrics)
        counters, counter_metrics = advance_counters(state, filt.is_empty, counts, self.filter_cfg)  # 7.
        metrics["actor/lr"] = jnp.asarray(self.actor_lr(counters["optimizer_steps"]), jnp.float32)
        metrics.update(counter_metrics)
        metrics.update({
            "train/num_mini_batches": jnp.float32(plan.num_mini * cfg.ppo_epochs),
            "train/batch_size": jnp.float32(plan.batch),
            "train/kept_rows": jnp.sum(kept).astype(jnp.float32),
        })
        new_state = state.replace(params=params, opt_state=opt_state, critic_params=c_params,
                                  critic_opt_state=c_opt, key=next_key, collapse=collapse_state, **counters)
        return new_state, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def check_update_inputs(graphdefs: Graphdefs, cfg, placement=None) -> None:
    """The train state was built for this configuration, and what it asks for can run where it will."""
    mode = cfg.critic_mode
    if (mode == "none") != (graphdefs.critic is None):
        raise ValueError(f"starpo.critic resolves to {mode!r} but the train state was built "
                         f"{'without' if graphdefs.critic is None else 'with'} a critic; rebuild it with "
                         "init_train_state using the same StarPOConfig.")
    if cfg.uses_reference and graphdefs.reference is None:
        raise ValueError("a KL term needs reference parameters; build the train state with "
                         "init_train_state using the same StarPOConfig.")
    if placement is not None and placement.num_processes > 1:
        for name in adv_lib.ADVANTAGE_ESTIMATORS.get(cfg.estimator).needs:
            reason = adv_lib.ADVANTAGE_INPUTS.get(name).host_callback(cfg)
            if reason:
                raise ValueError(f"starpo.adv_estimator={cfg.adv_estimator!r} builds its {name} in a host callback "
                                 f"({reason}), which sees only one process's rows; run it in a single process "
                                 "(or leave that setting off)")


def make_update_step(
    graphdefs: Graphdefs,
    cfg,
    filter_cfg,
    collapse_cfg,
    *,
    group_size: int,
    jit: bool = True,
    donate: bool = True,
    shared_prefix_len: int = 0,
    per_turn_rows: Optional[tuple[int, int]] = None,
    placement=None,
    state_shardings=None,
    single_pass: Optional[bool] = None,
    reply_tokens: int = 0,
):
    """Builds ``update(train_state, trajectory, key=None) -> (train_state, metrics)``.

    Args:
      graphdefs: from ``init_train_state``.
      group_size: rows per env group; rows form contiguous groups (``Trajectory`` layout).
      jit: return the ``jax.jit``-compiled function (False: the plain traceable function).
      donate: donate the incoming train state's buffers to the result (halves peak memory; the
        caller must not reuse the state it passed in).
      shared_prefix_len: P > 0 when every row starts with the same P tokens (the rollout's system
        prompt, ``len(rollout.codec.preamble_ids)``): the policy's log-probs are then computed with
        that prompt run once per batch instead of once per row (same values, ~P/L less work).
      per_turn_rows: ``(preamble_len, row_len)`` for a rollout in ``context_mode="limited"``
        (``len(rollout.codec.preamble_ids)``, ``rollout.cache_len``): every log-prob (old, reference,
        current) and critic value is then computed on one row per (episode, turn) holding exactly
        the context that turn was sampled in (``rollout.turn_rows``), not on the whole transcript.
        Scores, the SNR filter and advantages stay per episode; a mini-batch holds all the turn
        rows of its episodes, so the optimizer-step count is the same as in full mode.
      placement, state_shardings: run on ``placement``'s mesh (``ragen_jax.placement``) with the train
        state laid out as ``state_shardings`` on the way in and out (so its donated buffers are
        reused) and replicated metrics. The trajectory keeps the rollout's batch layout. Every
        statistic (the SNR filter's group ranking, advantage normalisation, the MI matrix) is of the
        global batch: the program is written for one device and XLA inserts the collectives.
      single_pass: skip the scoring forward when ``is_single_pass`` holds (None: whenever it does; False:
        never, the two-pass reference). The sampler agreement is then measured on the kept rows only.
      reply_tokens: the most tokens one reply holds (the rollout's ``max_new_tokens``). With
        ``starpo.logprobs_at='loss_tokens'`` log-probs are then computed at the loss tokens only
        (``logprobs.scored_logprobs_from_hidden``); 0 scores every position.
    The batch size must be a multiple of ``group_size`` and of the mini-batch size. ``key`` (optional)
    drives pair sampling and shuffling; without it the state's key is split and advanced.
    """
    check_update_inputs(graphdefs, cfg, placement)
    update = StarPOUpdate(
        graphdefs=graphdefs, cfg=cfg, filter_cfg=filter_cfg, collapse_cfg=collapse_cfg, group_size=group_size,
        shared_prefix_len=shared_prefix_len, per_turn_rows=per_turn_rows, single_pass=single_pass,
        reply_tokens=reply_tokens, critic_values=make_loss_fn(graphdefs, cfg, shared_prefix_len)[1],
        mini_batch_step=make_mini_batch_step(graphdefs, cfg, shared_prefix_len),
        actor_lr=learning_rate_schedule(cfg.actor_lr, cfg.warmup_steps, cfg.lr_schedule, cfg.lr_decay_steps,
                                        cfg.min_lr_ratio))
    if not jit:
        return update
    donate_argnums = (0,) if donate else ()
    if placement is None:
        return jax.jit(update, donate_argnums=donate_argnums)
    return placement.jit(update, donate_argnums=donate_argnums, in_shardings=(state_shardings, None),
                         out_shardings=(state_shardings, placement.replicated))
