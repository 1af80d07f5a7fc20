"""Collapse diagnostics (MI proxy): planted log-prob functions and a NumPy re-derivation of RAGEN-2's MI estimates.

All randomness is seeded (NumPy ``default_rng`` and ``jax.random.key`` with fixed seeds), so every
run sees the same matrices and samples.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragen_jax.starpo import collapse
from ragen_jax.config import CollapseConfig
from tests.starpo.traj_factory import THINK, Conversation, Turn, build_trajectory

VOCAB = 256
P_HIT = 0.9


# ---------------------------------------------------------------------------------------------------
# Planted log-prob functions (no model): logprob_fn(tokens [n, S]) -> [n, S]


def copy_logprob_fn(tokens):
    """Reasoning copies the prompt: p(tok_t) = 0.9 iff tok_t equals the key, the token just before the
    last <think> preceding t; the rest of the mass is spread uniformly over the other tokens."""
    n, s = tokens.shape
    idx = jnp.arange(s)
    think_pos = jnp.where(tokens == THINK, idx, -1)
    last_think = jax.lax.cummax(think_pos, axis=1)  # last <think> at or before t
    last_before = jnp.concatenate([jnp.full((n, 1), -1), last_think[:, :-1]], axis=1)  # strictly before t
    key = jnp.take_along_axis(tokens, jnp.clip(last_before - 1, 0, s - 1), axis=1)
    hit = (tokens == key) & (last_before >= 1)
    return jnp.where(hit, math.log(P_HIT), math.log((1 - P_HIT) / (VOCAB - 1)))


_UNIGRAM = jax.nn.log_softmax(jax.random.normal(jax.random.key(7), (VOCAB,)))


def ignore_logprob_fn(tokens):
    """Reasoning ignores the prompt: a fixed unigram distribution, whatever the context."""
    return _UNIGRAM[tokens]


# ---------------------------------------------------------------------------------------------------
# Synthetic batches


def make_batch(num_groups=4, group_size=4, turns=3, seed=0, empty_first=()):
    """Rows in contiguous groups; a group shares its first prompt. Obs key tokens are unique per
    (row, turn) after the first turn; the reasoning copies the turn's key token."""
    rng = np.random.default_rng(seed)
    convs, gids = [], []
    for g in range(num_groups):
        for m in range(group_size):
            row = g * group_size + m
            conv_turns = []
            for t in range(turns):
                key = 10 + g if t == 0 else 10 + num_groups + row * turns + t
                obs = [4, int(rng.integers(200, 250)), key] if t else [4, 5, key]
                n_reason = 0 if (t == 0 and row in empty_first) else int(rng.integers(2, 5))
                conv_turns.append(Turn(obs=obs, reasoning=[key] * n_reason, reward=float(rng.normal())))
            convs.append(Conversation(preamble=[7, 8], turns=conv_turns))
            gids.append(g)
    return build_trajectory(convs, gids)


@functools.lru_cache(maxsize=None)
def _jitted_planted(c, num_groups):
    def run(traj, copies, key):
        # One compile serves both planted policies: the choice is a traced flag.
        def planted(tokens):
            return jnp.where(copies, copy_logprob_fn(tokens), ignore_logprob_fn(tokens))

        return collapse.collapse_metrics(planted, traj, collapse.init_collapse_state(), key, c,
                                         num_groups=num_groups)

    return jax.jit(run)


def run_planted(copies, traj, c, num_groups, seed=0):
    """``collapse_metrics`` under a planted policy (compiled once: eager dispatch is slow on small CPUs)."""
    return _jitted_planted(c, num_groups)(traj, jnp.asarray(copies), jax.random.key(seed))


_jit_estimates = jax.jit(collapse.mi_estimates, static_argnames=("ema", "std_eps"))


def cfg(**kw):
    base = dict(num_samples=16, micro_batch_size=7, compute_freq=5, baseline_steps=1)
    base.update(kw)
    return CollapseConfig(**base)


# ---------------------------------------------------------------------------------------------------
# NumPy re-derivation of the MI estimates (loops, float64)


