"""The multi-turn agent rollout: model and vmapped environments run whole episodes on device.

``make_rollout(graphdef, env, env_params, tokenizer, RolloutConfig)`` returns a :class:`Rollout`;
``rollout(params, key) -> Trajectory`` is one ``jit``:

    reset envs (vmapped; the same reset key within a group)
    prefill the system prompt into every row's KV cache
    lax.scan over turns:
        observation → piece ids (env.render_pieces) → tokens (codec tables, cumsum + scatter)
        prefill the user block at each row's own cache position (no re-prefill of the history)
        generate ≤ max_new_tokens (stop at "</answer>" or the template's end-of-turn token)
        reply tokens → bytes → actions (parser, vectorised)
        lax.scan over action slots: env.step_env (vmapped), masked by validity, budget and done
        per-turn reward, format penalty, success, done
    close the last assistant messages, assemble the Trajectory

Conversation limits. A turn starts only if its whole user block, ``max_new_tokens`` reply tokens
and the closing tokens fit in ``max_seq_len``, and its observation fits the static observation
budget (``max_obs_tokens``; measured on random states when unset); otherwise the episode ends at
that turn boundary and ``Trajectory.truncated`` marks it (never cut mid-token).

Context modes. ``full`` (default): each turn sees the whole conversation. ``limited``: each turn
sees the system prompt and the last ``context_window`` turns (RAGEN's ``limited_multi_turn``; with
a window of 1 every turn reads like a first turn). The KV cache then only holds that much
(``Rollout.cache_len``), and it is rebuilt at every turn boundary once the window slides: the preamble stays
in slots ``0..P0``, the last ``context_window - 1`` turns (gathered from the transcript) are
re-prefilled right after it, then the new user block is appended. The transcript still records the whole episode;
``Trajectory.context_start`` gives, per turn, the index of the first transcript token that turn
could see after the preamble, so the trainer can recompute log-probs under the same context.

Keys. Training keys never repeat: pass ``jax.random.fold_in(base_key, step)``. ``validation_keys``
returns a fixed set of env keys for evaluation (the same puzzles every time).

Env stepping uses a key derived from the row's (group-shared) reset key and the number of actions
taken so far, so rows of a group that take the same actions see the same stochastic outcomes
(common random numbers — the original's behaviour for slippery FrozenLake).

Python environments (``host_env.HostEnv``) run in the same loop: the builder uses an env's
batched ``reset_batch`` / ``render_batch`` / ``step_batch`` when it has them, ``vmap`` otherwise.
``ForcedReplies`` replaces sampling by scripted token sequences (tests, demonstrations).
"""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.kv_cache import init_cache
from ragen_jax.models.sampler import SamplingConfig, generate, prefill
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout import parser as parser_lib
from ragen_jax.rollout import prompts
from ragen_jax.rollout.chat import chat_framing
from ragen_jax.rollout.trajectory import Trajectory

