"""NumPy re-derivations of the credit-assignment estimators (GiGPO, REINFORCE++, ReMax, OPO, GPG,
GRPO pass@k), written from their papers and from the reference implementations' descriptions
(verl v0.6.1 ``core_algos``, verl-agent ``gigpo/core_gigpo.py``), never from ``ragen_jax``.

Grouping is done the way the references do it — dictionaries keyed by group id, plain loops,
float64 — rather than with the reshapes our code uses. GiGPO is computed on the reference's own
data layout: one row per (episode, turn), each carrying its episode's score.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from tests.starpo.numpy_reference import mean, std_unbiased


def _whiten(x, mask):
    vals = [x[b, t] for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    mu = mean(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    return (x - mu) / math.sqrt(var + 1e-8) * mask


def _group_index(batch, group_size):
    return [b // group_size for b in range(batch)]


def reinforce_pp(rewards, mask, gamma):
    """verl: G = r_t + gamma G; returns_t = G; G <- G * m_t (reset off the mask); whitened."""
    B, L = rewards.shape
    ret = np.zeros((B, L))
    for b in range(B):
        running = 0.0
        for t in range(L - 1, -1, -1):
            running = rewards[b, t] + gamma * running
            ret[b, t] = running
            running = running * mask[b, t]
    return _whiten(ret * mask, mask), ret * mask


def reinforce_pp_multiturn(rewards, mask, gamma):
    """The return of token t: the discounted sum of the rewards on the sampled tokens from t on,
    counting only sampled tokens as time steps."""
    B, L = rewards.shape
    ret = np.zeros((B, L))
    for b in range(B):
        sampled = [t for t in range(L) if mask[b, t]]
        for i, t in enumerate(sampled):
            ret[b, t] = sum(gamma ** k * rewards[b, u] for k, u in enumerate(sampled[i:]))
    return _whiten(ret, mask), ret


def _group_mean_of_row(scores, group_size):
    """Each row's group mean of ``scores`` (0 for a group of one), collected through a dict."""
    by_group = defaultdict(list)
    for b, g in enumerate(_group_index(len(scores), group_size)):
        by_group[g].append(scores[b])
    return [0.0 if len(by_group[g]) == 1 else mean(by_group[g]) for g in _group_index(len(scores), group_size)]


def reinforce_pp_baseline(rewards, mask, group_size):
    scores = rewards.sum(axis=1)
    mu = _group_mean_of_row(scores, group_size)
    adv = np.stack([(scores[b] - mu[b]) * mask[b] for b in range(len(scores))])
    return _whiten(adv, mask)


def remax(rewards, mask, baselines):
    B, L = rewards.shape
    ret = np.zeros((B, L))
    for b in range(B):
        for t in range(L):
            ret[b, t] = sum(rewards[b, u] * mask[b, u] for u in range(t, L))
    adv = (ret - np.asarray(baselines)[:, None]) * mask
    return adv, ret * mask


def opo(rewards, mask, group_size):
    scores, lengths = rewards.sum(axis=1), mask.sum(axis=1)
    members = defaultdict(list)
    for b, g in enumerate(_group_index(len(scores), group_size)):
        members[g].append(b)
    adv = np.zeros_like(rewards)
    for g, rows in members.items():
        base = 0.0 if len(rows) == 1 else sum(lengths[b] * scores[b] for b in rows) / sum(lengths[b] for b in rows)
        for b in rows:
            adv[b] = (scores[b] - base) * mask[b]
    return adv


def gpg(rewards, mask, group_size, f_norm=1.0):
    """alpha = (rows that train) / (those with a non-zero score)."""
    scores = rewards.sum(axis=1)
    training = [b for b in range(len(scores)) if mask[b].any()]
    nonzero = [b for b in training if scores[b] != 0]
    alpha = len(training) / max(len(nonzero), 1)
    mu = _group_mean_of_row(scores, group_size)
    return np.stack([alpha * (scores[b] - mu[b]) / f_norm * mask[b] for b in range(len(scores))])


