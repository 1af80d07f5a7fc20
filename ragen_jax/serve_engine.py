"""Continuous batching for the server: requests join and leave a running decode between chunks of steps.

The engine owns ``slots`` rows of one KV cache. A worker thread loops:

1. **admit** — every waiting request that finds a free slot takes it; their prompts are prefilled
   into those rows together (``_prefill_rows``: the rows are gathered, prefilled and scattered back),
   and each row's sampling settings, key and penalty counts are set;
2. **decode** — one compiled program runs ``chunk`` decode steps for the live rows at once
   (``_decode_chunk``: sample from the current logits with the row's temperature / top-p and
   presence / frequency penalties, record the token's log-prob and the top log-probs, run the token
   through the model), on the first rows up to the highest live slot and the cache slots written so
   far (powers of two: a handful of programs); a free slot among them computes too, and its tokens
   are thrown away;
3. **emit** — on the host each live row's new tokens are appended; a row that wrote a stop token,
   reached its ``max_tokens``, finished a stop string, or whose request was cancelled (the client went
   away) leaves, and its slot is free for the next request at once. Its events (text deltas with
   their log-probs, then the end) go to the request's ``emit`` callback as they are decoded, which
   is what streaming sends.

Greedy rows take the argmax of the model's logits (after penalties), as ``models.sampler.generate``
does; sampled rows draw with the row's own key folded with its step count, so a seeded request
samples the same tokens whatever else shares the batch. Tokens past a row's stop within a chunk
are computed and discarded (at most ``chunk - 1`` steps of that row).

Log-probs are those of the model's distribution at temperature 1 before penalties and filters (what
vLLM reports by default, ``raw_logprobs``).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.decoder import pack_for_decode
from ragen_jax.models.kv_cache import KVCache, init_cache
from ragen_jax.models.sampler import SamplingConfig, prefill, sample_logits

TOP_LOGPROBS = 20  # the most top_logprobs a request may ask for (OpenAI's limit)


def _pow2_at_least(n: int, cap: int) -> int:
    """The smallest power of two >= ``n`` (at most ``cap``): the buckets that keep the compiled
    programs to a handful."""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class Job:
    """One row of generation. ``emit(kind, payload)`` receives ``("tokens", (ids, logprobs, tops))``
    for each chunk's new tokens and ``("end", reason)`` once, from the engine's thread; ``reason``
    is "stop" (a stop token), "length" (``max_tokens``), "cancelled" or "error: ..."."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    row: int = 0  # the row's key is fold_in(key(seed), row): the n rows of one request differ
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0  # the top log-probs each token should carry (0: none computed)
    emit: Callable[[str, Any], None] = lambda kind, payload: None
    cancelled: bool = False
    # Filled by the engine.
    generated: int = 0
    slot: int = -1
    queued_at: float = dataclasses.field(default_factory=time.monotonic)


class QueueFull(Exception):
    """More requests wait than the engine's queue holds (the server answers 429)."""