# "reprefill" is the baseline the benchmark measures against: every turn rebuilds the KV cache by
# prefilling the whole conversation from position 0 (what the original and Tunix do). It produces
# the same trajectories as "full", at a higher cost.
CONTEXT_MODES = ("full", "limited", "reprefill")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static settings of the rollout (the ``config.rollout`` section)."""

    num_groups: int = 8  # G: distinct env reset keys
    group_size: int = 16  # K: rollouts per group (same reset key)
    max_turns: int = 5
    max_actions_per_turn: int = 2
    max_actions_per_traj: int = 10
    max_new_tokens: int = 128  # per turn
    max_seq_len: int = 2048  # KV cache / transcript length
    enable_think: bool = True
    format_penalty: float = -0.1
    max_words: int = 100  # the "Max response length: N words (tokens)." sentence
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_at_answer: bool = True  # also stop a reply at "</answer>"
    context_mode: str = "full"
    context_window: int = 2  # turns visible in "limited" mode (the current one included; 1 = only it)
    observation_format: str | None = None  # None: the env's configured format
    instruction: str | None = None  # None: the built-in instruction of the env
    reward_decimals: int = 1
    reward_limit: float = 50.0
    max_obs_tokens: int | None = None  # observation token budget; None: measured on random states

    def __post_init__(self):
        for name in ("num_groups", "group_size", "max_turns", "max_actions_per_turn", "max_actions_per_traj",
                     "max_new_tokens", "max_seq_len", "context_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rollout.{name} must be a positive int, got {v!r}")
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"rollout.context_mode={self.context_mode!r}; choose one of {CONTEXT_MODES}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"rollout.top_p={self.top_p!r} must be in (0, 1] (1 = off: sample from the "
                             "whole distribution)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"rollout.temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.format_penalty > 0:
            raise ValueError(f"rollout.format_penalty must be <= 0, got {self.format_penalty}")

    @property
    def batch_size(self) -> int:
        return self.num_groups * self.group_size


@chex.dataclass(frozen=True)
class ForcedReplies:
    """Scripted replies instead of sampling (tests, demonstrations, behaviour cloning).

    tokens int32 [B, T, N] (N <= max_new_tokens), lengths int32 [B, T]. Turn t of row b "samples"
    ``tokens[b, t, :lengths[b, t]]``; log-probs are recorded as 0.
    """

    tokens: chex.Array
    lengths: chex.Array


def validation_keys(n: int, seed: int = 123) -> jax.Array:
    """A fixed set of ``n`` env reset keys (one group each) — the same puzzles at every evaluation."""
    return jax.random.split(jax.random.key(seed), n)


def _env_name(env) -> str:
    return getattr(env, "name", type(env).__name__).lower()


def _is_slippery(env, env_params) -> bool:
    """Whether moves can slip: the env's static flag and, when concrete, ``success_rate < 1``."""
    if not getattr(env, "is_slippery", False):
        return False
    rate = getattr(env_params, "success_rate", None)
    try:
        return rate is None or float(rate) < 1.0
    except jax.errors.ConcretizationTypeError:  # traced params: keep the cautious sentence
        return True


def build_system_text(env, fmt: str, config: RolloutConfig, board_shape, env_params=None) -> str:
    """The system message for ``env`` as configured (legend and actions from the env itself).

    ``env_params`` decides FrozenLake's slippery-ice sentence (absent when ``success_rate`` is 1).
    """
    instruction = config.instruction
    if instruction is None:
        instruction = getattr(env, "instruction", None)
    if instruction is None:
        instruction = prompts.env_instruction(_env_name(env), fmt, board_shape,
                                              slippery=_is_slippery(env, env_params))
    shows_grid = fmt in ("grid", "grid_coord")
    legend = env.legend() if shows_grid else None
    # Free-text observations (the bandit) name their own choices; the global action list would
    # only leak every episode's options into the system prompt.
    actions = None if fmt == "text" else tuple(env.action_names)
    return prompts.system_message(
        instruction, legend=legend, action_names=actions,
        max_actions_per_turn=config.max_actions_per_turn,
    )