def np_estimates(l_mean, l_sum, z_valid, x_valid, true_col, equiv, ema_prev=None, ema=0.9, eps=1e-3):
    rows = [i for i in range(l_mean.shape[0]) if z_valid[i]]
    cols = [j for j in range(l_mean.shape[1]) if x_valid[j]]
    n = len(cols)
    out = {}
    for suffix, l in (("", l_mean), ("_seq", l_sum)):
        matched = np.array([l[i, true_col[i]] for i in rows], np.float64)
        marg = []
        for i in rows:
            vals = np.array([l[i, j] for j in cols], np.float64)
            mx = vals.max()
            marg.append(mx + math.log(np.exp(vals - mx).sum()) - math.log(n))
        marg = np.array(marg)
        std = math.sqrt(np.mean((marg - marg.mean()) ** 2))
        ema_std = std if ema_prev is None else ema * ema_prev[suffix] + (1 - ema) * std
        out[f"mi{suffix}_estimate"] = matched.mean() - marg.mean()
        out[f"matched_log_prob{suffix}_mean"] = matched.mean()
        out[f"marginal_log_prob{suffix}_mean"] = marg.mean()
        out[f"conditional_entropy{suffix}_est"] = -matched.mean()
        out[f"reasoning_entropy{suffix}_est"] = -marg.mean()
        out[f"marginal_std{suffix}"] = std
        out[f"mi_zscore{suffix}"] = np.mean((matched - marg) / (std + eps))
        out[f"marginal_std_ema{suffix}"] = ema_std
        out[f"mi_zscore_ema{suffix}"] = np.mean((matched - marg) / (ema_std + eps))
    out["mi_upper_bound"] = math.log(n)
    # Retrieval on the per-token matrix; ranking by value, ties broken towards the lower column index.
    hits = {k: [] for k in (1, 2, 4, 8)}
    chance_terms = []
    for i in rows:
        order = sorted(cols, key=lambda j: (-l_mean[i, j], j))
        for k in hits:
            k_eff = 1 if k == 1 else min(k, min(8, n))
            hits[k].append(any(equiv[j, true_col[i]] for j in order[:k_eff]))
        chance_terms.append(sum(equiv[true_col[i], j] for j in cols) / n)
    chance = float(np.mean(chance_terms))
    out["retrieval_accuracy"] = float(np.mean(hits[1]))
    out["retrieval_chance_level"] = chance
    out["retrieval_above_chance"] = out["retrieval_accuracy"] - chance
    for k in (2, 4, 8):
        k_eff = min(k, min(8, n))
        out[f"retrieval_accuracy@{k}"] = float(np.mean(hits[k]))
        out[f"retrieval_chance_level@{k}"] = min(1.0, chance * k_eff)
        out[f"retrieval_above_chance@{k}"] = out[f"retrieval_accuracy@{k}"] - min(1.0, chance * k_eff)
    out["num_samples"] = len(rows)
    out["num_prompts"] = n
    return out


def _random_case(seed, s=12, n=6):
    rng = np.random.default_rng(seed)
    l_mean = rng.normal(-2.0, 1.0, (s, n))
    z_len = rng.integers(1, 9, s)
    l_sum = l_mean * z_len[:, None]
    z_valid = rng.random(s) > 0.2
    x_valid = np.ones(n, bool)
    x_valid[rng.integers(0, n)] = False
    true_col = rng.choice(np.flatnonzero(x_valid), s)
    # Columns 0 and 1 (and their images) share a signature: an equivalence relation.
    sig = np.arange(n)
    sig[1] = 0
    sig[4] = 3
    equiv = sig[:, None] == sig[None, :]
    # Plant ties between equivalent columns for some rows.
    l_mean[:3, 1] = l_mean[:3, 0]
    l_sum = l_mean * z_len[:, None]
    return l_mean, l_sum, z_valid, x_valid, true_col, equiv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimates_match_numpy_rederivation(seed):
    l_mean, l_sum, z_valid, x_valid, true_col, equiv = _random_case(seed)
    c = cfg()
    state = collapse.init_mi_state()
    got, state = _jit_estimates(
        jnp.asarray(l_sum, jnp.float32), jnp.asarray(l_mean, jnp.float32), jnp.asarray(z_valid),
        jnp.asarray(x_valid), jnp.asarray(true_col, jnp.int32), jnp.asarray(equiv), state,
        ema=c.ema, std_eps=c.std_eps)
    want = np_estimates(l_mean, l_sum, z_valid, x_valid, true_col, equiv)
    assert float(got["computed"]) == 1.0
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, atol=2e-5, err_msg=k)
    # Second computation: the EMA of the marginal std advances from the first value.
    l_mean2, l_sum2, *_ = _random_case(seed + 100)
    got2, _ = _jit_estimates(
        jnp.asarray(l_sum2, jnp.float32), jnp.asarray(l_mean2, jnp.float32), jnp.asarray(z_valid),
        jnp.asarray(x_valid), jnp.asarray(true_col, jnp.int32), jnp.asarray(equiv), state,
        ema=c.ema, std_eps=c.std_eps)
    want2 = np_estimates(l_mean2, l_sum2, z_valid, x_valid, true_col, equiv,
                         ema_prev={"": want["marginal_std"], "_seq": want["marginal_std_seq"]})
    for k in ("marginal_std_ema", "mi_zscore_ema", "marginal_std_ema_seq", "mi_zscore_ema_seq"):
        np.testing.assert_allclose(float(got2[k]), want2[k], rtol=2e-5, atol=2e-5, err_msg=k)


