"""StarPO advantage estimators and episode-score normalisation (pure ``jnp``, static shapes, jit-able).

Axis convention (read this first)
---------------------------------
Every ``[B, L]`` array here is indexed by the token position of the ``Trajectory``. Index ``t``
carries everything about the decision "sample token ``t``":

  * ``loss_mask[:, t]``      token ``t`` was sampled by the policy,
  * log-probs                ``log pi(tokens[t] | tokens[:t])`` — read from the logits at ``t - 1``,
  * ``token_rewards[:, t]``  a turn's reward sits at that turn's last sampled token,
  * ``values[:, t]``         ``V(tokens[:t])``: the critic's estimate of the state in which token
                             ``t`` is chosen — the value head read at position ``t - 1``, exactly
                             like the log-prob. ``align_to_targets(value_head_output)`` does the
                             shift (and the same for logits-derived per-position quantities).

Index 0 is never a target (``loss_mask[:, 0]`` is False) and ``align_to_targets`` fills it with 0.

The original (verl) works on a "response axis" of width ``L - 1``: response index ``j`` predicts
token ``j + 1`` from the logits *and* the value head at token ``j``. Our index ``t = j + 1``: our
arrays are the original's moved one slot to the right, so both read the value head one position
before the token being scored, and the GAE recursion is identical on both axes. (The original's
off-by-one assistant mask is *not* reproduced: our ``loss_mask`` is exactly the sampled tokens.)

Rewards placed on tokens outside ``loss_mask`` are ignored by the GAE estimators (the masked-carry
rule below skips those positions entirely); the Trajectory never places them there.

Group layout: rows form ``num_groups`` contiguous blocks of ``group_size`` rows (row ``i`` is in group
``i // group_size``), so group statistics are a reshape to ``[num_groups, group_size]``.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.registry import Registry
from ragen_jax.starpo.reductions import check_group_size, group_mean_std, group_std, group_view, masked_whiten

Array = jax.Array

# Numerical constants of the original, kept so results are comparable run-for-run.
SCORE_STD_EPS = 1e-6  # episode-score / GRPO std: (x - mean) / (std + 1e-6)
LENGTH_WEIGHT_EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Small masked helpers
# ---------------------------------------------------------------------------------------------


def align_to_targets(per_position: Array) -> Array:
    """Moves per-position outputs onto the token they predict: ``out[:, t] = x[:, t - 1]``, ``out[:, 0] = 0``.

    Use it for the value head (``[B, L]`` -> ``values``) and for any quantity computed from the
    logits at each position (``[B, L, ...]``), so it lines up with ``loss_mask`` and rewards.
    """
    pad = jnp.zeros_like(per_position[:, :1])
    return jnp.concatenate([pad, per_position[:, :-1]], axis=1)


def episode_scores(token_rewards: Array) -> Array:
    """``[B, L]`` token rewards -> ``[B]`` episode scores (sum of all turn rewards and penalties)."""
    return jnp.sum(token_rewards, axis=-1)


def last_token_mask(loss_mask: Array) -> Array:
    """bool ``[B, L]``: True at each row's last ``loss_mask`` token (all False for an empty row)."""
    m = loss_mask.astype(jnp.int32)
    tokens_from_here = jnp.flip(jnp.cumsum(jnp.flip(m, axis=1), axis=1), axis=1)
    return (m == 1) & (tokens_from_here == 1)


def place_at_last_token(scores: Array, loss_mask: Array) -> Array:
    """``[B]`` episode scores -> ``[B, L]`` token rewards holding the score at the last sampled token.

    This is the original's default (``use_turn_scores=False``) reward placement: one scalar per
    episode, credited at the end of the response.
    """
    return jnp.where(last_token_mask(loss_mask), scores[:, None], 0.0).astype(scores.dtype)


# ---------------------------------------------------------------------------------------------
# Episode-score normalisation (per group or per batch)
# ---------------------------------------------------------------------------------------------

REWARD_NORMALIZATIONS: Registry[Callable[[Array, int], Array]] = Registry("reward normalization")


@REWARD_NORMALIZATIONS.register("identity")
def _identity_norm(scores: Array, group_size: int) -> Array:
    return scores


@REWARD_NORMALIZATIONS.register("mean")
def _mean_norm(scores: Array, group_size: int) -> Array:
    g = group_view(scores, group_size)
    return (g - jnp.mean(g, axis=1, keepdims=True)).reshape(scores.shape)


@REWARD_NORMALIZATIONS.register("mean_std")
def _mean_std_norm(scores: Array, group_size: int) -> Array:
    g = group_view(scores, group_size)
    mean = jnp.mean(g, axis=1, keepdims=True)
    std = group_std(g)[:, None]
    # A group whose members all scored the same carries no ranking signal: zeros, not 0/eps noise.
    out = jnp.where(std <= SCORE_STD_EPS, 0.0, (g - mean) / (std + SCORE_STD_EPS))
    return out.reshape(scores.shape).astype(scores.dtype)


@REWARD_NORMALIZATIONS.register("asym_clip")
def _asym_clip_norm(scores: Array, group_size: int) -> Array:
    return jnp.clip(_mean_std_norm(scores, group_size), -1.0, 3.0)


REWARD_GROUPINGS = Registry("reward normalization grouping")
REWARD_GROUPINGS.add("state", "state")  # per env group (same initial state): group_size rows
REWARD_GROUPINGS.add("batch", "batch")  # the whole batch is one group