class Rollout:
    """The compiled rollout of one (model architecture, env, tokenizer, config).

    ``rollout(params, key)`` draws ``num_groups`` reset keys and a sampling key from ``key``;
    ``rollout.run(params, env_keys [B], sample_key)`` takes explicit per-row env keys (validation).
    Either accepts ``forced=ForcedReplies(...)`` to script the replies.
    """

    def __init__(self, graphdef, env, env_params, tokenizer, config: RolloutConfig):
        self.graphdef = graphdef
        self.env = env
        self.env_params = env_params
        self.tokenizer = tokenizer
        self.config = config
        fmt = env.check_format(config.observation_format)
        self.fmt = fmt

        obs_shape, state_shape = jax.eval_shape(lambda k: env.reset(k, env_params), jax.random.key(0))
        board_shape = tuple(obs_shape.shape[-2:]) if len(obs_shape.shape) >= 2 else None
        pieces_shape = jax.eval_shape(lambda s: env.render_pieces(s, env_params, fmt), state_shape)
        max_obs_pieces = pieces_shape[0].shape[-1]

        max_obs_tokens = config.max_obs_tokens
        if max_obs_tokens is None and hasattr(env, "max_obs_tokens"):
            max_obs_tokens = env.max_obs_tokens
        if max_obs_tokens is None:
            max_obs_tokens = self._measure_obs_tokens(tokenizer, state_shape)
        self.max_obs_tokens = max_obs_tokens
        self.framing = chat_framing(tokenizer)
        self.system_text = build_system_text(env, fmt, config, board_shape, env_params)
        self.codec = codec_lib.PromptCodec(
            tokenizer, self.framing, env.piece_table, self.system_text,
            enable_think=config.enable_think, max_words=config.max_words,
            max_int=max(config.max_turns + 1, config.max_actions_per_traj),
            max_obs_pieces=max_obs_pieces, max_obs_tokens=max_obs_tokens, reward_decimals=config.reward_decimals,
            reward_limit=config.reward_limit,
        )
        self.vocab = parser_lib.ActionVocab.from_names(tuple(env.action_names))

        # Reply bytes: one extra table row holds the forced prefix's bytes.
        byte_table, byte_len = codec_lib.token_byte_table(tokenizer)
        prefix = prompts.forced_prefix(config.enable_think).encode()
        width = max(byte_table.shape[1], len(prefix))
        table = np.zeros((byte_table.shape[0] + 1, width), np.uint8)
        table[:-1, : byte_table.shape[1]] = byte_table
        table[-1, : len(prefix)] = np.frombuffer(prefix, np.uint8)
        self.byte_table = jnp.asarray(table)
        self.byte_len = jnp.asarray(np.concatenate([byte_len, [len(prefix)]]).astype(np.int32))
        self.prefix_row = byte_table.shape[0]
        self.reply_bytes = len(prefix) + config.max_new_tokens * byte_table.shape[1]

        self.stop_ids = jnp.asarray([self.codec.eot_id], jnp.int32)
        if config.stop_at_answer:
            # The closing tag as tokenised alone and after a space (BPE merges the space in); a
            # reply that closes the tag with another split simply runs on to end-of-turn.
            seqs = {tuple(codec_lib.encode(tokenizer, s)) for s in ("</answer>", " </answer>")}
            width = max(len(q) for q in seqs)
            self.stop_sequences = jnp.asarray([list(q) + [-1] * (width - len(q)) for q in sorted(seqs)], jnp.int32)
        else:
            self.stop_sequences = jnp.zeros((0, 0), jnp.int32)

        preamble = len(self.codec.preamble_ids)
        need = preamble + self.codec.chunk_len + config.max_new_tokens + self.codec.end_len
        if need > config.max_seq_len:
            raise ValueError(
                f"RolloutConfig.max_seq_len={config.max_seq_len} cannot hold even one turn: the system "
                f"prompt ({preamble} tokens), a user block (up to {self.codec.chunk_len}), "
                f"max_new_tokens={config.max_new_tokens} and the close need {need}; raise max_seq_len"
            )
        # Limited mode: the cache (and a trainer's per-turn rows) holds at most the preamble and the
        # window's turns, each a user block (with the previous close) and a reply.
        self.cache_len = config.max_seq_len
        if config.context_mode == "limited":
            self.cache_len = min(config.max_seq_len,
                                 preamble + config.context_window * (self.codec.chunk_len + config.max_new_tokens))
        self._run = jax.jit(self._rollout)

    @property
    def per_turn_rows(self) -> tuple[int, int] | None:
        """``(preamble_len, row_len)`` of the per-turn rows (``rollout.turn_rows``) that training on
        a limited-context rollout needs; None in full context, where the transcript is the context."""
        if self.config.context_mode != "limited":
            return None
        return len(self.codec.preamble_ids), self.cache_len

    def _measure_obs_tokens(self, tokenizer, state_shape) -> int:
        """Observation token budget: twice the longest render seen on random states, plus slack.

        The exact worst case (every piece slot holding the longest piece) is usually far too
        large; states whose render would still overflow end their episode at that turn boundary,
        marked ``truncated`` (see the module docstring). Set ``RolloutConfig.max_obs_tokens`` to
        fix the budget explicitly.
        """
        env, ep, fmt = self.env, self.env_params, self.fmt
        lengths = np.array([len(codec_lib.encode(tokenizer, p)) if p else 0 for p in env.piece_table], np.int32)
        lengths = jnp.asarray(lengths)

        batch = 128

        def count(state):
            pieces, n = jax.vmap(lambda s: env.render_pieces(s, ep, fmt))(state)
            tok = jnp.where(jnp.arange(pieces.shape[1])[None] < n[:, None], lengths[pieces], 0)
            return jnp.max(jnp.sum(tok, axis=1))

        @jax.jit
        def first(key):
            _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, batch), ep)
            return state, count(state)

        @jax.jit
        def walk(state, key):
            ka, ks = jax.random.split(key)
            acts = jax.random.randint(ka, (batch,), 0, env.num_actions)
            # step_env: no auto-reset, so the level generator is compiled once (in ``first``)
            _, state, *_ = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))(jax.random.split(ks, batch), state, acts, ep)
            return state, count(state)

        state, best = first(jax.random.key(0))
        best = int(best)
        for k in jax.random.split(jax.random.key(1), 8):
            state, c = walk(state, k)
            best = max(best, int(c))
        self.measured_obs_tokens = best
        return 2 * best + 16

    # ---------------------------------------------------------------------------------------
    def __call__(self, params, key, forced: ForcedReplies | None = None) -> Trajectory:
        c = self.config
        env_key, sample_key = jax.random.split(key)
        group_keys = jax.random.split(env_key, c.num_groups)
        env_keys = jnp.repeat(group_keys, c.group_size, axis=0)
        if forced is not None:
            self._check_forced(forced, env_keys.shape[0])
        return self._run(params, env_keys, sample_key, forced)

    def run(self, params, env_keys, sample_key, forced: ForcedReplies | None = None) -> Trajectory:
        return self._run(params, env_keys, sample_key, forced)

    def _check_forced(self, forced, batch):
        c = self.config
        if forced.tokens.ndim != 3 or forced.tokens.shape[:2] != (batch, c.max_turns) or \
                forced.tokens.shape[2] > c.max_new_tokens or forced.lengths.shape != (batch, c.max_turns):
            raise ValueError(
                f"ForcedReplies must hold tokens [B={batch}, T={c.max_turns}, N<={c.max_new_tokens}] and lengths "
                f"[B, T]; got tokens {forced.tokens.shape}, lengths {forced.lengths.shape}"
            )

    # ---------------------------------------------------------------------------------------
    def _rollout(self, params, env_keys, sample_key, forced):
        c, cd, env, ep = self.config, self.codec, self.env, self.env_params
        B = env_keys.shape[0]
        L = c.max_seq_len
        T = c.max_turns
        N = c.max_new_tokens
        A = c.max_actions_per_turn
        model = (self.graphdef, params)
        cfg = nnx.merge(self.graphdef, params).cfg
        rows = jnp.arange(B)

        _, state = self._reset_batch(env_keys)
        cache = init_cache(cfg, B, self.cache_len)
        pre = jnp.asarray(cd.preamble_ids)
        P0 = pre.shape[0]
        _, cache = prefill(model, cache, jnp.broadcast_to(pre, (B, P0)), jnp.zeros((B,), jnp.int32),
                           jnp.full((B,), P0, jnp.int32))
        buf = jnp.full((B, L), cd.pad_id, jnp.int32).at[:, :P0].set(pre)
        sampling = SamplingConfig.create(c.temperature, c.top_k, c.top_p)
        keys = jax.random.split(sample_key, B)

        def write(arr, start, values, n, fill_ok=True):
            """Scatter values[b, :n[b]] into arr[b, start[b]:] (out-of-range dropped)."""
            j = jnp.arange(values.shape[1])
            dest = jnp.where(j[None] < n[:, None], start[:, None] + j[None], L)
            return arr.at[rows[:, None], dest].set(values, mode="drop")

        carry = dict(
            cache=cache, state=state, pos=jnp.full((B,), P0, jnp.int32), buf=buf,
            loss=jnp.zeros((B, L), bool), logp=jnp.zeros((B, L), jnp.float32),
            turn_ids=jnp.full((B, L), -1, jnp.int32), keys=keys,
            done=jnp.zeros((B,), bool), truncated=jnp.zeros((B,), bool),
            success=jnp.zeros((B,), bool), num_actions=jnp.zeros((B,), jnp.int32),
            eot=jnp.zeros((B,), bool), reward_id=jnp.full((B,), cd.reward_zero, jnp.int32),
            warn=jnp.zeros((B,), bool), turn_starts=jnp.full((B, T), P0, jnp.int32),
        )

        def turn(carry, t):
            # ---- user block --------------------------------------------------------------
            pieces, n_pieces = self._render_batch(carry["state"])
            actions_left = c.max_actions_per_traj - carry["num_actions"]
            ids, valid = jax.vmap(
                lambda p, n, e, r, w, a: cd.turn_pieces(t, p, n, eot_emitted=e, reward_id=r, warning=w, actions_left=a)
            )(pieces, n_pieces, carry["eot"], carry["reward_id"], carry["warn"], actions_left)
            chunk, clen, src = jax.vmap(cd.chunk)(ids, valid)
            pos = carry["pos"]
            # A turn starts only if its user block fits the chunk and the whole turn fits the cache.
            fits = (clen <= cd.chunk_len) & (pos + clen + N + cd.end_len <= L)
            live = ~carry["done"]
            active = live & fits
            truncated = carry["truncated"] | (live & ~fits)
            done = carry["done"] | (live & ~fits)
            clen = jnp.where(active, clen, 0)

            # Where this turn's user content starts (after the previous assistant's close).
            close_len = jnp.sum((src == 0) & (jnp.arange(cd.chunk_len)[None] < clen[:, None]), axis=1)
            turn_starts = carry["turn_starts"].at[:, t].set(
                jnp.where(active, pos + close_len, carry["turn_starts"][:, t]))

            cache = carry["cache"]
            cchunk, cclen = chunk, clen
            if c.context_mode == "limited":
                cache = self._rebuild_window(model, cache, carry["buf"], turn_starts, pos, t, active, P0)
                if c.context_window == 1:
                    # The previous assistant's close belongs to a turn outside the window.
                    cchunk = jnp.take_along_axis(chunk, jnp.clip(close_len[:, None] + jnp.arange(cd.chunk_len)[None],
                                                                 0, cd.chunk_len - 1), 1)
                    cclen = clen - close_len
            elif c.context_mode == "reprefill":
                fresh = init_cache(cfg, B, L, cache.k.dtype)
                cache = prefill(model, fresh, carry["buf"], jnp.zeros((B,), jnp.int32), jnp.where(active, pos, 0))[1]
            # In limited mode the cache holds a shorter context: its own write position.
            cpos = self._cache_pos(turn_starts, pos, t, P0) if c.context_mode == "limited" else pos
            last_logits, cache = prefill(model, cache, cchunk, cpos, cclen)

            buf = write(carry["buf"], pos, chunk, clen)
            # The close of the previous assistant message (piece 0) belongs to the previous turn.
            tid = jnp.where(src == 0, t - 1, t)
            turn_ids = write(carry["turn_ids"], pos, tid, clen)
            prompt_end = pos + clen
            gen_start = prompt_end

            # ---- reply -------------------------------------------------------------------
            if forced is None:
                out = generate(model, cache, last_logits, cpos + cclen, active, carry["keys"], sampling,
                               self.stop_ids, self.stop_sequences, N, pad_id=cd.pad_id)
                reply, rlen, rlogp, cache, keys = out.tokens, out.lengths, out.logprobs, out.cache, out.keys
            else:
                ftok = jnp.zeros((B, N), jnp.int32).at[:, : forced.tokens.shape[2]].set(forced.tokens[:, t])
                rlen = jnp.where(active, forced.lengths[:, t], 0)
                ftok = jnp.where(jnp.arange(N)[None] < rlen[:, None], ftok, cd.pad_id)
                _, cache = prefill(model, cache, ftok, cpos + cclen, rlen)
                reply, rlogp, keys = ftok, jnp.zeros((B, N), jnp.float32), carry["keys"]
            buf = write(buf, gen_start, reply, rlen)
            loss = write(carry["loss"], gen_start, jnp.ones((B, N), bool), rlen)
            logp = write(carry["logp"], gen_start, rlogp, rlen)
            turn_ids = write(turn_ids, gen_start, jnp.full((B, N), t, jnp.int32), rlen)
            last_tok = jnp.take_along_axis(reply, jnp.maximum(rlen - 1, 0)[:, None], 1)[:, 0]
            eot = active & (rlen > 0) & (last_tok == cd.eot_id)
            pos = gen_start + rlen

            # ---- parse -------------------------------------------------------------------
            pid = jnp.concatenate([jnp.full((B, 1), self.prefix_row, jnp.int32), reply], axis=1)
            pvalid = jnp.concatenate([jnp.ones((B, 1), bool), jnp.arange(N)[None] < rlen[:, None]], axis=1)
            rbytes, nbytes, bsrc = jax.vmap(
                lambda i, v: codec_lib.tokens_to_bytes(self.byte_table, self.byte_len, i, v, self.reply_bytes)
            )(pid, pvalid)
            parsed = jax.vmap(lambda b, n: parser_lib.parse_reply(b, n, self.vocab, A, c.enable_think))(rbytes, nbytes)
            # Reasoning span: after the forced "<think>" up to the token holding "</think>".
            end_tok = jnp.take_along_axis(bsrc, jnp.clip(parsed.think_end, 0, self.reply_bytes - 1)[:, None], 1)[:, 0]
            unmatched_end = gen_start + rlen - eot.astype(jnp.int32)
            has_think = c.enable_think & (parsed.think_end < nbytes)
            reasoning_end = jnp.where(has_think, gen_start + end_tok - 1, unmatched_end)
            if not c.enable_think:
                reasoning_end = gen_start

            # ---- env steps ---------------------------------------------------------------
            def act(sc, k):
                st, nact, env_done, rsum, succ, nexe, neff = sc
                a = parsed.actions[:, k]
                do = active & (k < parsed.n_valid) & (nact < c.max_actions_per_traj) & ~env_done
                skeys = jax.vmap(lambda key, n: jax.random.fold_in(key, n + 1))(env_keys, nact)
                st, r, term, trunc, info = self._step_batch(skeys, st, jnp.maximum(a, 0), do)
                ended = do & (term | trunc)
                return (
                    st, nact + do, env_done | ended, rsum + jnp.where(do, r, 0.0),
                    succ | (ended & info["success"] & term), nexe + do,
                    neff + (do & info["action_is_effective"]),
                ), None

            init = (carry["state"], carry["num_actions"], jnp.zeros((B,), bool), jnp.zeros((B,), jnp.float32),
                    carry["success"], jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))
            (state, num_actions, env_done, rsum, success, nexe, neff), _ = jax.lax.scan(act, init, jnp.arange(A))

            stepped = active & (parsed.n_valid > 0)
            budget_out = num_actions >= c.max_actions_per_traj
            done = done | (active & (env_done | budget_out))
            penalty = active & parsed.format_penalty
            turn_reward = jnp.where(active, rsum + jnp.where(penalty, c.format_penalty, 0.0), 0.0)
            last_index = jnp.where(active & (rlen > 0), pos - 1, -1)

            new = dict(
                cache=cache, state=state, pos=pos, buf=buf, loss=loss, logp=logp, turn_ids=turn_ids, keys=keys,
                done=done, truncated=truncated, success=success, num_actions=num_actions,
                eot=jnp.where(active, eot, carry["eot"]),
                reward_id=jnp.where(active, cd.reward_id(rsum, stepped), carry["reward_id"]),
                warn=jnp.where(active, ~stepped, carry["warn"]), turn_starts=turn_starts,
            )
            per_turn = dict(
                reward=turn_reward, penalty=jnp.where(penalty, c.format_penalty, 0.0), mask=active,
                last=last_index, prompt_end=jnp.where(active, prompt_end, 0),
                r_start=jnp.where(active, prompt_end, 0), r_end=jnp.where(active, reasoning_end, 0),
                valid_turn=active & ~parsed.format_penalty, nexe=nexe, neff=neff,
                context_start=self._context_start(turn_starts, t, P0, active),
            )
            return new, per_turn

        carry, pt = jax.lax.scan(turn, carry, jnp.arange(T))
        pt = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), pt)  # [B, T]

        # Close each row's last assistant message (the next turn never came).
        had_turn = jnp.any(pt["mask"], axis=1)
        close_id = jnp.where(carry["eot"], cd.end_rest, cd.end_full)
        ctoks, clen, _ = jax.vmap(
            lambda i: codec_lib.concat_pieces(cd.table, cd.lengths, i[None], jnp.ones((1,), bool), cd.end_len, cd.pad_id)
        )(close_id)
        clen = jnp.where(had_turn, clen, 0)
        last_turn = jnp.maximum(jnp.sum(pt["mask"], axis=1) - 1, 0)
        buf = write(carry["buf"], carry["pos"], ctoks, clen)
        turn_ids = write(carry["turn_ids"], carry["pos"], jnp.broadcast_to(last_turn[:, None], ctoks.shape), clen)
        length = carry["pos"] + clen

        idx = jnp.arange(L)[None]
        valid_mask = idx < length[:, None]
        token_rewards = jnp.zeros((B, L), jnp.float32).at[rows[:, None], jnp.where(pt["last"] >= 0, pt["last"], L)].add(
            pt["reward"], mode="drop")
        num_turns = jnp.sum(pt["mask"], axis=1).astype(jnp.int32)
        nexe = jnp.sum(pt["nexe"], axis=1)
        response_length = jnp.sum(carry["loss"], axis=1).astype(jnp.int32)
        return Trajectory(
            tokens=jnp.where(valid_mask, buf, cd.pad_id),
            valid_mask=valid_mask,
            loss_mask=carry["loss"],
            sampler_logprobs=carry["logp"],
            turn_ids=jnp.where(valid_mask, turn_ids, -1),
            token_rewards=token_rewards,
            turn_rewards=pt["reward"],
            turn_format_penalty=pt["penalty"],
            turn_mask=pt["mask"],
            turn_last_token=pt["last"],
            prompt_end=pt["prompt_end"],
            reasoning_start=pt["r_start"],
            reasoning_end=pt["r_end"],
            group_ids=(rows // c.group_size).astype(jnp.int32),
            episode_return=jnp.sum(pt["reward"], axis=1),
            success=carry["success"],
            num_turns=num_turns,
            num_actions=carry["num_actions"],
            valid_action_rate=jnp.sum(pt["valid_turn"], axis=1) / jnp.maximum(num_turns, 1),
            effective_action_rate=jnp.sum(pt["neff"], axis=1) / jnp.maximum(nexe, 1),
            response_length=response_length,
            truncated=carry["truncated"],
            context_start=pt["context_start"],
        )

    # ---- batched env access (vmapped JAX env, or a HostEnv's single host call) ---------------
    def _reset_batch(self, keys):
        if hasattr(self.env, "reset_batch"):
            return self.env.reset_batch(keys, self.env_params)
        return jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.env_params)

    def _render_batch(self, state):
        if hasattr(self.env, "render_batch"):
            return self.env.render_batch(state, self.env_params, self.fmt)
        return jax.vmap(lambda s: self.env.render_pieces(s, self.env_params, self.fmt))(state)

    def _step_batch(self, keys, state, actions, do):
        """One env step for the rows with ``do`` (the others keep their state)."""
        if hasattr(self.env, "step_batch"):
            return self.env.step_batch(keys, state, actions, self.env_params, do)
        _, nst, r, term, trunc, info = jax.vmap(self.env.step_env, in_axes=(0, 0, 0, None))(
            keys, state, actions, self.env_params)
        nst = jax.tree.map(lambda x, y: jnp.where(do.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), nst, state)
        return nst, r, term, trunc, info

    # ---- limited context window -------------------------------------------------------------
    def _window(self, turn_starts, t):
        """(first turn kept in turn ``t``'s window, int32 [B] transcript index where it starts)."""
        first = jnp.maximum(t - self.config.context_window + 1, 0)
        start = jnp.take_along_axis(turn_starts, jnp.broadcast_to(first, (turn_starts.shape[0], 1)), 1)[:, 0]
        return first, start

    def _context_start(self, turn_starts, t, P0, active):
        """Transcript index where turn ``t``'s visible history (after the preamble) begins."""
        if self.config.context_mode == "full":
            return jnp.where(active, P0, 0)
        first, start = self._window(turn_starts, t)
        return jnp.where(active, jnp.where(first > 0, start, P0), 0)

    def _cache_pos(self, turn_starts, pos, t, P0):
        """Cache write position in limited mode: preamble + the kept turns."""
        first, start = self._window(turn_starts, t)
        # With a one-turn window ``start`` lies after the previous close, which is not prefilled.
        return jnp.where(first > 0, P0 + jnp.maximum(pos - start, 0), pos)

    def _rebuild_window(self, model, cache, buf, turn_starts, pos, t, active, P0):
        """Re-prefill the last ``context_window - 1`` turns right after the preamble (slots ``P0..``).

        Before the window first slides (``t < context_window``) the cache already holds exactly
        that context and is kept as is. A one-turn window keeps nothing but the preamble: the new
        user block is written from slot ``P0`` and every slot past it is masked by position.
        """
        if self.config.context_window == 1:
            return cache
        first, start = self._window(turn_starts, t)
        B, L = buf.shape
        kept = jnp.where(active, pos - start, 0)
        j = jnp.arange(self.cache_len - P0)
        hist = jnp.take_along_axis(buf, jnp.clip(start[:, None] + j[None], 0, L - 1), 1)

        def rebuild(cache):
            return prefill(model, cache, hist, jnp.full((B,), P0, jnp.int32), kept)[1]

        return jax.lax.cond(first > 0, rebuild, lambda cache: cache, cache)