def test_identity_mi_equals_entropy_difference():
    l_mean, l_sum, z_valid, x_valid, true_col, equiv = _random_case(3)
    got, _ = _jit_estimates(
        jnp.asarray(l_sum, jnp.float32), jnp.asarray(l_mean, jnp.float32), jnp.asarray(z_valid),
        jnp.asarray(x_valid), jnp.asarray(true_col, jnp.int32), jnp.asarray(equiv),
        collapse.init_mi_state(), ema=0.9, std_eps=1e-3)
    for s in ("", "_seq"):
        np.testing.assert_allclose(
            float(got[f"mi{s}_estimate"]),
            float(got[f"reasoning_entropy{s}_est"] - got[f"conditional_entropy{s}_est"]), atol=1e-5)


def test_identical_prompts_count_as_retrieval_hits():
    # Row 0's own column is 0, the argmax is column 1; columns 0 and 1 hold the same prompt.
    l = np.array([[-3.0, -1.0, -5.0], [-4.0, -6.0, -1.0]])
    equiv = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 1]], bool)
    got, _ = _jit_estimates(
        jnp.asarray(l), jnp.asarray(l), jnp.ones(2, bool), jnp.ones(3, bool), jnp.array([0, 2]),
        jnp.asarray(equiv), collapse.init_mi_state(), ema=0.9, std_eps=1e-3)
    assert float(got["retrieval_accuracy"]) == 1.0
    # Chance: row 0 shares its signature with 2 of 3 columns, row 1 with 1 of 3.
    np.testing.assert_allclose(float(got["retrieval_chance_level"]), (2 / 3 + 1 / 3) / 2, rtol=1e-6)
    # Without the equivalence the first row is a miss.
    got, _ = _jit_estimates(
        jnp.asarray(l), jnp.asarray(l), jnp.ones(2, bool), jnp.ones(3, bool), jnp.array([0, 2]),
        jnp.eye(3, dtype=bool), collapse.init_mi_state(), ema=0.9, std_eps=1e-3)
    assert float(got["retrieval_accuracy"]) == 0.5


def test_fewer_than_two_prompts_gives_zeros_not_nans():
    l = np.array([[-1.0, -2.0], [-1.5, -0.5]])
    state = collapse.init_mi_state()
    got, new_state = _jit_estimates(
        jnp.asarray(l), jnp.asarray(l), jnp.ones(2, bool), jnp.array([True, False]), jnp.array([0, 0]),
        jnp.eye(2, dtype=bool), state, ema=0.9, std_eps=1e-3)
    assert float(got["computed"]) == 0.0
    assert all(np.isfinite(float(v)) and float(v) == 0.0 for k, v in got.items())
    assert not bool(new_state.ema_initialised)


# ---------------------------------------------------------------------------------------------------
# Cross log-prob matrix against explicit concatenation


def _bigram_table():
    return np.asarray(jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (VOCAB, VOCAB)), axis=-1))


