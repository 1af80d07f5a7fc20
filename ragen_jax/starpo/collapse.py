"""Collapse diagnostics: the MI proxy of RAGEN-2, computed inside the compiled update step.

Reasoning collapse is read off a cross-scoring experiment. Take reasoning spans ``z_i`` sampled by the
policy and the prompts ``x_j`` they could have come from; score every ``z_i`` under every ``x_j`` with
the current policy (teacher forcing, temperature 1). If the reasoning depends on its input, ``z_i`` is
much more likely under its own prompt than under the others, and the gap estimates the mutual
information ``I(X; Z) = H(Z) - H(Z|X)`` against a uniform mixture over the sampled prompts.

  * X = ``tokens[:prompt_end]`` — the whole context up to and including the forced ``<think>``.
  * Z = ``tokens[reasoning_start:reasoning_end]`` — the sampled reasoning content without its tags
    (the exact tokens the policy emitted, never re-tokenised text).

Two pair samples, both with static shapes:
  * first-turn: up to ``num_samples`` first-turn reasoning spans drawn without replacement; a column
    is an env group (all members of a group share the same first prompt), ``N`` = number of distinct
    groups in the sample;
  * trajectory-uniform: ``num_samples`` draws of (trajectory uniform, then one of its valid turns
    uniform), with replacement; every draw is its own column, so ``N`` = number of draws.

Everything below is a pure function of arrays; ``cross_logprob_matrix`` takes the scoring function
as an argument so it can be tested against a planted log-prob function without any model.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp
from flax import struct

from ragen_jax.rollout.trajectory import Trajectory
from ragen_jax.starpo.reductions import masked_mean

# Regime codes (see ``classify_regime``).
REGIME_BASELINE = -1  # baseline still being measured
REGIME_DIVERSE = 0  # high MI, high H(Z|X): reasoning depends on the input and is varied
REGIME_TEMPLATE_COLLAPSE = 1  # low MI, high H(Z|X): varied text that ignores the input
REGIME_COMPRESSED = 2  # high MI, low H(Z|X): input-specific but nearly deterministic reasoning
REGIME_LOW_ENTROPY_COLLAPSE = 3  # low MI, low H(Z|X): one fixed reasoning for every input
REGIME_NAMES = {
    REGIME_BASELINE: "baseline",
    REGIME_DIVERSE: "diverse",
    REGIME_TEMPLATE_COLLAPSE: "template_collapse",
    REGIME_COMPRESSED: "compressed",
    REGIME_LOW_ENTROPY_COLLAPSE: "low_entropy_collapse",
}

RETRIEVAL_KS = (2, 4, 8)
SAMPLE_KINDS = ("first_turn", "trajectory")

# ``logprob_fn(tokens int32 [n, S]) -> float32 [n, S]``: entry ``[:, t]`` is log p(tokens[:, t] | tokens[:, :t])
# with positions 0..S-1 (entry 0 is unused). Causal, so right padding never changes earlier entries.
LogProbFn = Callable[[jax.Array], jax.Array]


@struct.dataclass
class PairSample:
    """Which reasoning spans (rows of the cross matrix) are scored under which prompts (columns)."""

    z_rows: chex.Array  # int32 [S] trajectory row of reasoning z_i
    z_turns: chex.Array  # int32 [S] turn of z_i
    z_valid: chex.Array  # bool [S] draw i is a real sample (non-empty reasoning)
    true_col: chex.Array  # int32 [S] column holding z_i's own prompt
    x_rows: chex.Array  # int32 [N] trajectory row whose prompt is column j
    x_turns: chex.Array  # int32 [N]
    x_valid: chex.Array  # bool [N] column j takes part (counts towards N)
    consistent: chex.Array  # bool [] every sampled z_i's own prompt equals its column's prompt


@struct.dataclass
class MIState:
    """What one sample kind carries between computations: EMA of marginal std and the regime baseline."""

    ema_std: chex.Array  # float32 [] EMA of the per-token marginal std
    ema_std_seq: chex.Array  # float32 [] EMA of the per-sequence marginal std
    ema_initialised: chex.Array  # bool [] the EMAs hold a value (first value initialises them)
    baseline_mi_sum: chex.Array  # float32 [] sum of per-token MI over the baseline computations
    baseline_entropy_sum: chex.Array  # float32 [] sum of per-token H(Z|X) over the baseline computations
    baseline_count: chex.Array  # int32 [] computations folded into the baseline so far
    num_computed: chex.Array  # int32 [] computations that produced metrics


@struct.dataclass
class CollapseState:
    first_turn: MIState
    trajectory: MIState


def init_mi_state() -> MIState:
    f0 = jnp.zeros((), jnp.float32)
    return MIState(
        ema_std=f0,
        ema_std_seq=f0,
        ema_initialised=jnp.zeros((), bool),
        baseline_mi_sum=f0,
        baseline_entropy_sum=f0,
        baseline_count=jnp.zeros((), jnp.int32),
        num_computed=jnp.zeros((), jnp.int32),
    )


def init_collapse_state() -> CollapseState:
    return CollapseState(first_turn=init_mi_state(), trajectory=init_mi_state())


def should_compute(step: jax.Array, compute_freq: int) -> jax.Array:
    """Whether the 0-based update ``step`` computes diagnostics: global step 1 and every ``compute_freq``."""
    global_step = step + 1
    return (global_step == 1) | (global_step % compute_freq == 0)


# ---------------------------------------------------------------------------------------------------
# Pair sampling


def valid_reasoning(traj: Trajectory) -> jax.Array:
    """bool [B, T]: turn took place and its reasoning span is non-empty (empty reasoning excluded)."""
    return traj.turn_mask & (traj.reasoning_end > traj.reasoning_start)


def _prompts_equal(tokens: jax.Array, rows_a, ends_a, rows_b, ends_b) -> jax.Array:
    """bool [...]: ``tokens[rows_a, :ends_a] == tokens[rows_b, :ends_b]`` as token sequences."""
    pos = jnp.arange(tokens.shape[1])
    same_tok = (tokens[rows_a] == tokens[rows_b]) | (pos >= ends_a[..., None])
    return (ends_a == ends_b) & jnp.all(same_tok, axis=-1)


def sample_first_turn(key: jax.Array, traj: Trajectory, num_samples: int, num_groups: int) -> PairSample:
    """First-turn pairs: ``min(num_samples, B)`` rows without replacement, one column per env group.

    Sampling without replacement with static shapes: every valid row gets a uniform key, invalid rows
    get -1, and ``top_k`` keeps the largest keys — a uniformly random subset of the valid rows (all of
    them when there are fewer than ``num_samples``); surplus slots are masked out.
    """
    batch = traj.batch_size
    size = min(num_samples, batch)
    valid = valid_reasoning(traj)[:, 0]
    keys = jnp.where(valid, jax.random.uniform(key, (batch,)), -1.0)
    _, rows = jax.lax.top_k(keys, size)
    z_valid = valid[rows]
    group = jnp.clip(traj.group_ids[rows], 0, num_groups - 1)

    # Column g's prompt is the first turn of the first row of group g.
    in_group = traj.group_ids[None, :] == jnp.arange(num_groups)[:, None]  # [G, B]
    x_rows = jnp.argmax(in_group, axis=1).astype(jnp.int32)
    sampled_in = jnp.any((group[None, :] == jnp.arange(num_groups)[:, None]) & z_valid[None, :], axis=1)
    x_valid = sampled_in & jnp.any(in_group, axis=1)

    # The column identity assumes every member of a group shares its first prompt (true for the
    # same-seed groups of Sokoban / FrozenLake; not for e.g. Bandit). Verify rather than trust it.
    pe = traj.prompt_end[:, 0]
    same = _prompts_equal(traj.tokens, rows, pe[rows], x_rows[group], pe[x_rows[group]])
    consistent = jnp.all(same | ~z_valid)
    zeros = jnp.zeros((size,), jnp.int32)
    return PairSample(
        z_rows=rows.astype(jnp.int32),
        z_turns=zeros,
        z_valid=z_valid,
        true_col=group.astype(jnp.int32),
        x_rows=x_rows,
        x_turns=jnp.zeros((num_groups,), jnp.int32),
        x_valid=x_valid,
        consistent=consistent,
    )


def sample_trajectory_uniform(key: jax.Array, traj: Trajectory, num_samples: int,
                              episode_ids: Optional[jax.Array] = None) -> PairSample:
    """Trajectory-uniform pairs: ``num_samples`` slots, the first ``min(num_samples, #valid turns)`` real.

    Each draw picks a trajectory uniformly among those with at least one valid turn, then one of its
    valid turns uniformly (with replacement). Every draw is its own column.

    ``episode_ids`` int32 [rows]: the rows are turns of those episodes (``turn_rows``, one turn per
    row); a row is then drawn with probability 1 / (#episodes with a valid turn × #valid turns of
    its episode) — the same distribution over turns as drawing the episode, then its turn.
    """
    valid = valid_reasoning(traj)  # [B, T]
    has_any = jnp.any(valid, axis=1)
    key_row, key_turn = jax.random.split(key)
    row_logits = jnp.where(has_any, 0.0, -jnp.inf)
    if episode_ids is not None:
        per_episode = jnp.zeros_like(has_any, jnp.float32).at[episode_ids].add(has_any.astype(jnp.float32))
        row_logits = row_logits - jnp.log(jnp.maximum(per_episode[episode_ids], 1.0))
    # With no valid turn at all every logit is -inf; sample from a uniform instead (all slots masked).
    row_logits = jnp.where(jnp.any(has_any), row_logits, 0.0)
    rows = jax.random.categorical(key_row, row_logits, shape=(num_samples,))
    turn_logits = jnp.where(valid[rows], 0.0, -jnp.inf)
    turn_logits = jnp.where(jnp.any(valid[rows], axis=1, keepdims=True), turn_logits, 0.0)
    turns = jax.random.categorical(key_turn, turn_logits, axis=-1)
    num_draws = jnp.minimum(num_samples, jnp.sum(valid))
    z_valid = jnp.arange(num_samples) < num_draws
    rows = rows.astype(jnp.int32)
    turns = turns.astype(jnp.int32)
    return PairSample(
        z_rows=rows,
        z_turns=turns,
        z_valid=z_valid,
        true_col=jnp.arange(num_samples, dtype=jnp.int32),
        x_rows=rows,
        x_turns=turns,
        x_valid=z_valid,
        consistent=jnp.ones((), bool),
    )


def column_equivalence(traj: Trajectory, sample: PairSample) -> jax.Array:
    """bool [N, N]: columns whose prompts are identical token sequences ("signatures")."""
    ends = traj.prompt_end[sample.x_rows, sample.x_turns]
    rows_a = sample.x_rows[:, None]
    rows_b = sample.x_rows[None, :]
    n = sample.x_rows.shape[0]
    ends_a = jnp.broadcast_to(ends[:, None], (n, n))
    ends_b = jnp.broadcast_to(ends[None, :], (n, n))
    return _prompts_equal(traj.tokens, rows_a, ends_a, rows_b, ends_b)


# ---------------------------------------------------------------------------------------------------
# Cross log-probability matrix


def cross_logprob_matrix(
    logprob_fn: LogProbFn,
    tokens: jax.Array,
    x_rows: jax.Array,
    x_len: jax.Array,
    z_rows: jax.Array,
    z_start: jax.Array,
    z_len: jax.Array,
    *,
    max_reasoning_tokens: int,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced log-prob of every reasoning z_i under every prompt x_j.

    For each pair the sequence ``[x_j | z_i]`` is gathered into a right-padded buffer of static length
    ``L + max_reasoning_tokens`` (positions 0..len-1) and scored with ``logprob_fn``. The ``S * N``
    sequences are processed ``chunk_size`` at a time under ``lax.map``, which bounds the live
    activations to one chunk.

    Args:
      tokens: int32 [B, L] the conversations.
      x_rows, x_len: int32 [N] prompt j is ``tokens[x_rows[j], :x_len[j]]``.
      z_rows, z_start, z_len: int32 [S] reasoning i is ``tokens[z_rows[i], z_start[i]:z_start[i]+z_len[i]]``;
        spans longer than ``max_reasoning_tokens`` are truncated to it.
    Returns:
      (ℓ_sum, ℓ_mean): float32 [S, N] summed and per-token-mean log-probs of z_i given x_j
      (ℓ_mean uses ``max(z_len, 1)`` tokens; rows with an empty span are 0).
    """
    seq_len = tokens.shape[1]
    buf_len = seq_len + max_reasoning_tokens
    num_z, num_x = z_rows.shape[0], x_rows.shape[0]
    z_len = jnp.clip(z_len, 0, max_reasoning_tokens)
    x_len = jnp.clip(x_len, 1, seq_len)  # the first z token needs a predecessor

    num_pairs = num_z * num_x
    num_chunks = -(-num_pairs // chunk_size)
    pair = jnp.arange(num_chunks * chunk_size) % num_pairs  # padded pairs repeat pair 0.. (ignored)
    pos = jnp.arange(buf_len)

    def score_chunk(pair_chunk):
        i, j = pair_chunk // num_x, pair_chunk % num_x
        xl, zl = x_len[j][:, None], z_len[i][:, None]
        in_x = pos < xl
        in_z = (pos >= xl) & (pos < xl + zl)
        src_row = jnp.where(in_x, x_rows[j][:, None], z_rows[i][:, None])
        src_col = jnp.where(in_x, pos, z_start[i][:, None] + pos - xl)
        buf = tokens[src_row, jnp.clip(src_col, 0, seq_len - 1)]
        buf = jnp.where(in_x | in_z, buf, 0)
        logp = logprob_fn(buf)
        return jnp.sum(jnp.where(in_z, logp, 0.0), axis=-1)

    chunks = pair.reshape(num_chunks, chunk_size)
    l_sum = jax.lax.map(score_chunk, chunks).reshape(-1)[:num_pairs].reshape(num_z, num_x)
    l_sum = l_sum.astype(jnp.float32)
    l_mean = l_sum / jnp.maximum(z_len, 1)[:, None].astype(jnp.float32)
    return l_sum, l_mean


# ---------------------------------------------------------------------------------------------------
# Estimates from the matrix


def _marginal(l: jax.Array, x_valid: jax.Array, num_cols: jax.Array) -> jax.Array:
    """float32 [S]: log of the uniform prompt mixture, logsumexp over valid columns − log N."""
    masked = jnp.where(x_valid[None, :], l, -jnp.inf)
    return jax.nn.logsumexp(masked, axis=1) - jnp.log(jnp.maximum(num_cols, 1).astype(jnp.float32))


def mi_estimates(
    l_sum: jax.Array,
    l_mean: jax.Array,
    z_valid: jax.Array,
    x_valid: jax.Array,
    true_col: jax.Array,
    col_equiv: jax.Array,
    state: MIState,
    *,
    ema: float,
    std_eps: float,
) -> tuple[dict[str, jax.Array], MIState]:
    """The estimates for both ℓ_mean (per token) and ℓ_sum (``_seq``) from one cross matrix.

    Args:
      l_sum, l_mean: float32 [S, N] cross log-probs.
      z_valid: bool [S] real rows; x_valid: bool [N] real columns (N counts these).
      true_col: int32 [S] each row's own column; col_equiv: bool [N, N] identical prompts.
      state: the EMA of the marginal std carried between computations.
    Returns:
      (metrics, state with the EMAs advanced). Metrics need N >= 2 and one valid row; otherwise they
      are all 0, ``computed`` is 0 and the state is returned unchanged.
    """
    num_cols = jnp.sum(x_valid)
    num_rows = jnp.sum(z_valid)
    ok = (num_cols >= 2) & (num_rows >= 1)
    n_f = jnp.maximum(num_cols, 1).astype(jnp.float32)
    rows = jnp.arange(l_sum.shape[0])

    out: dict[str, jax.Array] = {}
    new_ema = {}
    for suffix, l, ema_prev in (("", l_mean, state.ema_std), ("_seq", l_sum, state.ema_std_seq)):
        matched = l[rows, true_col]
        marginal = _marginal(l, x_valid, num_cols)
        matched_mean = masked_mean(matched, z_valid)
        marginal_mean = masked_mean(marginal, z_valid)
        gap = matched - marginal
        std = jnp.sqrt(masked_mean(jnp.square(marginal - marginal_mean), z_valid))  # population std
        ema_std = jnp.where(state.ema_initialised, ema * ema_prev + (1.0 - ema) * std, std)
        new_ema[suffix] = ema_std
        out[f"mi{suffix}_estimate"] = matched_mean - marginal_mean
        out[f"matched_log_prob{suffix}_mean"] = matched_mean
        out[f"marginal_log_prob{suffix}_mean"] = marginal_mean
        out[f"conditional_entropy{suffix}_est"] = -matched_mean
        out[f"reasoning_entropy{suffix}_est"] = -marginal_mean
        out[f"marginal_std{suffix}"] = std
        out[f"mi_zscore{suffix}"] = masked_mean(gap / (std + std_eps), z_valid)
        out[f"marginal_std_ema{suffix}"] = ema_std
        out[f"mi_zscore_ema{suffix}"] = masked_mean(gap / (ema_std + std_eps), z_valid)
    out["mi_upper_bound"] = jnp.log(n_f)

    out.update(_retrieval_metrics(l_mean, z_valid, x_valid, true_col, col_equiv, num_cols))
    out["num_samples"] = num_rows.astype(jnp.float32)
    out["num_prompts"] = num_cols.astype(jnp.float32)

    out = {k: jnp.where(ok, v, 0.0).astype(jnp.float32) for k, v in out.items()}
    out["computed"] = ok.astype(jnp.float32)
    state = state.replace(
        ema_std=jnp.where(ok, new_ema[""], state.ema_std),
        ema_std_seq=jnp.where(ok, new_ema["_seq"], state.ema_std_seq),
        ema_initialised=state.ema_initialised | ok,
        num_computed=state.num_computed + ok.astype(jnp.int32),
    )
    return out, state


def _retrieval_metrics(l_mean, z_valid, x_valid, true_col, col_equiv, num_cols) -> dict[str, jax.Array]:
    """Retrieval accuracy@k against chance: does a reasoning's own prompt score it highest?"""
    out = {}
    n_f = jnp.maximum(num_cols, 1).astype(jnp.float32)
    # Predict the column with the highest per-token log-prob (the per-sequence matrix has the
    # same argmax per row, it differs by the positive factor len(z_i)). Equivalent prompts count as hits.
    masked = jnp.where(x_valid[None, :], l_mean, -jnp.inf)
    num_x = l_mean.shape[1]
    k_static = min(8, num_x)
    _, top = jax.lax.top_k(masked, k_static)  # [S, k_static], best first
    hit = col_equiv[top, true_col[:, None]]  # [S, k_static]
    same_sig = jnp.sum(col_equiv[true_col] & x_valid[None, :], axis=1)  # columns sharing z_i's signature
    chance = masked_mean(same_sig / n_f, z_valid)
    acc1 = masked_mean(hit[:, 0].astype(jnp.float32), z_valid)
    out["retrieval_accuracy"] = acc1
    out["retrieval_chance_level"] = chance
    out["retrieval_above_chance"] = acc1 - chance
    for k in RETRIEVAL_KS:
        k_eff = jnp.minimum(k, jnp.minimum(8, num_cols))
        in_top = jnp.arange(k_static)[None, :] < k_eff
        acc = masked_mean(jnp.any(hit & in_top, axis=1).astype(jnp.float32), z_valid)
        chance_k = jnp.minimum(1.0, chance * k_eff)
        out[f"retrieval_accuracy@{k}"] = acc
        out[f"retrieval_chance_level@{k}"] = chance_k
        out[f"retrieval_above_chance@{k}"] = acc - chance_k
    return out


def classify_regime(
    mi: jax.Array,
    cond_entropy: jax.Array,
    computed: jax.Array,
    state: MIState,
    *,
    baseline_steps: int,
    mi_ratio: float,
    entropy_ratio: float,
) -> tuple[jax.Array, MIState]:
    """Place (MI, H(Z|X)) in one of the four quadrants relative to the run's own baseline.

    The baseline is the mean per-token MI and H(Z|X) over the first ``baseline_steps`` computations
    (those computations report ``REGIME_BASELINE``). Afterwards:
      * MI is *low* when ``mi <= mi_ratio * max(baseline_mi, 0)`` — below the given fraction of the
        starting input dependence; a non-positive baseline (no measurable input dependence at the
        start) makes the threshold 0, i.e. low means no input dependence at all;
      * H(Z|X) is *low* when ``cond_entropy < entropy_ratio * baseline_entropy``.
    Both ratios default to 0.5 (config ``regime_mi_ratio`` / ``regime_entropy_ratio``): a halving of
    the quantity relative to the start of training.
    Returns (regime code as float32 [], updated state).
    """
    in_baseline = computed & (state.baseline_count < baseline_steps)
    state = state.replace(
        baseline_mi_sum=state.baseline_mi_sum + jnp.where(in_baseline, mi, 0.0),
        baseline_entropy_sum=state.baseline_entropy_sum + jnp.where(in_baseline, cond_entropy, 0.0),
        baseline_count=state.baseline_count + in_baseline.astype(jnp.int32),
    )
    count = jnp.maximum(state.baseline_count, 1).astype(jnp.float32)
    base_mi = state.baseline_mi_sum / count
    base_h = state.baseline_entropy_sum / count
    low_mi = mi <= mi_ratio * jnp.maximum(base_mi, 0.0)
    low_h = cond_entropy < entropy_ratio * base_h
    regime = jnp.where(
        low_mi,
        jnp.where(low_h, REGIME_LOW_ENTROPY_COLLAPSE, REGIME_TEMPLATE_COLLAPSE),
        jnp.where(low_h, REGIME_COMPRESSED, REGIME_DIVERSE),
    )
    established = state.baseline_count >= baseline_steps
    regime = jnp.where(computed & established & ~in_baseline, regime, REGIME_BASELINE)
    return regime.astype(jnp.float32), state


# ---------------------------------------------------------------------------------------------------
# Everything for one batch


def sample_cross_matrix(
    logprob_fn: LogProbFn, traj: Trajectory, sample: PairSample, cfg, cross_fn=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(ℓ_sum, ℓ_mean) float32 [S, N]`` of ``sample``'s pairs and the reasoning lengths ``z_len [S]``."""
    max_z = cfg.max_reasoning_tokens or traj.seq_len
    x_len = traj.prompt_end[sample.x_rows, sample.x_turns]
    z_start = traj.reasoning_start[sample.z_rows, sample.z_turns]
    z_len = traj.reasoning_end[sample.z_rows, sample.z_turns] - z_start
    z_len = jnp.where(sample.z_valid, z_len, 0)
    if cross_fn is None:
        cross_fn = functools.partial(cross_logprob_matrix, logprob_fn)
    l_sum, l_mean = cross_fn(traj.tokens, sample.x_rows, x_len, sample.z_rows, z_start, z_len,
                             max_reasoning_tokens=max_z, chunk_size=cfg.micro_batch_size)
    return l_sum, l_mean, z_len


def mi_by_sample(l_mean: jax.Array, sample: PairSample) -> jax.Array:
    """float32 [S]: each reasoning's own-prompt log-prob minus the uniform prompt mixture's (per token).

    ``mi_estimate`` is the mean of these over the valid rows; a row near 0 is a reasoning its own
    input explains no better than any other input — what template collapse looks like, one sample
    at a time (the diagnose notebook lists the lowest). Invalid rows are 0.
    """
    rows = jnp.arange(l_mean.shape[0])
    gap = l_mean[rows, sample.true_col] - _marginal(l_mean, sample.x_valid, jnp.sum(sample.x_valid))
    return jnp.where(sample.z_valid, gap, 0.0)


def first_turn_mi_by_sample(logprob_fn: LogProbFn, traj: Trajectory, key: jax.Array, cfg, *, num_groups: int,
                            cross_fn=None) -> tuple[PairSample, jax.Array]:
    """The first-turn pair sample of ``collapse_metrics`` and ``mi_by_sample`` of it: which episode's
    first reasoning (``sample.z_rows``) carries how much information about its board."""
    sample = sample_first_turn(key, traj, cfg.num_samples, num_groups)
    _, l_mean, _ = sample_cross_matrix(logprob_fn, traj, sample, cfg, cross_fn)
    return sample, mi_by_sample(l_mean, sample)


def _diagnose_sample(
    logprob_fn: LogProbFn,
    traj: Trajectory,
    sample: PairSample,
    state: MIState,
    cfg,
    cross_fn=None,
) -> tuple[dict[str, jax.Array], MIState]:
    max_z = cfg.max_reasoning_tokens or traj.seq_len
    l_sum, l_mean, z_len = sample_cross_matrix(logprob_fn, traj, sample, cfg, cross_fn)
    equiv = column_equivalence(traj, sample)
    metrics, state = mi_estimates(
        l_sum,
        l_mean,
        sample.z_valid & sample.consistent,
        sample.x_valid,
        sample.true_col,
        equiv,
        state,
        ema=cfg.ema,
        std_eps=cfg.std_eps,
    )
    regime, state = classify_regime(
        metrics["mi_estimate"],
        metrics["conditional_entropy_est"],
        metrics["computed"] > 0,
        state,
        baseline_steps=cfg.baseline_steps,
        mi_ratio=cfg.regime_mi_ratio,
        entropy_ratio=cfg.regime_entropy_ratio,
    )
    metrics["regime"] = regime
    metrics["prompts_consistent"] = sample.consistent.astype(jnp.float32)
    metrics["reasoning_truncated_fraction"] = masked_mean(
        (z_len > max_z).astype(jnp.float32), sample.z_valid
    )
    return metrics, state


def batch_thinking_stats(traj: Trajectory) -> dict[str, jax.Array]:
    """Valid-thinking rate over all turns and first-turn counts (cheap; logged every step)."""
    valid = valid_reasoning(traj)
    n_turns = jnp.sum(traj.turn_mask)
    first_total = jnp.sum(traj.turn_mask[:, 0])
    first_valid = jnp.sum(valid[:, 0])
    return {
        "collapse/valid_thinking_rate": jnp.sum(valid) / jnp.maximum(n_turns, 1),
        "collapse/first_turn_num_total": first_total.astype(jnp.float32),
        "collapse/first_turn_num_valid": first_valid.astype(jnp.float32),
        "collapse/first_turn_valid_rate": first_valid / jnp.maximum(first_total, 1),
    }


def collapse_metrics(
    logprob_fn: LogProbFn,
    traj: Trajectory,
    state: CollapseState,
    key: jax.Array,
    cfg,
    *,
    num_groups: int,
    cross_fn: Optional[Callable] = None,
    turn_rows=None,
) -> tuple[dict[str, jax.Array], CollapseState]:
    """All collapse diagnostics for one (pre-filter) batch; ``cfg`` is a ``CollapseConfig``.

    ``cross_fn`` (optional) replaces ``cross_logprob_matrix(logprob_fn, ...)`` with a scorer of the
    same contract, e.g. ``logprobs.make_prefix_cached_cross_scorer(model)``.

    ``turn_rows`` (a limited-context rollout's ``rollout.turn_rows.TurnRows``): X of a later turn is
    then the window that turn saw, so the trajectory sample scores on the per-turn rows. First
    turns saw the transcript's own prefix in every mode and are scored on ``traj``.

    Metric keys follow the original: ``collapse_first_turn_sample/<name>`` and
    ``collapse_trajectory_sample/<name>`` (``batch_thinking_stats`` gives the ``collapse/`` counters).
    """
    metrics = {}
    key_first, key_traj = jax.random.split(key)
    if cfg.first_turn_enabled:
        sample = sample_first_turn(key_first, traj, cfg.num_samples, num_groups)
        m, first = _diagnose_sample(logprob_fn, traj, sample, state.first_turn, cfg, cross_fn)
        metrics.update({f"collapse_first_turn_sample/{k}": v for k, v in m.items()})
        state = state.replace(first_turn=first)
    if cfg.trajectory_enabled:
        view, episode_ids = (traj, None) if turn_rows is None else (turn_rows.view, turn_rows.episode)
        sample = sample_trajectory_uniform(key_traj, view, cfg.num_samples, episode_ids)
        m, traj_state = _diagnose_sample(logprob_fn, view, sample, state.trajectory, cfg, cross_fn)
        metrics.update({f"collapse_trajectory_sample/{k}": v for k, v in m.items()})
        state = state.replace(trajectory=traj_state)
    return metrics, state


def maybe_collapse_metrics(
    logprob_fn: LogProbFn,
    traj: Trajectory,
    state: CollapseState,
    key: jax.Array,
    step: jax.Array,
    cfg,
    *,
    num_groups: int,
    cross_fn: Optional[Callable] = None,
    turn_rows=None,
) -> tuple[dict[str, jax.Array], CollapseState]:
    """``collapse_metrics`` under ``lax.cond`` on the step counter (inside the compiled update).

    On skipped steps every cross-scoring metric is 0 (NaN-free), the state is unchanged and
    ``collapse/computed`` is 0; the host logs those metrics only where that flag is 1. The cheap
    ``collapse/`` thinking-rate counters are computed every step.
    """
    stats = {k: v.astype(jnp.float32) for k, v in batch_thinking_stats(traj).items()}
    if not (cfg.first_turn_enabled or cfg.trajectory_enabled):
        return {**stats, "collapse/computed": jnp.zeros((), jnp.float32)}, state

    def compute(operand):
        st, k = operand
        return collapse_metrics(logprob_fn, traj, st, k, cfg, num_groups=num_groups, cross_fn=cross_fn,
                                turn_rows=turn_rows)

    def skip(operand):
        st, k = operand
        shapes = jax.eval_shape(compute, (st, k))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0]), st

    pred = should_compute(step, cfg.compute_freq)
    metrics, state = jax.lax.cond(pred, compute, skip, (state, key))
    metrics = {**stats, **metrics, "collapse/computed": pred.astype(jnp.float32)}
    return metrics, state