def rollout_metrics(traj: Trajectory, group_size: int) -> dict[str, jax.Array]:
    """Episode metrics of a batch (spec §4.6), means over episodes; ``pass@k`` over groups of ``k``.

    ``success``, ``num_actions``, ``valid_action_rate`` (turns whose parsed actions were all valid),
    ``effective_action_rate`` (executed actions that changed the state), ``response_length``
    (sampled tokens per episode), ``num_turns``, ``episode_return``, ``format_penalty`` (mean
    per-episode sum), ``truncated`` (episodes cut by ``max_seq_len``).
    """
    f = lambda x: jnp.mean(jnp.asarray(x, jnp.float32))
    groups = traj.success.reshape(-1, group_size)
    out = {
        "success": f(traj.success),
        "num_actions": f(traj.num_actions),
        "valid_action_rate": f(traj.valid_action_rate),
        "effective_action_rate": f(traj.effective_action_rate),
        "response_length": f(traj.response_length),
        "num_turns": f(traj.num_turns),
        "episode_return": f(traj.episode_return),
        "format_penalty": f(jnp.sum(traj.turn_format_penalty, axis=1)),
        f"pass@{group_size}": f(jnp.any(groups, axis=1)),
    }
    if traj.truncated is not None:
        out["truncated"] = f(traj.truncated)
    return out


def make_rollout(graphdef, env, env_params, tokenizer, config: RolloutConfig) -> Rollout:
    """Build the jitted multi-turn rollout; call it as ``rollout(params, key) -> Trajectory``."""
    if isinstance(graphdef, nnx.Module):
        graphdef = nnx.split(graphdef)[0]
    return Rollout(graphdef, env, env_params, tokenizer, config)