class Engine:
    """The continuous-batching decode loop over ``slots`` cache rows of ``max_seq_len`` tokens."""

    def __init__(self, graphdef, params, model_cfg, stop_ids, *, slots: int, max_seq_len: int, chunk: int = 8,
                 max_queue: int = 256):
        self.graphdef, self.model_cfg = graphdef, model_cfg
        self.slots, self.max_seq_len, self.chunk = int(slots), int(max_seq_len), int(chunk)
        self.max_queue = int(max_queue)
        # Packed once, at load, for the CPU matmul kernel (a no-op elsewhere: decoder.pack_for_decode).
        self.params = jax.jit(lambda p: pack_for_decode(graphdef, p))(params)
        self.stop_ids = np.asarray(sorted(set(int(i) for i in stop_ids if i is not None and i >= 0)), np.int32)
        vocab = model_cfg.vocab_size
        s = self.slots
        # One row more than the slots: the scratch row that padding entries of a batched prefill write to.
        self.cache = init_cache(model_cfg, s + 1, self.max_seq_len)
        self.logits = jnp.zeros((s + 1, vocab), jnp.float32)
        self.counts = jnp.zeros((s + 1, vocab), jnp.int32)  # each row's generated tokens, for the penalties
        self.positions = np.zeros((s,), np.int32)
        self.steps = np.zeros((s,), np.int32)  # tokens sampled per row (the key's fold-in)
        self.keys = jax.random.key_data(jax.vmap(jax.random.key)(jnp.arange(s)))
        self.temperature = np.zeros((s,), np.float32)
        self.top_p = np.ones((s,), np.float32)
        self.presence = np.zeros((s,), np.float32)
        self.frequency = np.zeros((s,), np.float32)
        self.jobs: list[Job | None] = [None] * s
        self.waiting: queue.Queue[Job] = queue.Queue()
        self._wake = threading.Event()
        self._stop = False
        self.stats = {"requests": 0, "cancelled": 0, "decode_chunks": 0, "prefills": 0, "tokens": 0, "max_rows": 0}
        self._prefill = jax.jit(self._prefill_rows, donate_argnums=(1, 2, 3))
        self._decode = jax.jit(self._decode_chunk, donate_argnums=(1, 2, 3), static_argnames=("rows", "length", "top"))
        self._thread = threading.Thread(target=self._loop, name="serve-engine", daemon=True)
        self._thread.start()

    # ---- compiled programs --------------------------------------------------------------------
    def _prefill_rows(self, params, cache: KVCache, logits, counts, tokens, lengths, slots):
        """Prefill ``tokens [J, W]`` (``lengths [J]`` valid) into cache rows ``slots [J]`` at once (the
        rows are gathered, prefilled and scattered back); their logits become their prompts' last,
        their penalty counts zero. Padding entries point at the scratch row (index ``self.slots``),
        which no request uses."""
        model = nnx.merge(self.graphdef, params)
        width = tokens.shape[1]  # only the slots the prompts write move, not the whole rows
        rows = jax.tree.map(lambda x: jnp.take(x[:, :, :, :width], slots, axis=1), cache)
        last, rows = prefill(model, rows, tokens, jnp.zeros_like(lengths), lengths)
        cache = jax.tree.map(lambda x, r: x.at[:, slots, :, :width].set(r), cache, rows)
        logits = logits.at[slots].set(last)
        counts = counts.at[slots].set(0)
        return cache, logits, counts

    def _decode_chunk(self, params, cache, logits, counts, positions, steps, keys, temperature, top_p, presence,
                      frequency, *, rows: int, length: int, top: bool):
        """``chunk`` decode steps of the first ``rows`` rows, attending to the first ``length`` cache
        slots (static buckets: the live rows and what they have written, not the whole cache) ->
        ``(cache, logits, counts, tokens [rows, k], logprobs [rows, k], top ids / log-probs [rows, k, 20])``."""
        full = (cache, logits, counts)
        cache = jax.tree.map(lambda x: x[:, :rows, :, :length], cache)
        logits, counts = logits[:rows], counts[:rows]
        positions, steps, keys = positions[:rows], steps[:rows], keys[:rows]
        temperature, top_p, presence, frequency = temperature[:rows], top_p[:rows], presence[:rows], frequency[:rows]
        model = nnx.merge(self.graphdef, params)
        sampling = SamplingConfig(temperature=temperature, top_k=jnp.zeros_like(positions), top_p=top_p)
        typed = jax.random.wrap_key_data(keys)

        def step(carry, j):
            cache, logits, counts = carry
            adjusted = logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts
            u = jax.vmap(lambda k, n: jax.random.uniform(jax.random.fold_in(k, n)))(typed, steps + j)
            token = sample_logits(adjusted, u, sampling)
            logp = jax.nn.log_softmax(logits, axis=-1)
            chosen = jnp.take_along_axis(logp, token[:, None], -1)[:, 0]
            if top:  # only when a live row asked for top_logprobs (a top-k over the vocabulary per step)
                top_lp, top_id = jax.lax.top_k(logp, TOP_LOGPROBS)
            else:
                top_lp = jnp.zeros((token.shape[0], TOP_LOGPROBS), jnp.float32)
                top_id = jnp.zeros((token.shape[0], TOP_LOGPROBS), jnp.int32)
            counts = counts.at[jnp.arange(token.shape[0]), token].add(1)
            pos = jnp.minimum(positions + j, length - 1)
            out, cache = model(token[:, None], pos[:, None], cache)
            return (cache, out[:, -1].astype(jnp.float32), counts), (token, chosen, top_id, top_lp)

        (cache, logits, counts), (tokens, lps, top_ids, top_lps) = jax.lax.scan(
            step, (cache, logits, counts), jnp.arange(self.chunk))
        # Back into the whole buffers (donated: XLA updates them in place).
        cache = jax.tree.map(lambda x, part: jax.lax.dynamic_update_slice(x, part, (0,) * x.ndim), full[0], cache)
        logits = full[1].at[:rows].set(logits)
        counts = full[2].at[:rows].set(counts)
        return (cache, logits, counts, tokens.T, lps.T, jnp.swapaxes(top_ids, 0, 1), jnp.swapaxes(top_lps, 0, 1))

    # ---- host side ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; raises ``QueueFull`` when ``max_queue`` requests already wait."""
        if len(job.prompt) + job.max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(job.prompt)} tokens) and max_tokens ({job.max_tokens}) exceed the "
                             f"context of {self.max_seq_len} tokens")
        if self.waiting.qsize() >= self.max_queue:
            raise QueueFull(f"{self.waiting.qsize()} requests are waiting (the queue holds {self.max_queue})")
        self.waiting.put(job)
        self._wake.set()

    @property
    def busy_slots(self) -> int:
        return sum(j is not None for j in self.jobs)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop:
            try:
                self._admit()
                if not any(j is not None for j in self.jobs):
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._decode_and_emit()
            except Exception as e:  # noqa: BLE001 - every live request learns of it; the loop goes on
                for s, job in enumerate(self.jobs):
                    if job is not None:
                        self._finish(s, f"error: {type(e).__name__}: {e}")

    def _admit(self) -> None:
        """Every waiting request that finds a free slot joins, all prefilled in one call."""
        joining: list[tuple[int, Job]] = []
        free = [s for s in range(self.slots) if self.jobs[s] is None]
        while free:
            try:
                job = self.waiting.get_nowait()
            except queue.Empty:
                break
            if job.cancelled:
                job.emit("end", "cancelled")
                continue
            joining.append((free.pop(0), job))
        if not joining:
            return
        # Powers of two (rows, prompt width): a handful of programs serve every batch of joiners.
        count = _pow2_at_least(len(joining), self.slots)
        width = _pow2_at_least(max(len(j.prompt) for _, j in joining), self.max_seq_len)
        tokens = np.zeros((count, width), np.int32)
        lengths = np.zeros((count,), np.int32)
        slots = np.full((count,), self.slots, np.int32)  # padding -> the scratch row
        for k, (slot, job) in enumerate(joining):
            tokens[k, :len(job.prompt)] = job.prompt
            lengths[k], slots[k] = len(job.prompt), slot
        self.cache, self.logits, self.counts = self._prefill(
            self.params, self.cache, self.logits, self.counts, jnp.asarray(tokens), jnp.asarray(lengths),
            jnp.asarray(slots))
        self.stats["prefills"] += 1
        for slot, job in joining:
            self.positions[slot] = len(job.prompt)
            self.steps[slot] = 0
            self.keys = self.keys.at[slot].set(
                jax.random.key_data(jax.random.fold_in(jax.random.key(job.seed), job.row)))
            self.temperature[slot], self.top_p[slot] = job.temperature, job.top_p
            self.presence[slot], self.frequency[slot] = job.presence_penalty, job.frequency_penalty
            job.slot = slot
            self.jobs[slot] = job

    def _buckets(self) -> tuple[int, int]:
        """``(rows, length)`` the next chunk runs on: powers of two covering the highest live slot
        and the furthest any live row will have written after the chunk (a handful of programs)."""
        live = [s for s, j in enumerate(self.jobs) if j is not None]
        rows = _pow2_at_least(live[-1] + 1, self.slots)
        written = int(max(self.positions[s] for s in live)) + self.chunk
        length = _pow2_at_least(max(written, 64), self.max_seq_len)
        return rows, length

    def _decode_and_emit(self) -> None:
        rows, length = self._buckets()
        out = self._decode(self.params, self.cache, self.logits, self.counts, jnp.asarray(self.positions),
                           jnp.asarray(self.steps), self.keys, jnp.asarray(self.temperature), jnp.asarray(self.top_p),
                           jnp.asarray(self.presence), jnp.asarray(self.frequency), rows=rows, length=length,
                           top=any(j is not None and j.top_logprobs > 0 for j in self.jobs[:rows]))
        self.cache, self.logits, self.counts = out[:3]
        tokens, lps, top_ids, top_lps = jax.device_get(out[3:])
        self.stats["decode_chunks"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], self.busy_slots)
        self.positions += self.chunk
        self.steps += self.chunk
        stops = set(self.stop_ids.tolist())
        for s, job in enumerate(self.jobs[:rows]):
            if job is None:
                continue
            if job.cancelled:
                self._finish(s, "cancelled")
                continue
            take, reason = self.chunk, None
            for i, t in enumerate(tokens[s]):
                if int(t) in stops:
                    take, reason = i, "stop"
                    break
                if job.generated + i + 1 >= job.max_tokens:
                    take, reason = i + 1, "length"
                    break
            if take:
                job.generated += take
                self.stats["tokens"] += take
                job.emit("tokens", (tokens[s, :take].tolist(), lps[s, :take].tolist(),
                                    (top_ids[s, :take], top_lps[s, :take])))
            if reason is not None or job.cancelled:
                self._finish(s, reason or "cancelled")

    def _finish(self, slot: int, reason: str) -> None:
        job = self.jobs[slot]
        self.jobs[slot] = None
        self.stats["requests"] += 1
        self.stats["cancelled"] += reason == "cancelled"
        job.emit("end", reason)
