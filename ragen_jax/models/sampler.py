"""Ragged prefill and on-device sampling with a KV cache (one jitted while-loop per turn).

The multi-turn rollout appends each turn to a per-row KV cache: ``prefill`` writes the turn's
observation as a fixed-size chunk at every row's own position, ``generate`` then samples the reply
token by token inside ``lax.while_loop`` until every row has stopped or the static budget is spent.
Both are pure functions of ``(graphdef, params)``, so they run inside an outer ``jax.jit`` /
``lax.scan`` (one call per turn).

Cache semantics (see ``kv_cache.py``): token ``[b, t]`` is written to cache slot ``positions[b, t]``
and attends to every slot ``<= positions[b, t]``. Slots holding padding (the tail of a prefill chunk,
steps a finished row still runs through) lie beyond the row's last real token, and are overwritten by
the row's next real token before any query can see them.

Sampling is built to be cheap per decode step on CPU, where the vocabulary dominates the cost of a
small model:
  * categorical sampling by inverse CDF with a two-level (block, then within-block) cumulative sum:
    one uniform per row instead of one Gumbel per vocabulary entry;
  * top-k / top-p find a logit threshold among the ``filter_candidates`` largest logits
    (``lax.top_k``) and fall back to a full sort only for batches whose kept set does not fit;
  * both paths sit behind ``lax.cond`` on the traced settings, so turning a filter off costs nothing
    and changing any setting never recompiles.
"""
from __future__ import annotations

import functools

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ragen_jax.models.decoder import pack_for_decode
from ragen_jax.models.kv_cache import as_bits, from_bits

Array = jax.Array

# Block size of the two-level inverse-CDF sampler: ~sqrt(vocab) keeps both cumulative sums short.
_CDF_BLOCK = 256


@struct.dataclass
class SamplingConfig:
    """Traced sampling settings; each field is a scalar or a per-row ``[B]`` array.

    temperature: float, 0 → greedy (argmax of the raw logits).
    top_k: int, keep the k largest logits; <= 0 turns the filter off.
    top_p: float, keep the smallest set of most likely tokens whose probability reaches top_p
      (nucleus, computed after temperature and top-k, as in transformers); >= 1 turns it off.

    All three are pytree leaves, so new values reuse the compiled graph. Build with ``create`` to
    get fixed dtypes (a Python float here and a float32 array there would be two compilations).
    """

    temperature: Any = 1.0
    top_k: Any = 0
    top_p: Any = 1.0

    @classmethod
    def create(cls, temperature=1.0, top_k=0, top_p=1.0) -> "SamplingConfig":
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
        )

    @classmethod
    def greedy(cls) -> "SamplingConfig":
        return cls.create(temperature=0.0)


@struct.dataclass
class GenerateOutput:
    tokens: Array  # int32 [B, N] sampled tokens, pad_id after each row's length
    logprobs: Array  # float32 [B, N] log-prob of each sampled token under the temperature-scaled
    #                  distribution before top-k / top-p (temperature 0 rows: 1), 0 on padding
    lengths: Array  # int32 [B] tokens generated (stop token included); 0 for inactive rows
    stopped: Array  # bool [B] row ended on a stop id / stop sequence (False: budget exhausted or inactive)
    cache: Any  # KV cache with token n of row b at slot start[b] + n
    keys: Array  # [B] per-row PRNG keys, advanced: pass them to the next call


# ----------------------------------------------------------------------------------------------
# Model plumbing


def _split_model(model) -> tuple[nnx.GraphDef, nnx.State]:
    """Accept an ``nnx.Module`` or its ``(graphdef, state)`` split; return the split."""
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    if isinstance(model, (tuple, list)) and len(model) == 2 and isinstance(model[0], nnx.GraphDef):
        return model[0], model[1]
    raise TypeError(
        "model must be an nnx.Module or a (graphdef, state) pair from nnx.split(model); "
        f"got {type(model).__name__}"
    )


def _check_batch(name: str, x: Array, batch: int, ndim: int = 1):
    if x.ndim != ndim or x.shape[0] != batch:
        want = "[B]" if ndim == 1 else "[B, ...]"
        raise ValueError(f"{name} must have shape {want} with B={batch} (the batch of the cache rows); got {x.shape}")


