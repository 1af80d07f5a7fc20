"""Teacher-forced log-probs and entropies of a Trajectory under a Decoder, without [B, L, V] logits.

The trainer recomputes every sampled token's log-prob under the current policy at the rollout's
sampling temperature (``temperature``: logits / T, verl's convention; 1 by default), and under the
reference, and the critic's values. With a 150k vocabulary the full logits of a
batch would not fit, so the log-softmax is taken one chunk of positions at a time: the trunk runs
once to give hidden states ``[B, L, D]``, then a ``lax.scan`` over position chunks applies the LM
head, reduces each chunk to ``[B, chunk]`` log-probs and entropies, and drops the logits. The chunk
function is rematerialised (``jax.checkpoint``), so the backward pass also holds one chunk of
logits at a time.

Index convention (``rollout/trajectory.py``): ``out[:, t]`` scores ``tokens[:, t]`` from the logits at
``t - 1``; ``out[:, 0]`` is 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ragen_jax.models.kv_cache import broadcast_cache, init_cache


def positions_for(tokens: jax.Array) -> jax.Array:
    """int32 [B, L] positions 0..L-1: rows are right-padded, so padding never precedes a real token."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def _head_chunk(head_graphdef, head_state, hidden, targets, with_entropy: bool, temperature: float = 1.0):
    """hidden [B, c, D], targets int32 [B, c] -> (log p(target) [B, c], entropy [B, c]) in float32,
    of the distribution ``softmax(logits / temperature)``."""
    logits = nnx.merge(head_graphdef, head_state).logits(hidden)  # float32 [B, c, V]
    if temperature != 1.0:
        logits = logits / temperature
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    if not with_entropy:
        return picked, jnp.zeros_like(picked)
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return picked, entropy