def test_cross_matrix_matches_explicit_concatenation():
    table = _bigram_table()

    def bigram_fn(tokens):
        prev = jnp.concatenate([tokens[:, :1], tokens[:, :-1]], axis=1)
        return jnp.asarray(table)[prev, tokens]

    traj = make_batch(num_groups=3, group_size=2, turns=2, seed=4)
    tokens = np.asarray(traj.tokens)
    rng = np.random.default_rng(5)
    b, t = tokens.shape[0], traj.max_turns
    x_rows, x_turns = rng.integers(0, b, 5), rng.integers(0, t, 5)
    z_rows, z_turns = rng.integers(0, b, 4), rng.integers(0, t, 4)
    pe = np.asarray(traj.prompt_end)
    rs, re_ = np.asarray(traj.reasoning_start), np.asarray(traj.reasoning_end)
    x_len = pe[x_rows, x_turns]
    z_start = rs[z_rows, z_turns]
    z_len = re_[z_rows, z_turns] - z_start
    max_z = 3  # some spans are longer: they are truncated to 3 tokens
    l_sum, l_mean = collapse.cross_logprob_matrix(
        bigram_fn, traj.tokens, jnp.asarray(x_rows), jnp.asarray(x_len), jnp.asarray(z_rows),
        jnp.asarray(z_start), jnp.asarray(z_len), max_reasoning_tokens=max_z, chunk_size=3)
    for i in range(4):
        for j in range(5):
            x = list(tokens[x_rows[j], : x_len[j]])
            zl = min(z_len[i], max_z)
            z = list(tokens[z_rows[i], z_start[i]: z_start[i] + zl])
            seq = x + z
            want = sum(table[seq[p - 1], seq[p]] for p in range(len(x), len(seq)))
            np.testing.assert_allclose(float(l_sum[i, j]), want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(float(l_mean[i, j]), want / max(zl, 1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Pair sampling


_first_turn = jax.jit(collapse.sample_first_turn, static_argnums=(2, 3))


def test_first_turn_sample_is_without_replacement_over_valid_rows():
    traj = make_batch(num_groups=4, group_size=4, empty_first=(1, 2, 9))
    for seed in range(5):
        s = _first_turn(jax.random.key(seed), traj, 10, 4)
        rows = np.asarray(s.z_rows)[np.asarray(s.z_valid)]
        assert len(rows) == 10 and len(set(rows.tolist())) == 10
        assert not set(rows.tolist()) & {1, 2, 9}
        np.testing.assert_array_equal(np.asarray(s.true_col)[np.asarray(s.z_valid)], rows // 4)
        assert bool(s.consistent)
    # More slots than valid rows: all 13 valid rows once, the rest masked out.
    s = _first_turn(jax.random.key(0), traj, 16, 4)
    assert sorted(np.asarray(s.z_rows)[np.asarray(s.z_valid)].tolist()) == sorted(set(range(16)) - {1, 2, 9})


def test_first_turn_sample_flags_groups_with_different_prompts():
    traj = make_batch(num_groups=2, group_size=2)
    tokens = traj.tokens.at[1, 0].set(99)  # row 1 (group 0) now has its own first prompt
    s = collapse.sample_first_turn(jax.random.key(0), traj.replace(tokens=tokens), 4, 2)
    assert not bool(s.consistent)


def test_trajectory_sample_draws_only_valid_turns():
    traj = make_batch(num_groups=2, group_size=3, turns=3, empty_first=(0, 4))
    tm = np.array(traj.turn_mask)
    tm[2, 2] = False  # an absent turn is never drawn
    traj = traj.replace(turn_mask=jnp.asarray(tm))
    valid = np.asarray(collapse.valid_reasoning(traj))
    s = collapse.sample_trajectory_uniform(jax.random.key(1), traj, num_samples=200)
    rows, turns = np.asarray(s.z_rows), np.asarray(s.z_turns)
    assert np.asarray(s.z_valid).sum() == min(200, valid.sum())
    assert valid[rows, turns].all()
    # Trajectory first, then turn: every row with a valid turn is drawn about equally often.
    counts = np.bincount(rows, minlength=6)
    assert counts.min() > 200 / 6 * 0.5


# ---------------------------------------------------------------------------------------------------
# End to end on planted policies


def test_planted_copying_policy_has_mi_near_log_n_and_perfect_retrieval():
    traj = make_batch(num_groups=4, group_size=4, turns=3)
    m, _ = run_planted(True, traj, cfg(), 4)
    ft = "collapse_first_turn_sample/"
    assert float(m[ft + "num_prompts"]) == 4
    np.testing.assert_allclose(float(m[ft + "mi_upper_bound"]), math.log(4), rtol=1e-6)
    assert float(m[ft + "mi_estimate"]) > 0.97 * math.log(4)
    assert float(m[ft + "retrieval_accuracy"]) == 1.0
    tr = "collapse_trajectory_sample/"
    n = float(m[tr + "num_prompts"])
    assert n == 16
    # Draws may repeat a (row, turn): identical prompts dilute the mixture but still count as hits.
    assert float(m[tr + "mi_estimate"]) > 0.8 * math.log(n)
    assert float(m[tr + "retrieval_accuracy"]) == 1.0
    assert float(m[tr + "retrieval_accuracy@8"]) == 1.0


def test_planted_prompt_blind_policy_has_zero_mi_and_chance_retrieval():
    traj = make_batch(num_groups=4, group_size=4, turns=3)
    m, _ = run_planted(False, traj, cfg(), 4)
    for kind in ("collapse_first_turn_sample/", "collapse_trajectory_sample/"):
        assert abs(float(m[kind + "mi_estimate"])) < 1e-5
        assert abs(float(m[kind + "mi_seq_estimate"])) < 1e-4
        assert abs(float(m[kind + "mi_zscore"])) < 1e-2
    ft = "collapse_first_turn_sample/"
    # 4 groups of 4: every group is a quarter of the sample, chance = 1/4, and ties give exactly that.
    np.testing.assert_allclose(float(m[ft + "retrieval_chance_level"]), 0.25, rtol=1e-6)
    np.testing.assert_allclose(float(m[ft + "retrieval_accuracy"]), 0.25, atol=1e-6)
    assert float(m["collapse_trajectory_sample/retrieval_accuracy"]) < 0.2


def test_valid_thinking_rate_counts_non_empty_reasoning():
    traj = make_batch(num_groups=2, group_size=2, turns=2, empty_first=(0, 3))
    stats = collapse.batch_thinking_stats(traj)
    np.testing.assert_allclose(float(stats["collapse/valid_thinking_rate"]), 6 / 8)
    assert float(stats["collapse/first_turn_num_valid"]) == 2
    np.testing.assert_allclose(float(stats["collapse/first_turn_valid_rate"]), 0.5)


def test_gated_by_step_inside_jit():
    traj = make_batch(num_groups=4, group_size=4, turns=2)
    c = cfg(compute_freq=3)
    traces = []

    @jax.jit
    def run(state, step):
        traces.append(1)
        return collapse.maybe_collapse_metrics(copy_logprob_fn, traj, state, jax.random.key(0), step, c,
                                               num_groups=4)

    state = collapse.init_collapse_state()
    flags = []
    for step in range(7):
        m, new_state = run(state, jnp.int32(step))
        flags.append(float(m["collapse/computed"]))
        assert all(np.isfinite(np.asarray(v)).all() for v in m.values())
        if flags[-1] == 0.0:
            assert float(m["collapse_first_turn_sample/mi_estimate"]) == 0.0
            assert int(new_state.first_turn.num_computed) == int(state.first_turn.num_computed)
        else:
            assert float(m["collapse_first_turn_sample/mi_estimate"]) > 1.0
        state = new_state
    # Global steps 1..7: step 1 and every third.
    assert flags == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert len(traces) == 1
    assert int(state.trajectory.num_computed) == 3


def test_regime_classification_against_baseline():
    state = collapse.init_mi_state()
    kw = dict(baseline_steps=2, mi_ratio=0.5, entropy_ratio=0.5)
    yes = jnp.array(True)
    r, state = collapse.classify_regime(jnp.float32(1.0), jnp.float32(2.0), yes, state, **kw)
    assert float(r) == collapse.REGIME_BASELINE
    r, state = collapse.classify_regime(jnp.float32(1.2), jnp.float32(2.4), yes, state, **kw)
    assert float(r) == collapse.REGIME_BASELINE  # baseline: MI 1.1, H(Z|X) 2.2
    cases = [((1.0, 2.0), collapse.REGIME_DIVERSE), ((0.3, 2.0), collapse.REGIME_TEMPLATE_COLLAPSE),
             ((1.0, 0.5), collapse.REGIME_COMPRESSED), ((0.3, 0.5), collapse.REGIME_LOW_ENTROPY_COLLAPSE)]
    for (mi, h), want in cases:
        r, state2 = collapse.classify_regime(jnp.float32(mi), jnp.float32(h), yes, state, **kw)
        assert float(r) == want, (mi, h)
        assert int(state2.baseline_count) == 2
    # A skipped computation neither classifies nor touches the baseline.
    r, state3 = collapse.classify_regime(jnp.float32(0.0), jnp.float32(0.0), jnp.array(False), state, **kw)
    assert float(r) == collapse.REGIME_BASELINE and float(state3.baseline_mi_sum) == float(state.baseline_mi_sum)


def test_collapse_config_validates():
    with pytest.raises(ValueError, match="unknown key collapse.num_sample; allowed: .*num_samples"):
        CollapseConfig.from_dict({"num_sample": 3})
    with pytest.raises(ValueError, match="collapse.ema"):
        CollapseConfig(ema=1.5)
    assert CollapseConfig.from_dict({"compute_freq": 2}).compute_freq == 2


def test_prefix_cached_scorer_matches_whole_sequence_scoring_on_a_decoder():
    from flax import nnx

    from ragen_jax.models import Decoder, ModelConfig
    from ragen_jax.starpo import logprobs

    model_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=8)
    model = Decoder(model_cfg, rngs=nnx.Rngs(0))
    traj = make_batch(num_groups=3, group_size=2, turns=2, seed=4)
    rng = np.random.default_rng(6)
    b, t = traj.batch_size, traj.max_turns
    x_rows, x_turns = rng.integers(0, b, 5), rng.integers(0, t, 5)
    z_rows, z_turns = rng.integers(0, b, 4), rng.integers(0, t, 4)
    pe = np.asarray(traj.prompt_end)
    rs, re_ = np.asarray(traj.reasoning_start), np.asarray(traj.reasoning_end)
    args = (traj.tokens, jnp.asarray(x_rows), jnp.asarray(pe[x_rows, x_turns]), jnp.asarray(z_rows),
            jnp.asarray(rs[z_rows, z_turns]), jnp.asarray(re_[z_rows, z_turns] - rs[z_rows, z_turns]))
    kw = dict(max_reasoning_tokens=3, chunk_size=3)  # some spans truncated; rows in chunks of 3
    whole = jax.jit(lambda *a: collapse.cross_logprob_matrix(
        logprobs.make_logprob_fn(model, chunk_size=8), *a, **kw))(*args)
    cached = jax.jit(lambda *a: logprobs.make_prefix_cached_cross_scorer(model, logprob_chunk_size=2)(*a, **kw))(*args)
    assert np.ptp(np.asarray(whole[0]), axis=1).min() > 0  # prompts change the scores
    np.testing.assert_allclose(np.asarray(cached[0]), np.asarray(whole[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cached[1]), np.asarray(whole[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_mi_by_sample_matches_numpy_and_averages_to_the_estimate(seed):
    """Per reasoning: own-prompt log-prob minus log of the uniform mixture over valid prompts."""
    l_mean, l_sum, z_valid, x_valid, true_col, equiv = _random_case(seed)
    sample = collapse.PairSample(
        z_rows=jnp.arange(len(z_valid), dtype=jnp.int32), z_turns=jnp.zeros(len(z_valid), jnp.int32),
        z_valid=jnp.asarray(z_valid), true_col=jnp.asarray(true_col, jnp.int32),
        x_rows=jnp.arange(len(x_valid), dtype=jnp.int32), x_turns=jnp.zeros(len(x_valid), jnp.int32),
        x_valid=jnp.asarray(x_valid), consistent=jnp.asarray(True))
    got = np.asarray(collapse.mi_by_sample(jnp.asarray(l_mean, jnp.float32), sample))
    cols = np.flatnonzero(x_valid)
    for i in range(len(z_valid)):
        mix = math.log(sum(math.exp(l_mean[i, j]) for j in cols) / len(cols))
        want = l_mean[i, true_col[i]] - mix if z_valid[i] else 0.0
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    est = np_estimates(l_mean, l_sum, z_valid, x_valid, true_col, equiv)["mi_estimate"]
    np.testing.assert_allclose(got[z_valid].mean(), est, rtol=1e-5, atol=1e-5)


def test_first_turn_mi_by_sample_separates_copying_from_blind_reasoning():
    traj = make_batch(num_groups=4, group_size=4, turns=3)
    c = cfg()
    for copies, low, high in ((True, 0.97 * math.log(4), math.log(4) + 1e-5), (False, -1e-5, 1e-5)):
        def planted(tokens, copies=copies):
            return jnp.where(copies, copy_logprob_fn(tokens), ignore_logprob_fn(tokens))

        sample, gap = collapse.first_turn_mi_by_sample(planted, traj, jax.random.key(0), c, num_groups=4)
        gap = np.asarray(gap)[np.asarray(sample.z_valid)]
        assert len(gap) == 16 and np.all(gap > low) and np.all(gap < high), (copies, gap)