def grpo_passk(rewards, mask, group_size, norm_by_std=True):
    scores = rewards.sum(axis=1)
    adv = np.zeros_like(rewards)
    for start in range(0, len(scores), group_size):
        g = list(scores[start:start + group_size])
        order = sorted(range(len(g)), key=lambda i: (-g[i], i))  # best first, ties to the first row
        gap = g[order[0]] - g[order[1]]
        if norm_by_std:
            gap = gap / (std_unbiased(g) + 1e-6)
        adv[start + order[0]] = gap * mask[start + order[0]]
    return adv


def gigpo(episode_scores, turn_rewards, turn_mask, anchors, group_size, step_weight, gamma, norm):
    """Per-turn GiGPO advantages ``[B, T]`` on the reference's row-per-turn layout.

    ``anchors[b][t]`` is any hashable observation; ``norm`` is 'mean' (mean_norm) or 'std'
    (mean_std_norm). Groups whose values are all equal give 0 (see ``advantages.gigpo``).
    """
    B, T = turn_rewards.shape
    rows = [(b, t) for b in range(B) for t in range(T) if turn_mask[b, t]]
    uid = {b: b // group_size for b in range(B)}

    # Episode term: every turn row carries its episode's score (statistics across steps).
    per_uid = defaultdict(list)
    for b, _ in rows:
        per_uid[uid[b]].append(episode_scores[b])

    def normalise(x, values):
        if len(values) == 1:
            mu, sd = (0.0, 1.0)
        else:
            mu, sd = mean(values), std_unbiased(values)
        if norm == "mean":
            return x - mu
        return 0.0 if len(values) > 1 and sd <= 1e-6 else (x - mu) / (sd + 1e-6)

    # Step returns, Eq. 5, per trajectory over its turns.
    step_return = {}
    for b in range(B):
        turns = [t for t in range(T) if turn_mask[b, t]]
        running = 0.0
        for t in reversed(turns):
            running = turn_rewards[b, t] + gamma * running
            step_return[(b, t)] = running

    clusters = defaultdict(list)
    for b, t in rows:
        clusters[(uid[b], anchors[b][t])].append((b, t))

    out = np.zeros((B, T))
    for b, t in rows:
        a_e = normalise(episode_scores[b], per_uid[uid[b]])
        members = clusters[(uid[b], anchors[b][t])]
        values = [step_return[m] for m in members]
        if len(values) == 1:
            a_s = 0.0
        elif norm == "mean":
            a_s = step_return[(b, t)] - mean(values)
        else:
            sd = std_unbiased(values)
            a_s = 0.0 if sd <= 1e-6 else (step_return[(b, t)] - mean(values)) / (sd + 1e-6)
        out[b, t] = a_e + step_weight * a_s
    return out


# ---------------------------------------------------------------------------------------------
# Policy losses (verl v0.6.1's registry), per token, one row at a time
# ---------------------------------------------------------------------------------------------


def gspo(logp, old, adv, mask, lo, hi):
    """Per-token loss and d(loss_token)/d(logp_token) with the sequence ratio held fixed (GSPO's
    stop-gradient construction); clipfrac over the mask."""
    B, L = logp.shape
    loss, grad = np.zeros((B, L)), np.zeros((B, L))
    clipped = []
    for b in range(B):
        toks = [t for t in range(L) if mask[b, t]]
        if not toks:
            continue
        s = math.exp(min(sum(logp[b, t] - old[b, t] for t in toks) / len(toks), 10.0))
        for t in toks:
            l1 = -adv[b, t] * s
            l2 = -adv[b, t] * min(max(s, 1 - lo), 1 + hi)
            loss[b, t] = max(l1, l2)
            clipped.append(l2 > l1)
            grad[b, t] = -adv[b, t] * s if l1 >= l2 else 0.0
    return loss, grad, mean([float(c) for c in clipped])


def gmpo_rows(logp, old, adv, mask, lo, hi):
    """Per-sequence GMPO loss L_i for the rows with tokens."""
    out = []
    for b in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[b, t]]
        if not toks:
            continue
        ds = []
        for t in toks:
            d = logp[b, t] - old[b, t]
            dc = min(max(d, -lo), hi)
            sg = float(np.sign(adv[b, t]))
            ds.append(sg * min(sg * d, sg * dc))
        rho = math.exp(sum(ds) / len(toks))
        a = sum(adv[b, t] for t in toks) / len(toks)
        out.append(-a * rho)
    return out