# ----------------------------------------------------------------------------------------------
# Prefill


def prefill(model, cache, tokens: Array, start: Array, length: Array, pieces: int = 1) -> tuple[Array, Any]:
    """Write one fixed-size chunk per row into the cache; return each row's last-token logits.

    Args:
      model: ``nnx.Module`` or ``(graphdef, state)``.
      cache: KV cache from ``init_cache`` (rows = B).
      tokens: int32 [B, C] chunk per row; entries at and past ``length[b]`` are padding.
      start: int32 [B] cache slot (== position) of each row's first chunk token.
      length: int32 [B] valid tokens per row, 0 <= length <= C.
      pieces: run the chunk as this many consecutive pieces of ``ceil(C / pieces)`` tokens and skip
        the pieces that no row reaches. A chunk is sized for the longest block it may ever hold (a
        multi-turn rollout's user block: the longest reward text, warning and board), while most
        blocks are much shorter; the skipped pieces are work the model never needed. Same result
        as one piece up to float rounding (each piece attends to the ones written before it).

    Returns:
      last_logits: float32 [B, V] logits at each row's token ``length[b] - 1``; zeros for rows with
        ``length == 0`` (they have no new token: keep their previous logits or mark them inactive).
      cache: the updated cache. Padding is written too (slots ``start + length ..``) and is
        overwritten by the row's next tokens before anything attends to it.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32 [B, C]; got shape {tokens.shape}")
    batch, chunk = tokens.shape
    start = jnp.asarray(start, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    _check_batch("start", start, batch)
    _check_batch("length", length, batch)

    if pieces > 1 and chunk > 1:
        return _prefill_in_pieces(model, cache, tokens, start, length, pieces)

    graphdef, state = _split_model(model)
    decoder = nnx.merge(graphdef, state)
    positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    hidden, cache = decoder.hidden(tokens, positions, cache)  # [B, C, D]
    # Only the last valid position needs the vocabulary projection: [B, 1, D] instead of [B, C, D].
    last = jnp.clip(length - 1, 0, chunk - 1)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    logits = decoder.logits(h_last)[:, 0].astype(jnp.float32)  # [B, V]
    logits = jnp.where((length > 0)[:, None], logits, 0.0)
    return logits, cache


def _prefill_in_pieces(model, cache, tokens: Array, start: Array, length: Array, pieces: int):
    """``prefill`` as a scan over ``pieces`` pieces of the chunk, a piece no row reaches skipped."""
    batch, chunk = tokens.shape
    size = -(-chunk // pieces)
    n = -(-chunk // size)
    tokens = jnp.pad(tokens, ((0, 0), (0, n * size - chunk)))
    graphdef, state = _split_model(model)
    vocab = nnx.merge(graphdef, state).cfg.vocab_size

    def piece(carry, j):
        def run(carry):
            logits, cache = carry
            first = j * size
            n_here = jnp.clip(length - first, 0, size)
            new, cache = prefill((graphdef, state), cache, jax.lax.dynamic_slice_in_dim(tokens, first, size, axis=1),
                                 start + first, n_here)
            # A row's last token lies in the last piece that holds any of its tokens.
            return jnp.where((n_here > 0)[:, None], new, logits), cache

        return jax.lax.cond(jnp.any(length > j * size), run, lambda c: c, carry), None

    init = (jnp.zeros((batch, vocab), jnp.float32), as_bits(cache))  # bits inside the loop (kv_cache.as_bits)
    (logits, cache), _ = jax.lax.scan(piece, init, jnp.arange(n))
    return logits, from_bits(cache)


# ----------------------------------------------------------------------------------------------
# Logit filters and sampling (pure functions of [B, V] logits)


def _broadcast_rows(x, batch: int, dtype) -> Array:
    x = jnp.asarray(x, dtype)
    if x.ndim == 0:
        return jnp.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"sampling settings must be scalars or per-row [B={batch}] arrays; got shape {x.shape}")
    return x


def _threshold_among(scaled: Array, top_k: Array, top_p: Array, num: int) -> tuple[Array, Array]:
    """Filter threshold computed from the ``num`` largest logits of each row.

    Args:
      scaled: float32 [B, V] temperature-scaled logits.
      top_k: int32 [B]; top_p: float32 [B] (off values: <= 0 and >= 1).
      num: static number of candidates (== V for the exact full-sort path).

    Returns:
      threshold: float32 [B]; tokens with ``scaled >= threshold`` are kept (tokens tied with the
        last kept one are kept too, as in transformers' top-k).
      exact: bool [B]; False where the kept set may extend past the ``num`` candidates.
    """
    vocab = scaled.shape[-1]
    # The barrier keeps XLA from fusing the consumers into the top-k, which makes it fall back to
    # a full sort of the vocabulary (measured: 25 ms -> 1.8 s at [64, 49152] on CPU).
    vals = jax.lax.optimization_barrier(jax.lax.top_k(scaled, num)[0])  # [B, num] descending
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    k_idx = jnp.clip(top_k, 1, num) - 1
    thr_k = jnp.where(use_k, jnp.take_along_axis(vals, k_idx[:, None], -1)[:, 0], -jnp.inf)
    k_fits = ~use_k | (top_k <= num)

    # Nucleus over the top-k-renormalised distribution; its mass is summed over the whole
    # vocabulary (cheap) so the candidates only need to hold the nucleus itself.
    row_max = vals[:, :1]
    mass = jnp.sum(jnp.where(scaled >= thr_k[:, None], jnp.exp(scaled - row_max), 0.0), axis=-1)
    probs = jnp.where(vals >= thr_k[:, None], jnp.exp(vals - row_max), 0.0) / mass[:, None]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    thr_p = jnp.where(use_p, jnp.take_along_axis(vals, (n_keep - 1)[:, None], -1)[:, 0], -jnp.inf)
    p_fits = ~use_p | (n_keep < num) | (use_k & (top_k <= num)) | (num == vocab)
    return jnp.maximum(thr_k, thr_p), (k_fits & p_fits) | (num == vocab)


def filter_threshold(scaled: Array, top_k: Array, top_p: Array, candidates: int = 128) -> Array:
    """Per-row logit threshold of the top-k / top-p filter: keep tokens with ``scaled >= threshold``.

    Args:
      scaled: float32 [B, V] temperature-scaled logits.
      top_k: int32 [B] (<= 0 off); top_p: float32 [B] (>= 1 off).
      candidates: static size of the fast path's ``lax.top_k``; if any row's kept set may be larger,
        the batch is redone exactly with a full sort.

    Returns: float32 [B] (-inf for rows with both filters off).
    """
    vocab = scaled.shape[-1]
    num = min(candidates, vocab)
    thr, exact = _threshold_among(scaled, top_k, top_p, num)
    if num < vocab:
        thr = jax.lax.cond(
            jnp.all(exact), lambda: thr, lambda: _threshold_among(scaled, top_k, top_p, vocab)[0]
        )
    return thr


def filter_logits(scaled: Array, top_k: Array, top_p: Array, candidates: int = 128) -> Array:
    """``scaled`` [B, V] with the logits outside the top-k / top-p set replaced by -inf."""
    thr = filter_threshold(scaled, top_k, top_p, candidates)
    return jnp.where(scaled >= thr[:, None], scaled, -jnp.inf)


def _blocks(x: Array, fill: float) -> Array:
    """[B, V] -> [B, V / block, block], padded with ``fill`` to whole blocks."""
    batch, vocab = x.shape
    block = min(_CDF_BLOCK, vocab)
    nblocks = -(-vocab // block)
    return jnp.pad(x, ((0, 0), (0, nblocks * block - vocab)), constant_values=fill).reshape(batch, nblocks, block)


def _inverse_cdf(x: Array, weigh, u: Array) -> Array:
    """Index per row drawn with probability proportional to ``weigh(x)``, by a two-level inverse CDF.

    Args:
      x: [B, nblocks, block] values.
      weigh: elementwise map of x (with [B, 1, 1]-broadcast row parameters) to non-negative weights.
        It is applied twice — to all of x for the block masses, then to the chosen block — so the
        [B, V] weights are never stored.
      u: float32 [B] uniforms in [0, 1). u = 0 gives the first index of positive weight.

    Returns: int32 [B]; never an index of zero weight.
    """
    nblocks, block = x.shape[1:]
    iota_b = jnp.arange(nblocks, dtype=jnp.int32)
    iota_i = jnp.arange(block, dtype=jnp.int32)

    block_mass = jnp.sum(weigh(x), axis=-1)  # [B, nblocks]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = u * block_cdf[:, -1]
    # First block whose cumulative mass exceeds the target; rounding can push the count past the
    # last non-empty block, so clamp to it (an empty block must never be chosen).
    last_nonempty = jnp.max(jnp.where(block_mass > 0, iota_b, 0), axis=-1)
    b = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), last_nonempty)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)

    inner = weigh(jnp.take_along_axis(x, b[:, None, None], axis=1))[:, 0]  # [B, block]
    inner_cdf = jnp.cumsum(inner, axis=-1)
    last_nonzero = jnp.max(jnp.where(inner > 0, iota_i, 0), axis=-1)
    i = jnp.minimum(jnp.sum(inner_cdf <= (target - before)[:, None], axis=-1), last_nonzero)
    return b * block + i


def sample_from_weights(weights: Array, u: Array) -> Array:
    """Inverse-CDF sample of an index per row with probability proportional to ``weights``.

    Args:
      weights: float32 [B, V] non-negative, each row with a positive sum.
      u: float32 [B] uniforms in [0, 1).

    Returns: int32 [B]; never an index of zero weight.
    """
    return _inverse_cdf(_blocks(weights, 0.0), lambda w: w, u)


def sample_logits(logits: Array, u: Array, sampling: SamplingConfig, candidates: int = 128) -> Array:
    """Draw one token per row.

    Args:
      logits: float32 [B, V] raw model logits.
      u: float32 [B] uniforms in [0, 1), one per row.
      sampling: ``SamplingConfig`` (scalars or [B]).
      candidates: static fast-path size of the top-k / top-p filter.

    Returns: int32 [B]. Rows with temperature 0 take the argmax of the raw logits (the first one).
    """
    batch = logits.shape[0]
    temperature = _broadcast_rows(sampling.temperature, batch, jnp.float32)
    top_k = _broadcast_rows(sampling.top_k, batch, jnp.int32)
    top_p = _broadcast_rows(sampling.top_p, batch, jnp.float32)
    greedy = temperature <= 0.0
    inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))
    row_max = jnp.max(logits, axis=-1)

    # The [B, V] tempered logits are never stored: ``temper`` is recomputed inside the fused passes
    # (the filter's, the block masses, the chosen block), always with the same float operations,
    # so the threshold comparison is exact. Filters off (or greedy): threshold -inf, no top-k runs.
    def temper(x, m, t):  # x [B, ...], m / t broadcast against x
        return (x - m) * t

    filtering = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
    thr = jax.lax.cond(
        filtering,
        lambda: filter_threshold(temper(logits, row_max[:, None], inv_t[:, None]), top_k, top_p, candidates),
        lambda: jnp.full((batch,), -jnp.inf, jnp.float32),
    )

    def weigh(x):  # x [B, nblocks or 1, block]
        m, t = row_max[:, None, None], inv_t[:, None, None]
        scaled = temper(x, m, t)
        # Greedy rows weigh only their maxima; with u = 0 the inverse CDF returns the first one.
        w = jnp.where(greedy[:, None, None], (x == m).astype(jnp.float32), jnp.exp(scaled))
        return jnp.where(scaled >= thr[:, None, None], w, 0.0)

    return _inverse_cdf(_blocks(logits, -jnp.inf), weigh, jnp.where(greedy, 0.0, u))


# ----------------------------------------------------------------------------------------------
# Stop conditions


def _right_align(stop_sequences: Array) -> tuple[Array, Array]:
    """Right-align each stop sequence: [M, Ls] (-1 padded anywhere) → ([M, Ls] aligned, [M] lengths)."""
    seqs = jnp.asarray(stop_sequences, jnp.int32)
    valid = seqs >= 0
    lengths = jnp.sum(valid, axis=-1)
    # Stable sort puts padding first and keeps the token order: the tokens end up right-aligned.
    order = jnp.argsort(valid, axis=-1, stable=True)
    return jnp.take_along_axis(seqs, order, axis=-1), lengths


def stop_hits(token: Array, window: Array, stop_ids: Array, aligned: Array, seq_lengths: Array) -> Array:
    """Whether each row's newest token ends it.

    Args:
      token: int32 [B] the newest token.
      window: int32 [B, Ls] the last Ls generated tokens, newest last (-1 before the first).
      stop_ids: int32 [S].
      aligned: int32 [M, Ls] right-aligned stop sequences (-1 = no token).
      seq_lengths: int32 [M]; empty sequences never match.

    Returns: bool [B].
    """
    hit = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
    if aligned.shape[0] and aligned.shape[1]:
        agree = (aligned[None] < 0) | (aligned[None] == window[:, None, :])  # [B, M, Ls]
        hit = hit | jnp.any(jnp.all(agree, axis=-1) & (seq_lengths > 0)[None], axis=-1)
    return hit


# ----------------------------------------------------------------------------------------------
# Generation


@struct.dataclass
class _LoopState:
    step: Array  # int32 scalar
    logits: Array  # float32 [B, V] logits for the token of this step
    cache: Any
    tokens: Array  # int32 [B, N]
    logprobs: Array  # float32 [B, N]
    lengths: Array  # int32 [B]
    done: Array  # bool [B]
    stopped: Array  # bool [B]
    window: Array  # int32 [B, Ls]


def _checked_inputs(last_logits, start, active, keys, stop_ids, stop_sequences, max_new_tokens):
    """``generate``'s arrays in their dtypes and shapes, or a ValueError naming the bad one; the
    stop sequences come right-aligned with their lengths (``_right_align``)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a static Python int >= 1; got {max_new_tokens!r}")
    last_logits = jnp.asarray(last_logits, jnp.float32)
    if last_logits.ndim != 2:
        raise ValueError(f"last_logits must be float32 [B, V]; got shape {last_logits.shape}")
    batch = last_logits.shape[0]
    start = jnp.asarray(start, jnp.int32)
    active = jnp.asarray(active, bool)
    _check_batch("start", start, batch)
    _check_batch("active", active, batch)
    if keys.shape[0] != batch:
        raise ValueError(f"keys must hold one PRNG key per row ([B={batch}]); got shape {keys.shape}")
    stop_ids = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
    stop_sequences = jnp.asarray(stop_sequences, jnp.int32)
    if stop_sequences.ndim != 2:
        raise ValueError(
            f"stop_sequences must be int32 [M, Ls] padded with -1 (use shape [0, 0] for none); got {stop_sequences.shape}"
        )
    return last_logits, start, active, stop_ids, _right_align(stop_sequences)


def _decode_step(graphdef, params, start, call_keys, inv_t, sampling, filter_candidates, stops, pad_id,
                 s: _LoopState) -> _LoopState:
    """One decode step for every row: sample from the current logits, record the token and its
    log-prob (at the sampling temperature), check the stops, and run the token through the model
    (``generate``'s ``while_loop`` body; ``stops`` = ``(stop_ids, aligned stop sequences, their lengths)``)."""
    stop_ids, aligned, seq_lengths = stops
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, s.step)))(call_keys)
    token = sample_logits(s.logits, u, sampling, filter_candidates)
    scaled = s.logits * inv_t
    logprob = jnp.take_along_axis(scaled, token[:, None], -1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)

    live = ~s.done
    window = jnp.concatenate([s.window[:, 1:], token[:, None]], axis=1)
    hit = live & stop_hits(token, window, stop_ids, aligned, seq_lengths)
    tokens = jax.lax.dynamic_update_slice(s.tokens, jnp.where(live, token, pad_id)[:, None], (0, s.step))
    logprobs = jax.lax.dynamic_update_slice(s.logprobs, jnp.where(live, logprob, 0.0)[:, None], (0, s.step))

    # Every sampled token goes into the cache (the next turn continues after it), so the forward
    # runs even on the final step; its logits are simply not used then.
    decoder = nnx.merge(graphdef, params)
    logits, cache = decoder(token[:, None], (start + s.step)[:, None], s.cache)
    return _LoopState(
        step=s.step + 1,
        logits=logits[:, -1].astype(jnp.float32),
        cache=cache,
        tokens=tokens,
        logprobs=logprobs,
        lengths=s.lengths + live.astype(jnp.int32),
        done=s.done | hit,
        stopped=s.stopped | hit,
        window=window,
    )


