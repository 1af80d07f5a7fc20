"""Slow, obviously-correct NumPy re-derivations of the StarPO algorithm core, for the tests.

Written from RAGEN's definitions with plain Python loops over rows, tokens
and groups — never by calling ``ragen_jax.starpo``. Everything is float64.
Conventions are those of ``ragen_jax/starpo/advantages.py``: arrays are ``[B, L]`` on the token
axis, rows form contiguous groups of ``group_size``.
"""
from __future__ import annotations

import math

import numpy as np


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def std_unbiased(xs):
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def groups_of(values, group_size):
    """Splits a flat list into consecutive groups."""
    values = list(values)
    return [values[i:i + group_size] for i in range(0, len(values), group_size)]


# ---------------------------------------------------------------------------------------------
# Episode-score normalisation
# ---------------------------------------------------------------------------------------------


def normalize_scores(scores, method, group_size):
    scores = [float(s) for s in scores]
    if group_size == 1 or method == "identity":
        return np.array(scores)
    out = []
    for g in groups_of(scores, group_size):
        mu, sd = mean(g), std_unbiased(g)
        for x in g:
            if method == "mean":
                out.append(x - mu)
            elif method in ("mean_std", "asym_clip"):
                y = 0.0 if sd <= 1e-6 else (x - mu) / (sd + 1e-6)
                if method == "asym_clip":
                    y = min(max(y, -1.0), 3.0)
                out.append(y)
            else:
                raise KeyError(method)
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------


def gae(rewards, values, mask, gamma, lam):
    """verl-style GAE with the masked-carry rule, one row at a time."""
    B, L = rewards.shape
    adv = np.zeros((B, L))
    for b in range(B):
        next_v, running = 0.0, 0.0
        for t in range(L - 1, -1, -1):
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            candidate = delta + gamma * lam * running
            if mask[b, t]:
                next_v = values[b, t]
                running = candidate
                adv[b, t] = candidate
    returns = (adv + values) * mask
    return adv, returns


def bilevel_gae(rewards, values, mask, turn_ids, gamma, lam, high_gamma):
    """Turn-level GAE over turn ends, then token-level GAE inside each turn (lists, not a scan)."""
    B, L = rewards.shape
    adv = np.zeros((B, L))
    for b in range(B):
        # Sampled positions of each turn, in order of appearance.
        turns = []  # list of (turn_id, [positions])
        for t in range(L):
            if not mask[b, t]:
                continue
            if turns and turns[-1][0] == turn_ids[b, t]:
                turns[-1][1].append(t)
            else:
                turns.append((turn_ids[b, t], [t]))
        ends = [positions[-1] for _, positions in turns]
        k_turns = len(ends)
        high_adv = [0.0] * k_turns
        following = 0.0
        for k in range(k_turns - 1, -1, -1):
            v_next = values[b, ends[k + 1]] if k + 1 < k_turns else 0.0
            delta = rewards[b, ends[k]] + high_gamma * v_next - values[b, ends[k]]
            following = delta + high_gamma * lam * following
            high_adv[k] = following
        for k, (_, positions) in enumerate(turns):
            turn_return = high_adv[k] + values[b, ends[k]]
            adv[b, positions[-1]] = turn_return - values[b, positions[-1]]
            for i in range(len(positions) - 2, -1, -1):
                t, t_next = positions[i], positions[i + 1]
                delta = rewards[b, t] + gamma * values[b, t_next] - values[b, t]
                adv[b, t] = delta + gamma * lam * adv[b, t_next]
    returns = (adv + values) * mask
    return adv, returns


def grpo(rewards, mask, group_size, scale_by_std=True):
    B = rewards.shape[0]
    scores = [float(sum(rewards[b])) for b in range(B)]
    adv_row = []
    for g in groups_of(scores, group_size):
        if len(g) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu, sd = mean(g), std_unbiased(g)
        for s in g:
            adv_row.append((s - mu) / (sd + 1e-6) if scale_by_std else s - mu)
    adv = np.array(adv_row)[:, None] * mask
    return adv, adv.copy()