def kl_cov(logp, old, adv, mask, ratio, coef):
    toks = [(b, t) for b in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[b, t]]
    a_mu = mean(adv[p] for p in toks)
    l_mu = mean(logp[p] for p in toks)
    cov = {p: (adv[p] - a_mu) * (logp[p] - l_mu) for p in toks}
    k = max(1, int(len(toks) * ratio))
    top = set(sorted(toks, key=lambda p: -cov[p])[:k])
    loss = np.zeros_like(logp)
    for p in toks:
        r = math.exp(logp[p] - old[p])
        loss[p] = -adv[p] * r + (coef * abs(logp[p] - old[p]) if p in top else 0.0)
    return loss


def clip_cov_candidates(logp, old, adv, mask, lo, hi, lb, ub):
    """The tokens Clip-Cov may cut, and the plain clipped loss of every token."""
    toks = [(b, t) for b in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[b, t]]
    a_mu = mean(adv[p] for p in toks)
    l_mu = mean(logp[p] for p in toks)
    loss = np.zeros_like(logp)
    cands = []
    for p in toks:
        r = math.exp(logp[p] - old[p])
        l1, l2 = -adv[p] * r, -adv[p] * min(max(r, 1 - lo), 1 + hi)
        loss[p] = max(l1, l2)
        cov = (adv[p] - a_mu) * (logp[p] - l_mu)
        if not l2 > l1 and lb < cov < ub:
            cands.append(p)
    return loss, cands, toks


def rollout_correction(logp, old, adv, mask, level, threshold):
    """Per-token loss value -A logp w and its gradient -A w (w held fixed)."""
    loss, grad = np.zeros_like(logp), np.zeros_like(logp)
    for b in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[b, t]]
        seq = math.exp(sum(logp[b, t] - old[b, t] for t in toks))
        for t in toks:
            r = math.exp(logp[b, t] - old[b, t]) if level == "token" else seq if level == "sequence" else 1.0
            w = min(r, threshold)
            loss[b, t] = -adv[b, t] * logp[b, t] * w
            grad[b, t] = -adv[b, t] * w
    return loss, grad


def _verl_masked_mean(values, mask, axis=None):
    """verl.utils.torch_functional.masked_mean: sum(values * mask) / (sum(mask) + 1e-8)."""
    return np.sum(values * mask, axis=axis) / (np.sum(mask, axis=axis) + 1e-8)


def _verl_agg_loss(loss_mat, loss_mask, mode):
    """verl's core_algos.agg_loss on one (micro-)batch, dp_size 1, no global batch info."""
    if mode == "token-mean":
        return np.sum(loss_mat * loss_mask) / np.sum(loss_mask)
    if mode == "seq-mean-token-sum":
        seq = np.sum(loss_mat * loss_mask, axis=-1)
        has = (np.sum(loss_mask, axis=-1) > 0).astype(float)
        return np.sum(seq * has) / np.sum(has)
    if mode == "seq-mean-token-mean":
        count = np.sum(loss_mask, axis=-1)
        seq = np.sum(loss_mat * loss_mask, axis=-1) / (count + 1e-8)
        has = (count > 0).astype(float)
        return np.sum(seq * has) / np.sum(has)
    raise ValueError(mode)