def generate(
    model,
    cache,
    last_logits: Array,
    start: Array,
    active: Array,
    keys: Array,
    sampling: SamplingConfig,
    stop_ids: Array,
    stop_sequences: Array,
    max_new_tokens: int,
    *,
    pad_id: int = 0,
    filter_candidates: int = 128,
) -> GenerateOutput:
    """Sample up to ``max_new_tokens`` tokens per row, appending them to the KV cache.

    Args:
      model: ``nnx.Module`` or ``(graphdef, state)``.
      cache: KV cache holding each row's context up to slot ``start[b] - 1``.
      last_logits: float32 [B, V] logits predicting each row's first new token (from ``prefill``).
      start: int32 [B] cache slot of each row's first new token.
      active: bool [B]; inactive rows generate nothing (length 0).
      keys: [B] per-row PRNG keys (typed keys or raw uint32 [B, 2]).
      sampling: ``SamplingConfig`` (traced).
      stop_ids: int32 [S] tokens that end a row (e.g. eos, end-of-turn); -1 entries are ignored.
      stop_sequences: int32 [M, Ls] token sequences (-1 padded) that end a row when the generated
        tokens end with them; [0, 0] for none.
      max_new_tokens: static budget N.
      pad_id: token written to ``tokens`` after each row's end.
      filter_candidates: static fast-path size of the top-k / top-p filter (see ``filter_logits``).

    Returns:
      ``GenerateOutput``. The stop token (or the stop sequence's tokens) is part of the output and
      of the cache. ``keys`` are advanced; the same keys give the same tokens.
    """
    last_logits, start, active, stop_ids, (aligned, seq_lengths) = _checked_inputs(
        last_logits, start, active, keys, stop_ids, stop_sequences, max_new_tokens)
    batch = last_logits.shape[0]

    graphdef, params = _split_model(model)
    # On a CPU the step's matmuls read the weights in panels, repacked here once for all steps.
    params = pack_for_decode(graphdef, params)
    # The policy the StarPO ratio compares against samples at this temperature (verl's convention:
    # log-probs of logits / T). Greedy rows keep T = 1; multiplying by exactly 1.0 changes nothing.
    temperature = _broadcast_rows(sampling.temperature, batch, jnp.float32)
    inv_t = jnp.where(temperature > 0, 1.0 / jnp.where(temperature > 0, temperature, 1.0), 1.0)[:, None]
    split = jax.vmap(jax.random.split)(keys)
    next_keys, call_keys = split[:, 0], split[:, 1]
    n_new = max_new_tokens

    def cond(s: _LoopState):
        return (s.step < n_new) & ~jnp.all(s.done)

    body = functools.partial(_decode_step, graphdef, params, start, call_keys, inv_t, sampling, filter_candidates,
                             (stop_ids, aligned, seq_lengths), pad_id)
    init = _LoopState(
        step=jnp.zeros((), jnp.int32),
        logits=last_logits,
        cache=as_bits(cache),  # a bfloat16 cache is written as bits inside the loop (kv_cache.as_bits)
        tokens=jnp.full((batch, n_new), pad_id, jnp.int32),
        logprobs=jnp.zeros((batch, n_new), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        done=~active,
        stopped=jnp.zeros((batch,), bool),
        window=jnp.full((batch, max(aligned.shape[1], 1)), -1, jnp.int32),
    )
    out = jax.lax.while_loop(cond, body, init)
    return GenerateOutput(
        tokens=out.tokens,
        logprobs=out.logprobs,
        lengths=out.lengths,
        stopped=out.stopped,
        cache=from_bits(out.cache),
        keys=next_keys,
    )