def normalize_scores(scores: Array, *, method: str, group_size: int, grouping: str = "state") -> Array:
    """Normalises episode scores ``[B]`` within each group (``grouping='state'``) or the whole batch.

    Methods (registry ``REWARD_NORMALIZATIONS``): ``identity``; ``mean`` (x - mean); ``mean_std``
    ((x - mean) / (std + 1e-6) with the unbiased std, all zeros for a group whose std <= 1e-6);
    ``asym_clip`` (``mean_std`` then clip to [-1, 3]). Groups of one member are left unchanged
    (no statistics exist), matching the original.
    """
    fn = REWARD_NORMALIZATIONS.get(method)
    REWARD_GROUPINGS.validate(grouping)
    size = scores.shape[0] if grouping == "batch" else group_size
    check_group_size(scores.shape[0], size)
    if size == 1:
        return scores
    return fn(scores, size)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


def _no_settings(cfg) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: the function and everything the update needs to know to call it.

    ``fn(token_rewards, values, loss_mask, turn_ids, *, group_size, gamma, lam, high_level_gamma)
    -> (advantages [B, L], returns [B, L])``, both zero outside ``loss_mask``, *before* whitening.
    Every estimator takes the same keywords and ignores those it does not use.
    ``uses_critic``: needs ``values`` (and a value loss). ``whiten_default``: batch-whitened unless
    the caller overrides (True for GAE-family estimators, False for GRPO-family, as in the original).
    ``needs``: the extra inputs it reads beyond the token rewards, each a name in ``ADVANTAGE_INPUTS``
    (``turn_rewards`` / ``turn_mask`` / ``anchor_ids`` for GiGPO's per-turn rewards and anchor
    states, ``reward_baselines`` for ReMax's greedy-rollout returns); the update builds exactly
    these from the batch, so an estimator with a new input registers the input beside it.
    ``settings(starpo_cfg) -> dict``: its keyword settings from the StarPO config.
    ``diagnostics(inputs, kept [B], group_size) -> {metric name: scalar}``: what it reports about
    its inputs (``inputs`` as built for ``needs``; ``kept`` the rows the SNR filter kept).
    ``resolve(starpo_cfg) -> name``: the registry name a configuration of this one actually runs
    (``grpo`` without std scaling is ``drgrpo``); ``None`` = itself.
    """

    fn: Callable[..., tuple[Array, Array]]
    uses_critic: bool
    whiten_default: bool
    needs: tuple[str, ...] = ()
    group_relative: bool = False  # its baseline is the other episodes of the group: needs group_size >= 2
    settings: Callable[[object], dict] = _no_settings
    diagnostics: Optional[Callable[[dict, Array, int], dict]] = None
    resolve: Optional[Callable[[object], str]] = None


@dataclasses.dataclass(frozen=True)
class AdvantageInput:
    """Something an estimator reads beyond the token rewards, built by the update from the batch.

    ``build(starpo_cfg, trajectory, group_size) -> Array | None`` (None: the rollout did not record it).
    ``rollout_switch``: the ``rollout`` setting that must be True for the rollout to record it
    (checked when the configuration is resolved); ``missing``: how to get it, for the error.
    ``host_callback(starpo_cfg) -> str``: non-empty (the setting that does it, and why) when this
    configuration builds it in a host callback, which sees one process's rows only (the update
    refuses to run such a build across processes).
    """

    build: Callable[[object, object, int], Optional[Array]]
    rollout_switch: Optional[str] = None
    missing: str = ""
    host_callback: Callable[[object], str] = lambda cfg: ""


ADVANTAGE_INPUTS: Registry[AdvantageInput] = Registry("advantage input")


def resolved_estimator(starpo_cfg) -> str:
    """The registry name ``starpo_cfg.adv_estimator`` runs as (``AdvantageEstimator.resolve``)."""
    est = ADVANTAGE_ESTIMATORS.get(starpo_cfg.adv_estimator)
    return est.resolve(starpo_cfg) if est.resolve is not None else starpo_cfg.adv_estimator


def estimator_inputs(starpo_cfg, trajectory, group_size: int) -> dict:
    """What the configured estimator reads beyond the token rewards (its ``needs``, built from the
    batch) and its settings; inputs the trajectory lacks are left out (``compute_advantages`` names
    what is missing)."""
    est = ADVANTAGE_ESTIMATORS.get(resolved_estimator(starpo_cfg))
    inputs = {name: ADVANTAGE_INPUTS.get(name).build(starpo_cfg, trajectory, group_size) for name in est.needs}
    return {**inputs, **est.settings(starpo_cfg)}


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _reverse_scan(step, carry, xs):
    """``lax.scan`` backwards over the token axis of ``[B, L]`` inputs; returns ``[B, L]`` outputs."""
    xs_t = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), xs)
    _, ys = jax.lax.scan(step, carry, xs_t, reverse=True)
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys)


def gae(token_rewards, values, loss_mask, turn_ids=None, *, group_size=1, gamma=1.0, lam=1.0,
        high_level_gamma=0.95, **_):
    """Generalised advantage estimation over the sampled tokens (masked-carry rule).

    Backwards over ``t = L-1 … 0`` with carries ``next_v`` and ``gae`` (both 0 at the end):

        delta_t = r_t + gamma * next_v - V_t
        gae_t   = delta_t + gamma * lam * gae
        if m_t: next_v <- V_t ; gae <- gae_t        (unmasked tokens carry both through untouched)
        A_t = gae_t * m_t ;  returns_t = (A_t + V_t) * m_t

    so observation tokens between turns are skipped as if the sampled tokens were contiguous.
    With gamma = lam = 1 and one terminal reward R: ``A_t = R - V_t`` and ``returns_t = R``.

    Args: token_rewards, values float ``[B, L]``; loss_mask bool ``[B, L]``. Other keywords unused.
    Returns: advantages, returns float ``[B, L]`` (un-whitened).
    """
    del turn_ids, group_size, high_level_gamma
    m = loss_mask.astype(values.dtype)
    r = token_rewards.astype(values.dtype)

    def step(carry, x):
        next_v, carry_gae = carry
        r_t, v_t, m_t = x
        delta = r_t + gamma * next_v - v_t
        gae_t = delta + gamma * lam * carry_gae
        keep = m_t > 0
        next_v = jnp.where(keep, v_t, next_v)
        carry_gae = jnp.where(keep, gae_t, carry_gae)
        return (next_v, carry_gae), gae_t * m_t

    zeros = jnp.zeros(values.shape[0], values.dtype)
    adv = _reverse_scan(step, (zeros, zeros), (r, values, m))
    return adv, (adv + values) * m


def bilevel_gae(token_rewards, values, loss_mask, turn_ids, *, group_size=1, gamma=1.0, lam=1.0,
                high_level_gamma=0.95, **_):
    """Bi-level (turn-level then token-level) GAE.

    Per row, let ``e_1 < … < e_K`` be the turn ends — the last sampled token of each turn, found
    from ``turn_ids`` over ``loss_mask`` tokens — and ``V_k = values[e_k]`` the value read at that
    turn boundary, ``r_k = token_rewards[e_k]`` the turn's reward.

    High level, backwards over turns with ``gamma_H = high_level_gamma`` (``V_{K+1} = A^H_{K+1} = 0``):

        delta^H_k = r_k + gamma_H * V_{k+1} - V_k
        A^H_k     = delta^H_k + gamma_H * lam * A^H_{k+1}
        G_k       = A^H_k + V_k                             (turn-level return)

    Low level, backwards over the sampled tokens of turn ``k`` only (the recursion restarts at every
    turn end; unmasked tokens are skipped as in ``gae``), with ``G_k`` as the turn's terminal reward:

        t = e_k:                A_t = G_k - V_t  (= A^H_k)
        earlier sampled t,      delta_t = r_t + gamma * V_{t'} - V_t
        next sampled t' in k:   A_t = delta_t + gamma * lam * A_{t'}

    ``returns_t = A_t + V_t`` on sampled tokens, 0 elsewhere. With gamma = lam = 1 every token of turn
    ``k`` gets ``A_t = G_k - V_t``. Rewards on sampled tokens that are not a turn end enter the
    low-level deltas (the Trajectory puts none there). Turn ends are defined by the turn structure,
    not by "reward != 0", so zero-reward turns are handled (the original crashes on them).

    Deviation, documented: RAGEN's ``algorithm.bi_level_gae=True`` does not run — its trainer calls
    ``compute_bi_level_gae_advantage_return`` on verl's ``core_algos``, which has no such function
    (AttributeError before the first update), and its own implementation would raise IndexError on
    a sample whose rewards are all 0. This one runs, with the turn structure above.

    Args: token_rewards, values float ``[B, L]``; loss_mask bool ``[B, L]``; turn_ids int ``[B, L]``.
    Returns: advantages, returns float ``[B, L]`` (un-whitened).
    """
    del group_size
    if turn_ids is None:
        raise ValueError("bilevel_gae needs turn_ids [B, L] (Trajectory.turn_ids) to find turn ends.")
    m = loss_mask.astype(values.dtype)
    r = token_rewards.astype(values.dtype)
    turn_ids = turn_ids.astype(jnp.int32)
    batch = values.shape[0]

    def step(carry, x):
        next_turn, high_v, high_a, low_v, low_a = carry
        r_t, v_t, m_t, turn_t = x
        sampled = m_t > 0
        is_end = sampled & (turn_t != next_turn)
        high_delta = r_t + high_level_gamma * high_v - v_t
        high_adv = high_delta + high_level_gamma * lam * high_a
        low_adv = r_t + gamma * low_v - v_t + gamma * lam * low_a
        adv_t = jnp.where(is_end, high_adv, low_adv)
        high_v = jnp.where(is_end, v_t, high_v)
        high_a = jnp.where(is_end, high_adv, high_a)
        low_v = jnp.where(sampled, v_t, low_v)
        low_a = jnp.where(sampled, adv_t, low_a)
        next_turn = jnp.where(sampled, turn_t, next_turn)
        return (next_turn, high_v, high_a, low_v, low_a), adv_t * m_t

    zeros = jnp.zeros(batch, values.dtype)
    # Sentinel below every real turn id (-1 marks preamble/padding), so the last sampled token ends a turn.
    no_turn = jnp.full(batch, jnp.iinfo(jnp.int32).min, jnp.int32)
    adv = _reverse_scan(step, (no_turn, zeros, zeros, zeros, zeros), (r, values, m, turn_ids))
    return adv, (adv + values) * m


def _grpo_like(token_rewards, loss_mask, group_size, scale_by_std):
    scores = episode_scores(token_rewards)
    mean, std = group_mean_std(scores, group_size)
    centred = group_view(scores, group_size) - mean[:, None]
    if scale_by_std:
        centred = centred / (std[:, None] + SCORE_STD_EPS)
    adv = centred.reshape(scores.shape)[:, None] * loss_mask.astype(scores.dtype)
    return adv, adv


def grpo(token_rewards, values, loss_mask, turn_ids=None, *, group_size, gamma=1.0, lam=1.0,
         high_level_gamma=0.95, **_):
    """GRPO: group z-score of episode scores, broadcast over the sampled tokens (no critic).

    ``s_i = sum_t r_{i,t}``; ``A_i = (s_i - mean_g) / (std_g + 1e-6)`` with the unbiased group std;
    groups of one member use mean 0, std 1. ``A_{i,t} = A_i * m_{i,t}``; returns = advantages.
    ``values``/``turn_ids``/``gamma``/``lam`` are unused (pass ``values=None``).
    """
    del values, turn_ids, gamma, lam, high_level_gamma
    return _grpo_like(token_rewards, loss_mask, group_size, scale_by_std=True)


def drgrpo(token_rewards, values, loss_mask, turn_ids=None, *, group_size, gamma=1.0, lam=1.0,
           high_level_gamma=0.95, **_):
    """Dr. GRPO: ``A_i = s_i - mean_g`` (no std scaling; size-1 groups use mean 0), broadcast over ``m``."""
    del values, turn_ids, gamma, lam, high_level_gamma
    return _grpo_like(token_rewards, loss_mask, group_size, scale_by_std=False)


def rloo(token_rewards, values, loss_mask, turn_ids=None, *, group_size, gamma=1.0, lam=1.0,
         high_level_gamma=0.95, **_):
    """RLOO: each episode's baseline is the mean score of the *other* members of its group.

    ``A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) * K / (K - 1)`` for groups of ``K > 1``; a group
    of one has no other member, so its baseline is 0 (``A_i = s_i``). Broadcast over ``m``;
    returns = advantages. No critic.
    """
    del values, turn_ids, gamma, lam, high_level_gamma
    scores = episode_scores(token_rewards)
    if group_size == 1:
        per_row = scores
    else:
        g = group_view(scores, group_size)
        per_row = ((g - jnp.mean(g, axis=1, keepdims=True)) * (group_size / (group_size - 1))).reshape(-1)
    adv = per_row[:, None] * loss_mask.astype(scores.dtype)
    return adv, adv


def soft_advantage_weights(scores: Array, group_size: int) -> Array:
    """Per-row weights of the GRPO soft advantage reweighting: ``w_g = std_g / (max_g std_g + 1e-6)``.

    ``std_g`` is the unbiased std of the group's episode scores (1.0 for groups of one, as in the
    original). Multiply the advantages by ``weights[:, None]``: groups whose outcomes barely differ
    contribute little. Returns float ``[B]``.
    """
    _, std = group_mean_std(scores, group_size)
    w = std / (jnp.max(std) + SCORE_STD_EPS)
    return jnp.repeat(w, group_size)


def _broadcast(per_row: Array, loss_mask: Array) -> tuple[Array, Array]:
    adv = per_row[:, None] * loss_mask.astype(per_row.dtype)
    return adv, adv


def reinforce_plus_plus(token_rewards, values, loss_mask, turn_ids=None, *, group_size=1, gamma=1.0, **_):
    """REINFORCE++ (Hu et al., 2025; verl's ``reinforce_plus_plus``): discounted token returns, then
    batch whitening (``whiten_default``), no critic, no group baseline.

    Backwards over ``t = L-1 … 0`` with ``G = 0`` at the end::

        G <- r_t + gamma * G ;  returns_t = G ;  G <- G * m_t      (the return resets off the mask)

    This is verl's recursion exactly: the running return is reset at every token outside
    ``loss_mask``. On a multi-turn transcript the observation tokens between turns reset it, so only
    the last turn's tokens see a reward credited at the episode's last token (earlier turns see their
    own turn rewards, with ``use_turn_scores``). ``reinforce_plus_plus_multiturn`` carries the
    return across observation tokens instead.

    Deviation, documented: RAGEN wires ``reinforce_plus_plus`` but its trainer calls verl's function
    with ``gamma=`` and no ``config``, which verl (0.6.1) asserts on — the estimator raises before the
    first update there. This one runs, with verl's recursion as above.
    Returns: advantages (un-whitened returns; ``compute_advantages`` whitens), returns ``[B, L]``.
    """
    m = loss_mask.astype(jnp.float32)
    r = token_rewards.astype(jnp.float32)

    def step(running, x):
        r_t, m_t = x
        running = r_t + gamma * running
        return running * m_t, running

    ret = _reverse_scan(step, jnp.zeros(r.shape[0], jnp.float32), (r, m))
    return ret * m, ret * m


def reinforce_plus_plus_multiturn(token_rewards, values, loss_mask, turn_ids=None, *, group_size=1, gamma=1.0,
                                  **_):
    """REINFORCE++ across turns (our variant of ``reinforce_plus_plus``): the discounted return skips
    the tokens outside ``loss_mask`` (GAE's masked-carry rule) instead of resetting there, so every
    turn of an episode is credited with the rewards that follow it. Rewards on unmasked tokens are
    ignored. With ``gamma = 1`` and the episode score at the last sampled token every sampled token
    gets the episode score; whitened over the batch by default.
    """
    m = loss_mask.astype(jnp.float32)
    r = token_rewards.astype(jnp.float32)

    def step(running, x):
        r_t, m_t = x
        candidate = r_t + gamma * running
        running = jnp.where(m_t > 0, candidate, running)
        return running, candidate * m_t

    ret = _reverse_scan(step, jnp.zeros(r.shape[0], jnp.float32), (r, m))
    return ret, ret


def reinforce_plus_plus_baseline(token_rewards, values, loss_mask, turn_ids=None, *, group_size, **_):
    """REINFORCE++ with baseline (verl's ``reinforce_plus_plus_baseline``): ``A_i = s_i - mean_g``
    (groups of one: mean 0), broadcast over the sampled tokens, then batch-whitened
    (``whiten_default``). Returns = advantages."""
    scores = episode_scores(token_rewards)
    mean, _ = group_mean_std(scores, group_size)
    return _broadcast(scores - jnp.repeat(mean, group_size), loss_mask)


def remax(token_rewards, values, loss_mask, turn_ids=None, *, reward_baselines, **_):
    """ReMax (Li et al., 2023; verl's ``remax``): the baseline of each episode is the return of a
    greedy rollout from the same start state (``reward_baselines [B]``, from the rollout's
    ``greedy_baseline``). ``returns_t = sum_{k >= t} r_k m_k`` (reverse cumulative sum of the masked
    token rewards), ``A_t = (returns_t - b) m_t``. Not whitened."""
    m = loss_mask.astype(jnp.float32)
    rm = token_rewards.astype(jnp.float32) * m
    ret = jnp.flip(jnp.cumsum(jnp.flip(rm, axis=1), axis=1), axis=1)
    return (ret - reward_baselines.astype(jnp.float32)[:, None]) * m, ret * m


def opo(token_rewards, values, loss_mask, turn_ids=None, *, group_size, **_):
    """OPO (Hao et al., 2025; verl's ``opo``): the optimal baseline for a sequence-level reward,
    ``b_g = sum_i |y_i| s_i / sum_i |y_i|`` (length-weighted group mean, ``|y_i|`` = sampled tokens);
    ``A_i = s_i - b_g`` (groups of one: b = 0), broadcast. Not whitened."""
    scores = episode_scores(token_rewards)
    lengths = jnp.sum(loss_mask.astype(jnp.float32), axis=-1)
    s, n = group_view(scores, group_size), group_view(lengths, group_size)
    base = jnp.sum(s * n, axis=1) / jnp.maximum(jnp.sum(n, axis=1), 1.0)
    if group_size == 1:
        base = jnp.zeros_like(base)
    return _broadcast(scores - jnp.repeat(base, group_size), loss_mask)


def gpg(token_rewards, values, loss_mask, turn_ids=None, *, group_size, gpg_f_norm=1.0, **_):
    """GPG (Chu et al., 2025; verl's ``gpg``): ``A_i = alpha (s_i - mean_g) / F`` with
    ``alpha = B / #{i : s_i != 0}`` over the rows that train (rows the SNR filter emptied are not
    counted: the original removes them before this step) and ``F = gpg_f_norm`` (1). Groups of one:
    mean 0. Not whitened; pair it with ``policy_loss='gpg'`` (no ratio) as the paper does."""
    scores = episode_scores(token_rewards)
    trains = jnp.any(loss_mask, axis=-1)
    rows = jnp.sum(trains).astype(jnp.float32)
    nonzero = jnp.sum(trains & (scores != 0)).astype(jnp.float32)
    alpha = rows / jnp.maximum(nonzero, 1.0)
    mean, _ = group_mean_std(scores, group_size)
    return _broadcast(alpha * (scores - jnp.repeat(mean, group_size)) / gpg_f_norm, loss_mask)


def grpo_passk(token_rewards, values, loss_mask, turn_ids=None, *, group_size, norm_adv_by_std=True, **_):
    """GRPO for pass@k (Chen et al., 2025; verl's ``grpo_passk``): only the best episode of each group
    learns, with ``A = s_max - s_second`` (÷ (unbiased group std + 1e-6) when ``norm_adv_by_std``);
    every other row gets 0. Ties go to the first row. Needs groups of at least two."""
    if group_size < 2:
        raise ValueError(f"grpo_passk needs groups of at least 2 episodes (rollout.group_size={group_size}).")
    scores = episode_scores(token_rewards)
    g = group_view(scores, group_size)
    best = jnp.argmax(g, axis=1)
    top2 = jax.lax.top_k(g, 2)[0]
    gap = top2[:, 0] - top2[:, 1]
    if norm_adv_by_std:
        gap = gap / (group_std(g) + SCORE_STD_EPS)
    per_row = jnp.where(jnp.arange(group_size)[None] == best[:, None], gap[:, None], 0.0).reshape(-1)
    return _broadcast(per_row.astype(scores.dtype), loss_mask)


# --- GiGPO -----------------------------------------------------------------------------------

GIGPO_NORMS = ("mean", "std")


def turn_returns(turn_rewards: Array, turn_mask: Array, gamma: float) -> Array:
    """Discounted return of every turn, ``R_t = r_t + gamma R_{t+1}`` over the turns that took place
    (GiGPO's Eq. 5). ``[B, T]`` -> ``[B, T]``, 0 on turns that did not happen."""
    m = turn_mask.astype(jnp.float32)
    r = turn_rewards.astype(jnp.float32) * m

    def step(running, x):
        running = x[0] + gamma * running
        return running, running * x[1]

    return _reverse_scan(step, jnp.zeros(r.shape[0], jnp.float32), (r, m))


def _anchor_groups(anchor_ids: Array, turn_mask: Array, group_size: int) -> tuple[Array, Array]:
    """``same [G, N, N]`` (turns ``n``, ``n'`` of one episode group share an anchor state; ``N =
    group_size * T``, row-major over (episode, turn)) and ``valid [G, N]`` (the turn took place)."""
    num_groups = check_group_size(anchor_ids.shape[0], group_size)
    ids = anchor_ids.reshape(num_groups, -1)
    valid = turn_mask.astype(bool).reshape(num_groups, -1)
    same = (ids[:, :, None] == ids[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    return same, valid


def cluster_similar_observations(observations: np.ndarray, lengths: np.ndarray, turn_mask: np.ndarray,
                                 group_size: int, threshold: float) -> np.ndarray:
    """verl-agent's similarity-based step grouping (``build_step_group`` with ``enable_similarity``),
    on the host: within each episode group, every turn's observation goes, in row-major order over
    (episode, turn), to the first cluster whose representative (its first member) it matches with
    ``difflib.SequenceMatcher(None, observation, representative).ratio() >= threshold``, else opens a
    new cluster. Returns int32 ``[B, T]`` cluster ids (distinct across the batch; -1 on missing turns).

    Deviation, documented: the sequences compared are the observation's rendered pieces (board
    symbols, or a text env's tokens) where verl-agent compares the observation's characters; the
    order is (episode, turn) where verl-agent's is its batch's row order.
    """
    obs, lens, mask = np.asarray(observations), np.asarray(lengths), np.asarray(turn_mask, bool)
    batch, turns = mask.shape
    ids = np.full((batch, turns), -1, np.int32)
    next_id = 0
    for g in range(batch // group_size):
        clusters: list[tuple[list, int]] = []
        for i in range(g * group_size, (g + 1) * group_size):
            for t in range(turns):
                if not mask[i, t]:
                    continue
                seq = obs[i, t, : int(lens[i, t])].tolist()
                for rep, cid in clusters:
                    if difflib.SequenceMatcher(None, seq, rep).ratio() >= threshold:
                        ids[i, t] = cid
                        break
                else:
                    clusters.append((seq, next_id))
                    ids[i, t] = next_id
                    next_id += 1
    return ids


def similar_observation_groups(observations: Array, lengths: Array, turn_mask: Array, group_size: int,
                               threshold: float) -> Array:
    """``cluster_similar_observations`` inside a jitted program (a host callback): anchor ids
    ``[B, T]`` for ``gigpo`` that group similar, not only identical, observations. ``observations``
    int ``[B, T, P]`` and ``lengths`` ``[B, T]`` are ``Trajectory.turn_observation(_len)``."""
    if observations is None or lengths is None:
        raise ValueError("GiGPO's similarity grouping compares the observations each turn saw "
                         "(Trajectory.turn_observation); this trajectory does not record them")
    check_group_size(turn_mask.shape[0], group_size)
    shape = jax.ShapeDtypeStruct(turn_mask.shape, jnp.int32)
    return jax.pure_callback(
        lambda o, n, m: cluster_similar_observations(o, n, m, group_size, float(threshold)).astype(np.int32),
        shape, observations, lengths, turn_mask)


def anchor_group_stats(anchor_ids: Array, turn_mask: Array, group_size: int) -> dict:
    """How much step-level signal GiGPO's anchor grouping finds: ``shared_turn_fraction`` (turns
    whose anchor group has another member) and ``mean_group_size`` (turns per anchor group, averaged
    over the groups as the reference prints it)."""
    same, valid = _anchor_groups(anchor_ids, turn_mask, group_size)
    size = jnp.sum(same, axis=-1).astype(jnp.float32)  # [G, N], 0 on missing turns
    n_turns = jnp.sum(valid).astype(jnp.float32)
    n_groups = jnp.sum(jnp.where(valid, 1.0 / jnp.maximum(size, 1.0), 0.0))
    return {"shared_turn_fraction": jnp.sum(valid & (size > 1)) / jnp.maximum(n_turns, 1.0),
            "mean_group_size": n_turns / jnp.maximum(n_groups, 1.0)}


def gigpo(token_rewards, values, loss_mask, turn_ids, *, group_size, turn_rewards, turn_mask, anchor_ids,
          step_weight=1.0, step_gamma=0.95, step_norm="mean", **_):
    """GiGPO (Feng et al., 2025, arXiv 2505.10978; verl-agent ``gigpo/core_gigpo.py``): an episode
    term from the group of episodes sharing a start state plus a step term from *anchor-state
    groups*, the turns of that episode group that saw an identical observation.

    Episode term (Eq. 3): ``A^E_i = (s_i - mean) / F`` with ``s_i`` the episode score (sum of
    ``token_rewards``). As in the reference (``compute_mean_std_cross_steps=True``) the statistics
    count each episode **once per turn it took** — the reference holds one row per turn — so longer
    episodes weigh more in the mean and the (unbiased) std; a group holding a single turn uses mean
    0, std 1.
    Step term (Eqs. 5–7): ``R_t = sum_{k >= t} step_gamma^{k-t} r_k`` from ``turn_rewards``; the
    anchor group of turn ``(i, t)`` is every turn ``(j, u)`` of the same episode group (any episode,
    any turn index) with ``anchor_ids[j, u] == anchor_ids[i, t]``; ``A^S = (R_t - mean) / F`` within
    it, so a turn alone in its group gets 0.
    ``F`` = 1 (``step_norm='mean'``, the reference's ``mean_norm``) or std + 1e-6 (``'std'``,
    ``mean_std_norm``). Deviation, on purpose: a group whose values are all equal gets 0 exactly
    (the reference divides a rounding residue by 1e-6 there).
    Every sampled token of turn ``t`` gets ``A^E_i + step_weight * A^S_{i,t}`` (Eq. 8); returns =
    advantages; not whitened.

    Args: token_rewards, loss_mask ``[B, L]``; turn_ids int ``[B, L]``; turn_rewards float ``[B, T]``
      (env reward + format penalty of each turn); turn_mask bool ``[B, T]``; anchor_ids uint32
      ``[B, T]`` (``Trajectory.turn_state_hash``: a hash of the observation each turn saw; or
      ``similar_observation_groups``' cluster ids for verl-agent's similarity grouping,
      ``starpo.gigpo_enable_similarity``).
    """
    if step_norm not in GIGPO_NORMS:
        raise ValueError(f"GiGPO step_norm={step_norm!r}; allowed: {', '.join(GIGPO_NORMS)}.")
    if turn_ids is None:
        raise ValueError("gigpo needs turn_ids [B, L] (Trajectory.turn_ids) to give each turn its advantage.")
    scale = step_norm == "std"
    f32 = jnp.float32
    scores = episode_scores(token_rewards).astype(f32)
    tm = turn_mask.astype(f32)
    T = turn_mask.shape[1]

    # Episode term: each episode's score counted once per turn it took.
    s, c = group_view(scores, group_size), group_view(jnp.sum(tm, axis=1), group_size)
    n = jnp.sum(c, axis=1, keepdims=True)
    mean = jnp.sum(c * s, axis=1, keepdims=True) / jnp.maximum(n, 1.0)
    var = jnp.sum(c * jnp.square(s - mean), axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    lone = n <= 1.0
    mean = jnp.where(lone, 0.0, mean)
    std = jnp.where(lone, 1.0, jnp.sqrt(var))
    centred = s - mean
    if scale:
        centred = jnp.where(std <= SCORE_STD_EPS, 0.0, centred / (std + SCORE_STD_EPS))
    episode_adv = centred.reshape(-1)  # [B]

    # Step term: discounted turn returns normalised within anchor-state groups.
    returns = turn_returns(turn_rewards, turn_mask, step_gamma)  # [B, T]
    same, valid = _anchor_groups(anchor_ids, turn_mask, group_size)
    sf = same.astype(f32)
    r = returns.reshape(valid.shape)  # [G, N]
    size = jnp.sum(sf, axis=-1)
    a_mean = jnp.sum(sf * r[:, None, :], axis=-1) / jnp.maximum(size, 1.0)
    a_var = jnp.sum(sf * jnp.square(r[:, None, :] - a_mean[:, :, None]), axis=-1) / jnp.maximum(size - 1.0, 1.0)
    step_adv = r - a_mean
    if scale:
        a_std = jnp.where(size > 1.0, jnp.sqrt(a_var), 1.0)
        step_adv = jnp.where(a_std <= SCORE_STD_EPS, 0.0, step_adv / (a_std + SCORE_STD_EPS))
    step_adv = jnp.where(valid & (size > 1.0), step_adv, 0.0).reshape(returns.shape)

    per_turn = episode_adv[:, None] + step_weight * step_adv  # [B, T]
    turn = jnp.clip(turn_ids.astype(jnp.int32), 0, T - 1)
    adv = jnp.take_along_axis(per_turn, turn, axis=1) * loss_mask.astype(f32)
    return adv, adv


def _anchor_ids(cfg, traj, group_size: int):
    """GiGPO's anchor states ``[B, T]``: the observation hashes (identical observations group), or with
    ``gigpo_enable_similarity`` verl-agent's clusters of similar observations."""
    if cfg.gigpo_enable_similarity:
        return similar_observation_groups(traj.turn_observation, traj.turn_observation_len, traj.turn_mask,
                                          group_size, cfg.gigpo_similarity_thresh)
    return traj.turn_state_hash


for _name, _input in (
    ("turn_rewards", AdvantageInput(lambda cfg, traj, g: traj.turn_rewards)),
    ("turn_mask", AdvantageInput(lambda cfg, traj, g: traj.turn_mask)),
    ("anchor_ids", AdvantageInput(_anchor_ids, missing="the rollout records anchor states in "
                                  "Trajectory.turn_state_hash.",
                                  host_callback=lambda cfg: "starpo.gigpo_enable_similarity clusters observations"
                                  if cfg.gigpo_enable_similarity else "")),
    ("reward_baselines", AdvantageInput(lambda cfg, traj, g: traj.reward_baseline, rollout_switch="greedy_baseline",
                                        missing="set rollout.greedy_baseline=True so the rollout measures "
                                        "the greedy episode of every group.")),
):
    ADVANTAGE_INPUTS.add(_name, _input)


def _gigpo_diagnostics(inputs: dict, kept: Array, group_size: int) -> dict:
    stats = anchor_group_stats(inputs["anchor_ids"], inputs["turn_mask"] & kept[:, None], group_size)
    return {"critic/gigpo_shared_turn_fraction": stats["shared_turn_fraction"],
            "critic/gigpo_anchor_group_size": stats["mean_group_size"]}


def _remax_diagnostics(inputs: dict, kept: Array, group_size: int) -> dict:
    return {"critic/remax_baseline_mean": jnp.mean(inputs["reward_baselines"])}


_CRITIC = dict(uses_critic=True, whiten_default=True)
_WHITENED = dict(uses_critic=False, whiten_default=True)
_GROUP = dict(uses_critic=False, whiten_default=False, group_relative=True)
for _name, _est in (
    ("gae", AdvantageEstimator(gae, **_CRITIC)),
    ("bilevel_gae", AdvantageEstimator(bilevel_gae, **_CRITIC)),
    ("grpo", AdvantageEstimator(grpo, **_GROUP, resolve=lambda cfg: "grpo" if cfg.norm_adv_by_std else "drgrpo")),
    ("drgrpo", AdvantageEstimator(drgrpo, **_GROUP)),
    ("rloo", AdvantageEstimator(rloo, **_GROUP)),
    ("gigpo", AdvantageEstimator(gigpo, **_GROUP, needs=("turn_rewards", "turn_mask", "anchor_ids"),
                                 settings=lambda cfg: {"step_weight": cfg.gigpo_step_weight,
                                                       "step_gamma": cfg.gigpo_gamma, "step_norm": cfg.gigpo_norm},
                                 diagnostics=_gigpo_diagnostics)),
    ("reinforce_plus_plus", AdvantageEstimator(reinforce_plus_plus, **_WHITENED)),
    ("reinforce_plus_plus_multiturn", AdvantageEstimator(reinforce_plus_plus_multiturn, **_WHITENED)),
    ("reinforce_plus_plus_baseline", AdvantageEstimator(reinforce_plus_plus_baseline, **_WHITENED,
                                                        group_relative=True)),
    ("remax", AdvantageEstimator(remax, uses_critic=False, whiten_default=False, needs=("reward_baselines",),
                                 diagnostics=_remax_diagnostics)),
    ("opo", AdvantageEstimator(opo, **_GROUP)),
    ("gpg", AdvantageEstimator(gpg, **_GROUP)),
    ("grpo_passk", AdvantageEstimator(grpo_passk, **_GROUP,
                                      settings=lambda cfg: {"norm_adv_by_std": cfg.norm_adv_by_std})),
):
    ADVANTAGE_ESTIMATORS.add(_name, _est)


def length_weight(advantages: Array, loss_mask: Array) -> Array:
    """GRPO length weighting: ``A_i <- A_i / ((n_i + 1e-6) / mean_j n_j)``, ``n_i = sum_t m_{i,t}``.

    Longer responses get proportionally smaller per-token advantages, so every episode carries about
    the same total weight under token-mean aggregation. The mean runs over the rows that train
    (``n_j > 0``): rows the SNR filter dropped have an all-zero mask, and counting them would shrink
    the mean — and every kept advantage — by the kept fraction (the original removes those rows
    from the batch before this step).
    """
    n = jnp.sum(loss_mask.astype(advantages.dtype), axis=-1)
    rows = jnp.maximum(jnp.sum(n > 0), 1).astype(advantages.dtype)
    scale = (n + LENGTH_WEIGHT_EPS) / jnp.maximum(jnp.sum(n) / rows, LENGTH_WEIGHT_EPS)
    return advantages / scale[:, None]


def compute_advantages(
    estimator: str,
    token_rewards: Array,
    values: Optional[Array],
    loss_mask: Array,
    turn_ids: Optional[Array] = None,
    *,
    group_size: int,
    gamma: float = 1.0,
    lam: float = 1.0,
    high_level_gamma: float = 0.95,
    whiten: Optional[bool] = None,
    grpo_length_weight: bool = False,
    extras: Optional[dict] = None,
) -> tuple[Array, Array]:
    """Runs a registered estimator, then the optional batch whitening and GRPO length weighting.

    Args:
      estimator: name in ``ADVANTAGE_ESTIMATORS`` (``gae``, ``bilevel_gae``, ``grpo``, ``drgrpo``, ``rloo``,
        ``gigpo``, ``reinforce_plus_plus`` (``_multiturn``, ``_baseline``), ``remax``, ``opo``, ``gpg``,
        ``grpo_passk``).
      token_rewards: float ``[B, L]`` turn rewards at each turn's last sampled token (see module doc).
      values: float ``[B, L]`` ``V(tokens[:t])`` (``align_to_targets`` of the value head); ``None``
        is allowed for critic-free estimators.
      loss_mask: bool ``[B, L]`` sampled tokens (already zeroed for rows the SNR filter dropped,
        if the caller wants them out of the whitening statistics).
      turn_ids: int ``[B, L]`` (needed by ``bilevel_gae``).
      group_size: rows per group (contiguous blocks).
      gamma, lam, high_level_gamma: discount, GAE lambda, turn-level discount (bi-level only).
      whiten: batch-whiten over ``loss_mask`` (unbiased var, +1e-8); ``None`` = estimator default.
      grpo_length_weight: apply ``length_weight`` after whitening (the original's order).
      extras: what some estimators read beyond the token rewards (``AdvantageEstimator.needs``:
        ``turn_rewards``, ``turn_mask``, ``anchor_ids``, ``reward_baselines``) and their settings
        (``step_weight``, ``step_gamma``, ``step_norm`` for GiGPO; ``norm_adv_by_std`` for
        ``grpo_passk``; ``gpg_f_norm``); estimators ignore the keys they do not use.

    Returns: ``(advantages, returns)`` float ``[B, L]``, zero outside ``loss_mask``; ``returns`` are
    the pre-whitening ``A + V`` (the critic's targets), equal to the advantages for GRPO.
    """
    est = ADVANTAGE_ESTIMATORS.get(estimator)
    if est.uses_critic and values is None:
        raise ValueError(f"Advantage estimator {estimator!r} uses a critic: pass values [B, L].")
    if values is None:
        values = jnp.zeros(token_rewards.shape, jnp.float32)
    if token_rewards.shape != loss_mask.shape or values.shape != loss_mask.shape:
        raise ValueError(
            f"token_rewards {token_rewards.shape}, values {values.shape} and loss_mask "
            f"{loss_mask.shape} must all be [B, L]."
        )
    if turn_ids is not None and turn_ids.shape != loss_mask.shape:
        raise ValueError(f"turn_ids {turn_ids.shape} must be [B, L] like loss_mask {loss_mask.shape}.")
    check_group_size(loss_mask.shape[0], group_size)
    extras = {k: v for k, v in (extras or {}).items() if v is not None}
    missing = [k for k in est.needs if k not in extras]
    if missing:
        hints = " ".join(ADVANTAGE_INPUTS.get(k).missing for k in missing if k in ADVANTAGE_INPUTS)
        raise ValueError(f"Advantage estimator {estimator!r} needs {', '.join(missing)} (pass them in extras); "
                         + hints)
    adv, returns = est.fn(
        token_rewards, values, loss_mask, turn_ids,
        group_size=group_size, gamma=gamma, lam=lam, high_level_gamma=high_level_gamma, **extras,
    )
    if est.whiten_default if whiten is None else whiten:
        adv = masked_whiten(adv, loss_mask)
    if grpo_length_weight:
        adv = length_weight(adv, loss_mask)
    return adv, returns