def logprobs_from_hidden(
    model, hidden: jax.Array, tokens: jax.Array, *, chunk_size: int, with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies from final hidden states, chunked over positions.

    Args:
      model: a Decoder (its ``logits(hidden)`` head is used).
      hidden: [B, L, D] final-normed hidden states of ``tokens``.
      tokens: int32 [B, L].
      chunk_size: positions per chunk (the peak is one [B, chunk_size, V] logits block).
      temperature: static; the distribution scored is ``softmax(logits / temperature)``.
    Returns:
      (logp, entropy): float32 [B, L]; ``logp[:, t] = log pi(tokens[t] | tokens[:t])`` and
      ``entropy[:, t]`` the entropy of the distribution token t was drawn from; both 0 at t = 0.
    """
    batch, seq_len, dim = hidden.shape
    chunk = min(chunk_size, seq_len)
    num_chunks = -(-seq_len // chunk)
    padded = num_chunks * chunk
    # Position p predicts token p + 1; the last position predicts nothing (target 0, dropped below).
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1).astype(jnp.int32)
    hidden = jnp.pad(hidden, ((0, 0), (0, padded - seq_len), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padded - seq_len)))
    hidden = hidden.reshape(batch, num_chunks, chunk, dim).swapaxes(0, 1)
    targets = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

    graphdef, state = nnx.split(model)
    head = jax.checkpoint(_head_chunk, static_argnums=(0, 4, 5))

    def body(_, xs):
        h, tgt = xs
        return None, head(graphdef, state, h, tgt, with_entropy, float(temperature))

    _, (logp, ent) = jax.lax.scan(body, None, (hidden, targets))
    logp = logp.swapaxes(0, 1).reshape(batch, padded)[:, : seq_len - 1]
    ent = ent.swapaxes(0, 1).reshape(batch, padded)[:, : seq_len - 1]
    zero = jnp.zeros((batch, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def score_slots(scored: jax.Array, max_scored: int) -> jax.Array:
    """bool [B, L] -> int32 [B, K]: the marked positions of each row in order (K = ``max_scored``,
    at most L), -1 in the slots left over. Position 0 predicts nothing and is never a slot. A row that
    marks more than K positions keeps its first K (``unscored_count`` counts the rest)."""
    k = min(max_scored, scored.shape[1])
    scored = scored.at[:, 0].set(False)
    # A stable sort puts each row's marked positions first, in order.
    slots = jnp.argsort(~scored, axis=1, stable=True)[:, :k].astype(jnp.int32)
    return jnp.where(jnp.take_along_axis(scored, slots, axis=1), slots, -1)


def unscored_count(scored: jax.Array, max_scored: int) -> jax.Array:
    """int32: marked positions beyond ``max_scored`` in their row (left unscored; 0 when the bound holds)."""
    per_row = jnp.sum(scored[:, 1:], axis=1)
    return jnp.sum(jnp.maximum(per_row - min(max_scored, scored.shape[1]), 0)).astype(jnp.int32)


def scored_logprobs_from_hidden(
    model, hidden: jax.Array, tokens: jax.Array, slots: jax.Array, *, chunk_size: int,
    with_entropy: bool = True, temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``logprobs_from_hidden`` at the positions ``slots`` lists only, zeros elsewhere.

    The loss reads a token's log-prob only where its mask is set (the replies: ~50 of a few hundred
    positions of a turn row), yet the LM head is the widest matmul of the model (vocabulary columns)
    and its log-softmax and entropy run over that width too. Here the hidden states that predict the
    listed tokens are gathered first (``[B, K, D]``), the head runs on those alone, and the results
    are scattered back: the same values at those positions (each is the same row of the same
    matmul), forward and backward, at K/L of the head's cost.

    Args:
      hidden: [B, L, D]; tokens: int32 [B, L] (as ``logprobs_from_hidden``).
      slots: int32 [B, K] positions to score (``score_slots``), -1 for an empty slot.
    Returns:
      (logp, entropy): float32 [B, L], as ``logprobs_from_hidden`` at the listed positions, 0 elsewhere.
    """
    batch, seq_len, dim = hidden.shape
    live = slots > 0
    at = jnp.where(live, slots, 1)
    # Position t is scored from the hidden state at t - 1. logprobs_from_hidden scores entry j + 1
    # from hidden entry j: lay the gathered states at 0..K-1 and their targets at 1..K.
    h = jnp.take_along_axis(hidden, (at - 1)[..., None], axis=1)  # [B, K, D]
    h = jnp.concatenate([h, jnp.zeros((batch, 1, dim), h.dtype)], axis=1)
    targets = jnp.take_along_axis(tokens, at, axis=1)
    targets = jnp.concatenate([jnp.zeros((batch, 1), targets.dtype), targets], axis=1)
    logp, ent = logprobs_from_hidden(model, h, targets, chunk_size=chunk_size, with_entropy=with_entropy,
                                     temperature=temperature)
    rows = jnp.arange(batch)[:, None]
    dest = jnp.where(live, slots, seq_len)  # out of range: dropped
    back = lambda v: jnp.zeros((batch, seq_len), jnp.float32).at[rows, dest].set(v[:, 1:], mode="drop")
    return back(logp), back(ent)


def frozen_rows_residual(model, tokens: jax.Array, *, shared_prefix_len: int = 0) -> jax.Array:
    """The rows' residual stream after the model's frozen layers (``ModelConfig.lora_top_layers``), what
    ``sequence_logprobs(..., lower=)`` starts from: [B, L, D], or [B, L - P, D] past a shared prefix of
    P tokens (the prefix itself is re-encoded by every pass: one row)."""
    P = shared_prefix_len
    if not P:
        return model.frozen_residual(tokens, positions_for(tokens))
    _check_prefix(P, tokens.shape[1])
    _, prefix = model.encode_prefix(tokens[:1, :P])
    return model.frozen_residual(tokens[:, P:], _positions_after(P, tokens.shape), prefix)


def _check_prefix(P: int, seq_len: int) -> None:
    if not 0 < P < seq_len:
        raise ValueError(f"shared_prefix_len={P} must be in [0, {seq_len}) for rows of {seq_len} tokens.")


def _positions_after(P: int, shape: tuple[int, int]) -> jax.Array:
    """int32 [B, L - P]: positions P..L-1 of every row."""
    return jnp.broadcast_to(jnp.arange(P, shape[1], dtype=jnp.int32), (shape[0], shape[1] - P))


def sequence_logprobs(
    model, tokens: jax.Array, *, chunk_size: int, with_entropy: bool = True, shared_prefix_len: int = 0,
    temperature: float = 1.0, slots: jax.Array | None = None, lower: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One trunk pass over right-padded rows: (logp [B, L], entropy [B, L], hidden [B, L, D]).

    ``shared_prefix_len`` (static, P): ``tokens[:, :P]`` are the same in every row (the system prompt
    every rollout starts with). Those P positions are then run once, for row 0, and the rows continue
    from their keys/values (``Decoder.encode_prefix``): the same outputs as the full pass, without
    paying the prompt's trunk, attention and LM-head cost once per row.

    ``slots`` (int32 [B, K], ``score_slots``): log-probs and entropies only at those positions
    (``scored_logprobs_from_hidden``), 0 elsewhere; None scores every position.
    ``lower`` (``frozen_rows_residual`` of the same rows): start above the frozen layers.
    """
    P = shared_prefix_len
    batch, seq_len = tokens.shape
    if not P:
        hidden, _ = model.hidden(tokens, positions_for(tokens), lower=lower)
    else:
        _check_prefix(P, seq_len)
        h_pre, prefix = model.encode_prefix(tokens[:1, :P])
        h_rest, _ = model.hidden(tokens[:, P:], _positions_after(P, tokens.shape), prefix, lower=lower)
        hidden = jnp.concatenate([jnp.broadcast_to(h_pre, (batch,) + h_pre.shape[1:]), h_rest], axis=1)
    score = dict(chunk_size=chunk_size, with_entropy=with_entropy, temperature=temperature)
    if slots is not None:
        logp, ent = scored_logprobs_from_hidden(model, hidden, tokens, slots, **score)
        return logp, ent, hidden
    if not P:
        logp, ent = logprobs_from_hidden(model, hidden, tokens, **score)
        return logp, ent, hidden
    # Tokens 1..P-1 are scored once (shared); token P onwards per row, from the prefix's last
    # position followed by the rows' own: scoring tokens[:, P-1:] gives [0, logp(P), logp(P+1), ...].
    lp_pre, ent_pre = logprobs_from_hidden(model, h_pre, tokens[:1, :P], **score)
    lp_rest, ent_rest = logprobs_from_hidden(model, hidden[:, P - 1:], tokens[:, P - 1:], **score)
    logp = jnp.concatenate([jnp.broadcast_to(lp_pre, (batch, P)), lp_rest[:, 1:]], axis=1)
    ent = jnp.concatenate([jnp.broadcast_to(ent_pre, (batch, P)), ent_rest[:, 1:]], axis=1)
    return logp, ent, hidden


def make_logprob_fn(model, *, chunk_size: int):
    """``tokens [n, S] -> logp [n, S]`` under ``model``: the collapse diagnostics' scorer of whole
    ``[x | z]`` sequences (``collapse.prefix_cache=False``; the update passes it either way)."""

    def fn(tokens):
        logp, _, _ = sequence_logprobs(model, tokens, chunk_size=chunk_size, with_entropy=False)
        return logp

    return fn


def make_prefix_cached_cross_scorer(model, *, logprob_chunk_size: int):
    """The collapse cross matrix with each prompt encoded once (KV cache) instead of once per reasoning.

    Returns ``cross_fn(tokens, x_rows, x_len, z_rows, z_start, z_len, *, max_reasoning_tokens,
    chunk_size) -> (ℓ_sum, ℓ_mean) [S, N]``, the same contract as ``collapse.cross_logprob_matrix``
    with ``logprob_fn`` = this model. For each column j the prompt ``x_j`` is prefilled into a KV cache
    once; the cache is then shared by every reasoning ``z_i``, which is run as a short chunk at
    positions ``len(x_j) + 0..``. Prompts are whole conversations and reasoning spans a few hundred
    tokens, so this costs N prompt passes + S·N short passes instead of S·N full-length passes.
    ``chunk_size`` (of ``cross_fn``) bounds how many reasoning rows share one broadcast cache at a
    time; ``logprob_chunk_size`` the positions per log-softmax chunk, as in ``logprobs_from_hidden``.
    """
    def cross_fn(tokens, x_rows, x_len, z_rows, z_start, z_len, *, max_reasoning_tokens, chunk_size):
        seq_len = tokens.shape[1]
        max_z = max_reasoning_tokens
        cache_len = seq_len + max_z
        num_z = z_rows.shape[0]
        z_len = jnp.clip(z_len, 0, max_z)
        x_len = jnp.clip(x_len, 1, seq_len)
        rows_per_chunk = min(chunk_size, num_z)
        num_chunks = -(-num_z // rows_per_chunk)
        pad = num_chunks * rows_per_chunk - num_z
        # Reasoning tokens [S, max_z], gathered once for every column.
        t = jnp.arange(max_z)
        z_tok = tokens[z_rows[:, None], jnp.clip(z_start[:, None] + t, 0, seq_len - 1)]
        z_tok = jnp.where(t < z_len[:, None], z_tok, 0)
        z_tok = jnp.pad(z_tok, ((0, pad), (0, 0))).reshape(num_chunks, rows_per_chunk, max_z)
        z_mask = jnp.pad(t < z_len[:, None], ((0, pad), (0, 0))).reshape(num_chunks, rows_per_chunk, max_z)

        def column(args):
            x_row, xl = args
            pos = jnp.arange(seq_len)
            x_tok = jnp.where(pos < xl, tokens[x_row], 0)[None]
            cache = init_cache(model.cfg, 1, cache_len)
            # Padding after the prompt lands in slots >= xl: the reasoning overwrites the ones it can see.
            hidden, cache = model.hidden(x_tok, pos[None].astype(jnp.int32), cache)
            first = jax.nn.log_softmax(model.logits(hidden[:, xl - 1][:, None])[0, 0])  # predicts z[0]

            def rows(chunk):
                zt, zm = chunk
                n = zt.shape[0]
                shared = broadcast_cache(cache, n)
                z_pos = jnp.broadcast_to(xl + t, (n, max_z)).astype(jnp.int32)
                h, _ = model.hidden(zt, z_pos, shared)
                rest, _ = logprobs_from_hidden(model, h, zt, chunk_size=logprob_chunk_size, with_entropy=False)
                logp = rest.at[:, 0].set(first[zt[:, 0]])
                return jnp.sum(jnp.where(zm, logp, 0.0), axis=-1)

            return jax.lax.map(rows, (z_tok, z_mask)).reshape(-1)[:num_z]

        l_sum = jax.lax.map(column, (x_rows, x_len)).T.astype(jnp.float32)  # [S, N]
        l_mean = l_sum / jnp.maximum(z_len, 1)[:, None].astype(jnp.float32)
        return l_sum, l_mean

    return cross_fn