def whiten(x, mask):
    vals = [x[b, t] for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    mu = mean(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return (x - mu) / math.sqrt(var + 1e-8) * mask


def length_weight(adv, mask):
    """The mean length is over the rows that train: the original drops filtered rows from the
    batch before weighting (here they are the rows with no loss tokens)."""
    lengths = [float(sum(mask[b])) for b in range(mask.shape[0])]
    avg = mean([n for n in lengths if n > 0] or [0.0])
    out = adv.copy()
    for b, n in enumerate(lengths):
        out[b] = adv[b] / ((n + 1e-6) / avg)
    return out


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def ppo_token(logp, old_logp, adv, eps_low, eps_high, c):
    """Clipped surrogate of one token; returns (loss, clipped, dual_clip_binds, approx_kl)."""
    delta = min(max(logp - old_logp, -20.0), 20.0)
    ratio = math.exp(delta)
    l1 = -adv * ratio
    l2 = -adv * min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)
    lc = max(l1, l2)
    binds = False
    loss = lc
    if c is not None and adv < 0:
        l3 = -adv * c
        binds = lc > l3
        loss = min(lc, l3)
    return loss, l2 > l1, binds, -delta


def ppo(logp, old_logp, adv, mask, eps_low, eps_high, c):
    B, L = logp.shape
    loss = np.zeros((B, L))
    clipped, lower, kls = [], [], []
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            loss[b, t], cl, lo, kl = ppo_token(logp[b, t], old_logp[b, t], adv[b, t], eps_low, eps_high, c)
            clipped.append(float(cl))
            lower.append(float(lo))
            kls.append(kl)
    return loss, {"pg_clipfrac": mean(clipped), "pg_clipfrac_lower": mean(lower), "ppo_kl": mean(kls)}


def kl_token(name, logp, ref):
    base = name.rstrip("+")
    if base in ("kl", "k1"):
        return logp - ref
    if base == "abs":
        return abs(logp - ref)
    if base in ("mse", "k2"):
        return 0.5 * (logp - ref) ** 2
    if base in ("low_var_kl", "k3"):
        d = min(max(ref - logp, -20.0), 20.0)
        return min(max(math.exp(d) - d - 1.0, -10.0), 10.0)
    raise KeyError(name)


def aggregate(x, mask, mode, row_weights=None):
    """(numerator, denominator) with explicit loops."""
    B, L = x.shape
    w = [1.0] * B if row_weights is None else [float(v) for v in row_weights]
    num = den = 0.0
    for b in range(B):
        n = sum(float(mask[b, t]) for t in range(L))
        s = sum(float(mask[b, t]) * x[b, t] for t in range(L))
        if mode == "token-mean":
            num += w[b] * s
            den += w[b] * n
        elif mode == "seq-mean-token-mean":
            if n > 0:
                num += w[b] * s / n
                den += w[b]
        elif mode == "seq-mean-token-sum":
            if n > 0:
                num += w[b] * s
                den += w[b]
        elif mode == "seq-mean-token-sum-norm":  # verl's agg_loss: sum of everything / L
            num += w[b] * s
            den = float(L)
        elif mode == "drgrpo-token-sum-norm":  # Dr. GRPO: mean over responses of sum / L
            num += w[b] * s
            den += w[b] * L
        else:
            raise KeyError(mode)
    return num, den


def value_loss(v, v_old, ret, mask, clip):
    B, L = v.shape
    loss = np.zeros((B, L))
    clipped, preds = [], []
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            vc = min(max(v[b, t], v_old[b, t] - clip), v_old[b, t] + clip)
            a, c = (v[b, t] - ret[b, t]) ** 2, (vc - ret[b, t]) ** 2
            loss[b, t] = 0.5 * max(a, c)
            clipped.append(float(c > a))
            preds.append(v[b, t])
    return loss, {"vf_clipfrac": mean(clipped), "vpred_mean": mean(preds)}


# ---------------------------------------------------------------------------------------------
# SNR-adaptive rollout filter
# ---------------------------------------------------------------------------------------------


def group_score(per_row, group_size, metric):
    out = []
    for g in groups_of([float(v) for v in per_row], group_size):
        if metric in ("reward_variance", "reward_std", "entropy_variance", "entropy_std"):
            out.append(std_unbiased(g))
        elif metric in ("reward", "length", "entropy"):
            out.append(mean(g))
        elif metric == "reward_sum":
            out.append(sum(g))
        else:
            raise KeyError(metric)
    return out


def select_groups(scores, strategy, value, largest=True, include_zero=True, mode="linear", eps=0.01):
    """Indices of kept groups (hard strategies) or a weight list (``weighted``), by RAGEN's walk."""
    G = len(scores)
    remaining = [i for i in range(G) if include_zero or abs(scores[i]) > 1e-10]
    if not remaining:
        return [0.0] * G
    # Stable sort, best first.
    ordered = sorted(remaining, key=(lambda i: -scores[i]) if largest else (lambda i: scores[i]))
    chosen = []
    if strategy == "top_p":
        if value >= 1.0:
            chosen = remaining
        elif mode == "linear":
            threshold = value * sum(scores[i] for i in remaining) - eps
            cum, walked = 0.0, []
            for i in ordered:
                if cum >= threshold:
                    break
                if scores[i] <= 0:
                    break
                walked.append(i)
                cum += scores[i]
            chosen = walked if cum >= threshold else []
        else:
            logits = [scores[i] if largest else -scores[i] for i in ordered]
            top = max(logits)
            exps = [math.exp(z - top) for z in logits]
            total = sum(exps)
            cum, k = 0.0, len(ordered)
            for j, e in enumerate(exps):
                cum += e / total
                if cum >= value:
                    k = j + 1
                    break
            chosen = ordered[:min(k, len(ordered))]
    elif strategy == "top_k":
        k = max(1, min(int(value * G), len(remaining)))
        chosen = ordered[:k]
    elif strategy == "top_k_abs":
        k = max(1, min(int(value), len(remaining)))
        chosen = ordered[:k]
    elif strategy == "min_p":
        if largest:
            best = max(scores[i] for i in remaining)
            chosen = [i for i in remaining if scores[i] >= best * value - 1e-10]
        else:
            best = min(scores[i] for i in remaining)
            chosen = [i for i in remaining if scores[i] <= best / (value + 1e-10) + 1e-10]
    elif strategy == "weighted":
        if largest:
            raw = {i: max(scores[i], 0.0) for i in remaining}
        else:
            top = max(scores[i] for i in remaining)
            raw = {i: top - scores[i] for i in remaining}
        total = sum(raw.values())
        weights = [0.0] * G
        for i in remaining:
            weights[i] = raw[i] * len(remaining) / total if total > 0 else 1.0
        return weights
    else:
        raise KeyError(strategy)
    return [1.0 if i in chosen else 0.0 for i in range(G)]


def filter_metrics(per_row, group_size, weights, source):
    """RAGEN metrics: means over groups of per-group std/max/mean/sum, before and over kept groups."""
    groups = groups_of([float(v) for v in per_row], group_size)
    stats = {"std": [std_unbiased(g) for g in groups], "max": [max(g) for g in groups],
             "mean": [mean(g) for g in groups], "sum": [sum(g) for g in groups]}
    out = {}
    total_w = sum(weights)
    for name, vals in stats.items():
        before = mean(vals)
        after = sum(w * v for w, v in zip(weights, vals)) / total_w if total_w > 0 else 0.0
        out[f"rollout/in_group_{source}_{name}"] = before
        out[f"rollout/chosen_in_group_{source}_{name}"] = after
    kept = sum(1 for w in weights if w > 0)
    out["rollout/filter_kept_count"] = kept
    out["rollout/filter_kept_ratio"] = kept / len(groups)
    return out


def rloo(rewards, mask, group_size):
    """Leave-one-out baseline, literally: mean over the other members of the group."""
    scores = [float(sum(rewards[b])) for b in range(rewards.shape[0])]
    out = []
    for g in groups_of(scores, group_size):
        for i, s in enumerate(g):
            others = g[:i] + g[i + 1:]
            out.append(s - (mean(others) if others else 0.0))
    adv = np.array(out)[:, None] * mask
    return adv, adv.copy()


def soft_advantage_weights(scores, group_size):
    stds = [1.0 if len(g) == 1 else std_unbiased(g) for g in groups_of(scores, group_size)]
    top = max(stds)
    return np.repeat([s / (top + 1e-6) for s in stds], group_size)


def decoupled_ppo(logp, prox_logp, behav_logp, adv, mask, eps_low, eps_high, c, cap=0.0):
    """AReaL's decoupled PPO objective (arXiv 2505.24298, eq. 5), per token, as a loss to minimise:

        J_t = (pi_prox / pi_behav) * min(u A, clip(u, 1 - eps_low, 1 + eps_high) A),  u = pi_theta / pi_prox

    (with the dual clip for A < 0 as ``ppo_token``), L_t = -J_t; a token whose weight exceeds ``cap``
    (> 0) contributes 0. Returns (loss [B, L], d loss / d logp [B, L], mean weight over the mask)."""
    B, L = logp.shape
    loss, grad, weights = np.zeros((B, L)), np.zeros((B, L)), []
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            w = math.exp(min(max(prox_logp[b, t] - behav_logp[b, t], -20.0), 20.0))
            weights.append(w)
            if cap > 0 and w > cap:
                continue
            inner, clipped, binds, _ = ppo_token(logp[b, t], prox_logp[b, t], adv[b, t], eps_low, eps_high, c)
            loss[b, t] = w * inner
            u = math.exp(min(max(logp[b, t] - prox_logp[b, t], -20.0), 20.0))
            clamped = abs(logp[b, t] - prox_logp[b, t]) > 20.0
            # d(-A u)/d logp = -A u where the unclipped term is the one taken; clipped terms are constant.
            grad[b, t] = 0.0 if (clipped or binds or clamped) else -w * adv[b, t] * u
    return loss, grad, mean(weights)