def verl_bypass_reinforce(logp, rollout_logp, adv, mask, *, rollout_is="token", is_threshold=2.0,
                          batch_normalize=False, rollout_rs=None, rs_upper=2.0, rs_lower=None, veto=None,
                          loss_agg_mode="token-mean"):
    """verl v0.7's ``compute_policy_loss_bypass_mode`` with ``loss_type='reinforce'``, re-derived in
    NumPy from its source (``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` and
    ``compute_policy_loss_reinforce``), on one batch. ``rollout_is`` / ``rollout_rs``: None = off.
    Returns ``(pg_loss, d pg_loss / d logp, ppo_kl, effective mask)`` (IS weights held fixed)."""
    mask = mask.astype(float)
    lr = logp - rollout_logp
    w = None
    if rollout_is is not None:
        if rollout_is == "token":
            w = np.exp(np.clip(lr, -20, 20))
        else:
            w = np.broadcast_to(np.exp(np.clip(np.sum(lr * mask, -1, keepdims=True), -20, 20)), lr.shape).copy()
        w = np.minimum(w * mask, is_threshold)
        if batch_normalize:
            if rollout_is == "token":
                mean = _verl_masked_mean(w, mask)
            else:
                seq_w = _verl_masked_mean(w, mask, axis=-1)
                has = (np.sum(mask, -1) > 0).astype(float)
                mean = np.sum(seq_w * has) / max(np.sum(has), 1e-8)
            if mean > 1e-8:
                w = w / mean
    effective = mask.copy()
    if rollout_rs is not None:
        lower = rs_lower if rs_lower is not None else 1.0 / rs_upper
        if rollout_rs == "token":
            r = np.exp(np.clip(lr, -20, 20))
        elif rollout_rs == "sequence":
            r = np.broadcast_to(np.exp(np.clip(np.sum(lr * mask, -1, keepdims=True), -20, 20)), lr.shape)
        else:  # geometric
            r = np.broadcast_to(np.exp(np.clip(_verl_masked_mean(lr, mask, axis=-1)[:, None], -20, 20)), lr.shape)
        effective = effective * ((r >= lower) & (r <= rs_upper))
    if veto is not None:
        catastrophic = (lr < np.log(veto)) & (mask > 0)
        effective = effective * (~catastrophic.any(-1, keepdims=True))
    weight = np.ones_like(lr) if w is None else w
    pg = -adv * logp * weight
    loss = _verl_agg_loss(pg, effective, loss_agg_mode)
    eps = 1e-6
    grad = np.zeros_like(logp)
    for idx in np.ndindex(*logp.shape):  # the gradient by central differences of the same formula
        bumped = []
        for sign in (1, -1):
            x = logp.copy()
            x[idx] += sign * eps
            bumped.append(_verl_agg_loss(-adv * x * weight, effective, loss_agg_mode))
        grad[idx] = (bumped[0] - bumped[1]) / (2 * eps)
    ppo_kl = _verl_masked_mean(-lr, effective)
    return loss, grad, ppo_kl, effective


def verl_agent_build_step_group(anchor_obs, index, similarity_thresh):
    """verl-agent's ``gigpo/core_gigpo.py::build_step_group`` with ``enable_similarity=True``,
    re-derived: per episode-group index, in array order, each text observation joins the first
    cluster whose representative (first member) it matches with
    ``SequenceMatcher(None, obs, rep).ratio() >= similarity_thresh``, else opens a cluster; each
    cluster gets a fresh uid string."""
    import uuid
    from difflib import SequenceMatcher

    assert 0.0 < similarity_thresh < 1.0
    uids = [None] * len(anchor_obs)
    for idx in sorted(set(index)):
        clusters = []
        for loc in [i for i, x in enumerate(index) if x == idx]:
            for cluster in clusters:
                if SequenceMatcher(None, anchor_obs[loc], cluster["rep"]).ratio() >= similarity_thresh:
                    cluster["locs"].append(loc)
                    break
            else:
                clusters.append({"rep": anchor_obs[loc], "locs": [loc]})
        for cluster in clusters:
            uid = str(uuid.uuid4())
            for loc in cluster["locs"]:
                uids[loc] = uid
    return uids
