"""Teacher-forced log-probs and entropies of a Trajectory under a Decoder, without [B, L, V] logits.

The trainer recomputes every sampled token's log-prob under the current policy at temperature 1
(and under the reference, and the critic's values). With a 150k vocabulary the full logits of a
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


def positions_for(tokens: jax.Array) -> jax.Array:
    """int32 [B, L] positions 0..L-1: rows are right-padded, so padding never precedes a real token."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def _head_chunk(head_graphdef, head_state, hidden, targets, with_entropy: bool):
    """hidden [B, c, D], targets int32 [B, c] -> (log p(target) [B, c], entropy [B, c]) in float32."""
    logits = nnx.merge(head_graphdef, head_state).logits(hidden)  # float32 [B, c, V]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    if not with_entropy:
        return picked, jnp.zeros_like(picked)
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return picked, entropy


def logprobs_from_hidden(
    model, hidden: jax.Array, tokens: jax.Array, *, chunk_size: int, with_entropy: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probs and entropies from final hidden states, chunked over positions.

    Args:
      model: a Decoder (its ``logits(hidden)`` head is used).
      hidden: [B, L, D] final-normed hidden states of ``tokens``.
      tokens: int32 [B, L].
      chunk_size: positions per chunk (the peak is one [B, chunk_size, V] logits block).
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
    head = jax.checkpoint(_head_chunk, static_argnums=(0, 4))

    def body(_, xs):
        h, tgt = xs
        return None, head(graphdef, state, h, tgt, with_entropy)

    _, (logp, ent) = jax.lax.scan(body, None, (hidden, targets))
    logp = logp.swapaxes(0, 1).reshape(batch, padded)[:, : seq_len - 1]
    ent = ent.swapaxes(0, 1).reshape(batch, padded)[:, : seq_len - 1]
    zero = jnp.zeros((batch, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def sequence_logprobs(
    model, tokens: jax.Array, *, chunk_size: int, with_entropy: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One trunk pass over right-padded rows: (logp [B, L], entropy [B, L], hidden [B, L, D])."""
    hidden, _ = model.hidden(tokens, positions_for(tokens))
    logp, ent = logprobs_from_hidden(model, hidden, tokens, chunk_size=chunk_size, with_entropy=with_entropy)
    return logp, ent, hidden


def make_logprob_fn(model, *, chunk_size: int):
    """``tokens [n, S] -> logp [n, S]`` under ``model`` (the scorer of the collapse diagnostics)."""

    def fn(tokens):
        logp, _, _ = sequence_logprobs(model, tokens, chunk_size=chunk_size, with_entropy=False)
        return logp

    return fn
