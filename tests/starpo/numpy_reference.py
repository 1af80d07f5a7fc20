"""Slow, obviously-correct NumPy re-derivations of the StarPO algorithm core, for the tests.

Written from the specification text (spec §4.7, §5, §6) with plain Python loops over rows, tokens
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
# Episode-score normalisation (spec §4.7)
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
# Advantages (spec §5.2, §5.3)
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
    lengths = [float(sum(mask[b])) for b in range(mask.shape[0])]
    avg = mean(lengths)
    out = adv.copy()
    for b, n in enumerate(lengths):
        out[b] = adv[b] / ((n + 1e-6) / avg)
    return out
