"""The multi-turn rollout loop: model and vmapped environments run whole episodes on device.

``make_rollout(graphdef, env, env_params, tokenizer, config.rollout)`` returns a :class:`Rollout`;
``rollout(params, key) -> Trajectory`` is one ``jit``:

    reset envs (vmapped; the same reset key within a group)
    prefill the system prompt into every row's KV cache
    lax.scan over turns (``Rollout._turn`` over a ``TurnCarry``):
        _user_block: observation → piece ids (env.render_pieces) → tokens (codec tables, cumsum + scatter)
        context.prepare: what the turn sees (``FullContext`` / ``LimitedContext`` / ``ReprefillContext``),
            then the user block is prefilled at each row's own cache position (no re-prefill of the history)
        _reply: generate ≤ max_new_tokens (stop at "</answer>" or the template's end-of-turn token)
        _parse: reply tokens → bytes → actions (parser, vectorised)
        _step_envs: lax.scan over action slots, env.step_env (vmapped), masked by validity, budget and done
        record: per-turn reward, format penalty, success, done
    _assemble: close the last assistant messages, build the Trajectory

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
With ``remote=`` (a ``remote.ChatClient``) the replies come from a model behind a chat API
(``rollout.remote``): no local model runs, the rest of the loop is unchanged.
"""
from __future__ import annotations

import dataclasses
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from environments.hashing import lowbias32
from ragen_jax.models.decoder import decode_form, pack_for_decode
from ragen_jax.models.kv_cache import broadcast_cache, init_cache
from ragen_jax.models.sampler import SamplingConfig, generate, prefill
from ragen_jax.models.sharding import cache_shardings
from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout import parser as parser_lib
from ragen_jax.rollout import prompts
from ragen_jax.rollout.carry import ForcedReplies, Reply, TurnCarry, TurnRecord, UserBlock
from ragen_jax.rollout.chat import chat_framing
from ragen_jax.rollout.context import CONTEXT_STRATEGIES
from ragen_jax.rollout.remote import RemoteReplies
from ragen_jax.rollout.trajectory import Trajectory


def _write(arr, start, values, n):
    """Scatter ``values[b, :n[b]]`` into ``arr[b, start[b]:]`` (past the end dropped)."""
    rows = jnp.arange(arr.shape[0])
    j = jnp.arange(values.shape[1])
    dest = jnp.where(j[None] < n[:, None], start[:, None] + j[None], arr.shape[1])
    return arr.at[rows[:, None], dest].set(values, mode="drop")


def observation_hash(pieces, n_pieces):
    """uint32 ``[B]`` hash of each row's observation: its first ``n`` piece ids (``[B, P]``), each mixed
    with its position and summed, then mixed with the count. The same observation text always gives
    the same pieces and so the same hash (GiGPO's anchor state); two different ones collide with
    probability about 2^-32."""
    j = jnp.arange(pieces.shape[1], dtype=jnp.uint32)
    word = lowbias32(lowbias32(pieces.astype(jnp.uint32) + jnp.uint32(1)) ^ lowbias32(j + jnp.uint32(0x9E3779B9)))
    total = jnp.sum(jnp.where(j[None] < n_pieces[:, None].astype(jnp.uint32), word, jnp.uint32(0)), axis=1,
                    dtype=jnp.uint32)
    return lowbias32(total ^ lowbias32(n_pieces.astype(jnp.uint32) + jnp.uint32(0x85EBCA6B)))


def validation_keys(n: int, seed: int = 123) -> jax.Array:
    """A fixed set of ``n`` env reset keys (one group each) — the same puzzles at every evaluation."""
    return jax.random.split(jax.random.key(seed), n)


def action_vocab(env, reply_bytes: int):
    """What the parser matches answer parts against: the env's action names, or — for an env with
    free-text actions (``env.parse_action``) — a ``parser.TextActions`` of the env's own parser."""
    if env.parse_action is not None:
        return parser_lib.TextActions(env.parse_action, int(env.max_action_bytes or reply_bytes))
    return parser_lib.ActionVocab.from_names(tuple(env.action_names))



def answer_stop_sequences(tokenizer) -> set[tuple[int, ...]]:
    """The token sequences that close an answer: ``</answer>`` as tokenised alone, and after every
    printable character BPE merges into its first token (a space: `` </``; SmolLM2's ``>``: ``></``,
    so a tool call's ``</tool_call></answer>`` stops too). Another split runs on to end-of-turn."""
    alone = tuple(codec_lib.encode(tokenizer, "</answer>"))
    seqs = {alone}
    for c in " " + string.printable.strip():
        ids = tuple(codec_lib.encode(tokenizer, c + "</answer>"))
        if ids[-len(alone):] != alone:  # c merged into the tag's first token: the sequence starts with it
            seqs.add(ids)
    return seqs

class Rollout:
    """The compiled rollout of one (model architecture, env, tokenizer, config).

    ``rollout(params, key)`` draws ``num_groups`` reset keys and a sampling key from ``key``;
    ``rollout.run(params, env_keys [B], sample_key)`` takes explicit per-row env keys (validation).
    Either accepts ``forced=ForcedReplies(...)`` to script the replies.

    With a ``placement`` (``ragen_jax.placement``) the whole episode batch runs as one program over
    its mesh: rows (env states, transcripts, the KV cache) split over ('data', 'fsdp'), the cache's
    kv heads over 'tensor', the weights as the partition rules place them. Row ``b`` samples with
    key ``b`` either way, so the trajectory does not depend on the mesh.
    """

    def __init__(self, graphdef, env, env_params, tokenizer, config, placement=None, remote=None):
        if remote is not None and placement is not None:
            raise ValueError("a rollout with a remote policy runs on one device (placement=None): its replies "
                             "come from the host")
        self.graphdef = graphdef
        self.placement = placement
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

        max_obs_tokens = config.max_obs_tokens if config.max_obs_tokens is not None else env.max_obs_tokens
        if max_obs_tokens is None:
            max_obs_tokens = self._measure_obs_tokens(tokenizer, state_shape)
        self.max_obs_tokens = max_obs_tokens
        self.framing = chat_framing(tokenizer)
        self.system_text = prompts.build_system_text(env, fmt, config, board_shape, env_params)
        self.codec = codec_lib.PromptCodec(
            tokenizer, self.framing, env.piece_table, self.system_text,
            enable_think=config.enable_think, max_words=config.max_words,
            max_int=max(config.max_turns + 1, config.max_actions_per_traj),
            max_obs_pieces=max_obs_pieces, max_obs_tokens=max_obs_tokens, reward_decimals=config.reward_decimals,
            reward_limit=config.reward_limit,
        )

        self._build_reply_tables(env, tokenizer, config)

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
        self.context = CONTEXT_STRATEGIES[config.context_mode](self)
        self.remote = None
        if remote is not None:
            self.remote = RemoteReplies(
                remote, tokenizer, self.framing, preamble_len=preamble, max_new_tokens=config.max_new_tokens,
                forced_prefix=prompts.forced_prefix(config.enable_think), stop_at_answer=config.stop_at_answer,
                temperature=config.temperature, top_p=config.top_p,
                continue_final_message=getattr(remote, "continue_final_message", False), pad_id=self.codec.pad_id)
        jit = jax.jit if placement is None else placement.jit
        self._run = jit(self._rollout)
        self._run_from_key = jit(self._rollout_from_key)
        self._run_from_starts = jit(self._rollout_from_starts)

    def _build_reply_tables(self, env, tokenizer, config) -> None:
        """What parsing and stopping a reply need: the byte table of the reply tokens (one extra row
        holds the forced prefix's bytes), the action vocabulary, the stop ids and stop sequences."""
        byte_table, byte_len = codec_lib.token_byte_table(tokenizer)
        prefix = prompts.forced_prefix(config.enable_think).encode()
        width = max(byte_table.shape[1], len(prefix))
        table = np.zeros((byte_table.shape[0] + 1, width), np.uint8)
        table[:-1, : byte_table.shape[1]] = byte_table
        table[-1, : len(prefix)] = np.frombuffer(prefix, np.uint8)
        self.byte_table = jnp.asarray(table)
        self.byte_len = jnp.asarray(np.concatenate([byte_len, [len(prefix)]]).astype(np.int32))
        self.prefix_row = byte_table.shape[0]
        self.prefix_bytes = len(prefix)
        self.reply_bytes = len(prefix) + config.max_new_tokens * byte_table.shape[1]
        self.vocab = action_vocab(env, self.reply_bytes)

        self.stop_ids = jnp.asarray([self.codec.eot_id], jnp.int32)
        if config.stop_at_answer:
            seqs = answer_stop_sequences(tokenizer)
            width = max(len(q) for q in seqs)
            self.stop_sequences = jnp.asarray([list(q) + [-1] * (width - len(q)) for q in sorted(seqs)], jnp.int32)
        else:
            self.stop_sequences = jnp.zeros((0, 0), jnp.int32)

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
            acts = jax.vmap(env.random_action)(jax.random.split(ka, batch))
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
        if forced is not None:
            self._check_forced(forced, self.config.batch_size)
        key, forced = self._place(key, forced)
        return self._run_from_key(params, key, forced)

    def from_starts(self, params, group_key_data, sample_key, forced: ForcedReplies | None = None) -> Trajectory:
        """The step's rollout from chosen group starts: ``group_key_data`` uint32 ``[num_groups, key
        words]`` (reset-key data, each shared by its group) and ``sample_key``. ``rollout(params, key)``
        is this with the keys it draws from ``key`` (``starpo.start_replay`` replaces some)."""
        c = self.config
        group_key_data = np.asarray(group_key_data, np.uint32)
        if group_key_data.ndim != 2 or group_key_data.shape[0] != c.num_groups:
            raise ValueError(f"from_starts needs reset-key data [num_groups={c.num_groups}, words]; got "
                             f"shape {group_key_data.shape}")
        if forced is not None:
            self._check_forced(forced, c.batch_size)
        if self.placement is not None:
            group_key_data = self.placement.put_replicated(group_key_data)
        sample_key, forced = self._place(sample_key, forced)
        return self._run_from_starts(params, group_key_data, sample_key, forced)

    def run(self, params, env_keys, sample_key, forced: ForcedReplies | None = None) -> Trajectory:
        if self.placement is not None:
            env_keys = self.placement.put_batch(env_keys)
        sample_key, forced = self._place(sample_key, forced)
        return self._run(params, env_keys, sample_key, forced)

    def _place(self, key, forced):
        """Host-made inputs as global arrays on the mesh (with several processes jit takes no other)."""
        if self.placement is None:
            return key, forced
        return self.placement.put_replicated(key), None if forced is None else self.placement.put_batch(forced)

    def _rollout_from_key(self, params, key, forced):
        """``num_groups`` reset keys (each shared by the ``group_size`` rows of its group) and the
        sampling key, both drawn from ``key``; then ``_rollout_groups``."""
        env_key, sample_key = jax.random.split(key)
        return self._rollout_groups(params, jax.random.split(env_key, self.config.num_groups), sample_key, forced)

    def _rollout_from_starts(self, params, group_key_data, sample_key, forced):
        return self._rollout_groups(params, jax.random.wrap_key_data(group_key_data), sample_key, forced)

    def _rollout_groups(self, params, group_keys, sample_key, forced):
        """``_rollout`` with each of ``group_keys [G]`` shared by its group's ``group_size`` rows (and,
        with ``greedy_baseline``, a greedy episode per group whose return becomes ``reward_baseline``)."""
        c = self.config
        env_keys = jnp.repeat(group_keys, c.group_size, axis=0)
        traj = self._rollout(params, self._constrain(env_keys), sample_key, forced)
        if not c.greedy_baseline or forced is not None:
            return traj
        # One greedy row per group (every row of a group would play the same episode); on a mesh
        # all rows, so the batch splits over the devices as the sampled one does.
        keys = group_keys if self.placement is None else env_keys
        greedy = self._rollout(params, self._constrain(keys), sample_key, None, greedy=True)
        baseline = greedy.episode_return if self.placement is not None else jnp.repeat(
            greedy.episode_return, c.group_size)
        return traj.replace(reward_baseline=self._constrain(baseline))

    def _constrain(self, tree):
        """Pin a pytree of [B, ...] arrays to the batch layout of the mesh (identity without one)."""
        if self.placement is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.placement.batch_shardings(tree))

    def _check_forced(self, forced, batch):
        c = self.config
        if forced.tokens.ndim != 3 or forced.tokens.shape[:2] != (batch, c.max_turns) or \
                forced.tokens.shape[2] > c.max_new_tokens or forced.lengths.shape != (batch, c.max_turns):
            raise ValueError(
                f"ForcedReplies must hold tokens [B={batch}, T={c.max_turns}, N<={c.max_new_tokens}] and lengths "
                f"[B, T]; got tokens {forced.tokens.shape}, lengths {forced.lengths.shape}"
            )

    # ---------------------------------------------------------------------------------------
    def _rollout(self, params, env_keys, sample_key, forced, greedy: bool = False):
        """The whole episode batch: reset, system prompt, ``max_turns`` turns under ``lax.scan``, close.
        ``greedy``: sample at temperature 0 whatever the config says (ReMax's baseline episodes)."""
        # Sampling runs on the model's decode form, built once for the whole rollout: LoRA adapters folded
        # in, layers unstacked and, on a CPU, the weights in the matmul kernel's panels
        # (decoder.decode_form; the same function up to float rounding).
        if self.remote is not None:
            model = (self.graphdef, params)
        elif self.config.decode_weights == "folded":
            model = decode_form(self.graphdef, params)
        else:
            model = (self.graphdef, pack_for_decode(self.graphdef, params))
        carry = self._initial_carry(model, env_keys, sample_key)
        carry, record = jax.lax.scan(lambda c, t: self._turn(model, env_keys, forced, c, t, greedy), carry,
                                     jnp.arange(self.config.max_turns))
        record = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), record)  # [B, T]
        return self._constrain(self._assemble(carry, record))

    def _initial_carry(self, model, env_keys, sample_key) -> TurnCarry:
        """Reset envs, prefill the system prompt (``P0`` tokens) into every row's cache and transcript."""
        c, cd = self.config, self.codec
        B, L = env_keys.shape[0], c.max_seq_len
        _, state = self.env.reset_batch(env_keys, self.env_params)
        pre = jnp.asarray(cd.preamble_ids)
        P0 = pre.shape[0]
        cache = None  # a remote policy keeps its own
        if self.remote is None:
            # Every row opens with the same system prompt: prefill it once, then give each row a copy.
            _, one = prefill(model, init_cache(nnx.merge(*model).cfg, 1, self.cache_len), pre[None],
                             jnp.zeros((1,), jnp.int32), jnp.full((1,), P0, jnp.int32))
            cache = broadcast_cache(one, B)
        if self.placement is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, self.placement.mesh))
        return self._constrain_carry(TurnCarry(
            cache=cache, state=state, pos=jnp.full((B,), P0, jnp.int32),
            buf=jnp.full((B, L), cd.pad_id, jnp.int32).at[:, :P0].set(pre),
            loss=jnp.zeros((B, L), bool), logp=jnp.zeros((B, L), jnp.float32),
            turn_ids=jnp.full((B, L), -1, jnp.int32), keys=jax.random.split(sample_key, B),
            done=jnp.zeros((B,), bool), truncated=jnp.zeros((B,), bool),
            success=jnp.zeros((B,), bool), num_actions=jnp.zeros((B,), jnp.int32),
            eot=jnp.zeros((B,), bool), reward_id=jnp.full((B,), cd.reward_zero, jnp.int32),
            warn=jnp.zeros((B,), bool), turn_starts=jnp.full((B, c.max_turns), P0, jnp.int32),
        ))

    def _constrain_carry(self, carry: TurnCarry) -> TurnCarry:
        """Every per-row field of the turn carry in the batch layout; the cache keeps its own."""
        if self.placement is None:
            return carry
        return carry.replace(**{f.name: self._constrain(getattr(carry, f.name))
                                for f in dataclasses.fields(carry) if f.name != "cache"})

    def _turn(self, model, env_keys, forced, carry: TurnCarry, t, greedy: bool = False):
        """One turn for every row: prompt → generate → parse → step envs → record."""
        block = self._user_block(carry, t)  # prompt: the user block, and who takes the turn
        buf, turn_ids, prompt_end, context_start = self._write_prompt(carry, block, t)
        reply = self._generate(model, carry, block, buf, prompt_end, context_start, forced, t, greedy)
        buf, loss, logp, turn_ids, eot, pos = self._write_reply(carry, buf, turn_ids, prompt_end, reply, block.active, t)
        parsed, reasoning_end, rbytes, nbytes = self._parse(reply.tokens, reply.length, prompt_end)
        reasoning_reward = self._reasoning_reward(carry.state, rbytes, nbytes, block.active)
        describes = self._describes_state(carry.state, rbytes, nbytes, block.active)
        stepped_envs = self._step_envs(env_keys, carry, parsed, block.active)
        new = self._next_carry(carry, block, reply, parsed, stepped_envs,
                               dict(buf=buf, loss=loss, logp=logp, turn_ids=turn_ids, eot=eot, pos=pos))
        record = self._record(block, reply, parsed, stepped_envs, reasoning_reward, describes, prompt_end,
                              reasoning_end, context_start, pos)
        return new, record

    def _write_prompt(self, carry: TurnCarry, block: UserBlock, t):
        """The user block into the transcript. -> ``(buf, turn_ids, prompt_end [B], context_start [B])``."""
        buf = _write(carry.buf, carry.pos, block.chunk, block.length)
        # The close of the previous assistant message (piece 0) belongs to the previous turn.
        turn_ids = _write(carry.turn_ids, carry.pos, jnp.where(block.source == 0, t - 1, t), block.length)
        prompt_end = carry.pos + block.length
        context_start = self.context.context_start(block.turn_starts, t, len(self.codec.preamble_ids), block.active)
        return buf, turn_ids, prompt_end, context_start

    def _generate(self, model, carry: TurnCarry, block: UserBlock, buf, prompt_end, context_start, forced, t,
                  greedy: bool = False) -> Reply:
        """The turn's reply: the context this turn sees prefilled, then sampled (or scripted) tokens; or
        a hosted model's reply to the transcript so far."""
        active = block.active
        if self.remote is not None:
            tokens, rlen, rlogp, stopped, failed = self._remote_reply(buf, context_start, prompt_end, active, t)
            return Reply(tokens=tokens, length=rlen, logp=rlogp, stopped=stopped, failed=failed, cache=carry.cache,
                         keys=carry.keys)
        cache, chunk, clen, cache_pos = self.context.prepare(model, carry, block, t)
        last_logits, cache = prefill(model, cache, chunk, cache_pos, clen, self.config.prefill_pieces)
        tokens, rlen, rlogp, stopped, cache, keys = self._reply(model, cache, last_logits, cache_pos + clen, active,
                                                                carry.keys, forced, t, greedy)
        return Reply(tokens=tokens, length=rlen, logp=rlogp, stopped=stopped, failed=jnp.zeros_like(active),
                     cache=cache, keys=keys)

    def _write_reply(self, carry: TurnCarry, buf, turn_ids, prompt_end, reply: Reply, active, t):
        """The reply into the transcript, its loss mask and log-probs. -> ``(buf, loss, logp, turn_ids,
        eot [B] (it ended with the end-of-turn token), pos [B])``."""
        buf = _write(buf, prompt_end, reply.tokens, reply.length)
        loss = _write(carry.loss, prompt_end, jnp.ones_like(reply.tokens, bool), reply.length)
        logp = _write(carry.logp, prompt_end, reply.logp, reply.length)
        turn_ids = _write(turn_ids, prompt_end, jnp.full_like(reply.tokens, t), reply.length)
        last_tok = jnp.take_along_axis(reply.tokens, jnp.maximum(reply.length - 1, 0)[:, None], 1)[:, 0]
        eot = active & (reply.length > 0) & (last_tok == self.codec.eot_id)
        return buf, loss, logp, turn_ids, eot, prompt_end + reply.length

    def _next_carry(self, carry: TurnCarry, block: UserBlock, reply: Reply, parsed, stepped_envs,
                    written: dict) -> TurnCarry:
        """What this turn hands the next: the transcript so far, the env states, and the episode's end."""
        c, cd = self.config, self.codec
        active = block.active
        state, num_actions, env_done, rsum, success, _, _ = stepped_envs
        stepped = active & (parsed.n_valid > 0)
        # A reply the API could not give (after its retries) ends the episode.
        done = block.done | (active & (env_done | (num_actions >= c.max_actions_per_traj) | reply.failed))
        return TurnCarry(
            cache=reply.cache, state=state, pos=written["pos"], buf=written["buf"], loss=written["loss"],
            logp=written["logp"], turn_ids=written["turn_ids"], keys=reply.keys,
            done=done, truncated=block.truncated, success=success, num_actions=num_actions,
            eot=jnp.where(active, written["eot"], carry.eot),
            reward_id=jnp.where(active, cd.reward_id(rsum, stepped), carry.reward_id),
            warn=jnp.where(active, ~stepped, carry.warn), turn_starts=block.turn_starts,
        )

    def _record(self, block: UserBlock, reply: Reply, parsed, stepped_envs, reasoning_reward, describes,
                prompt_end, reasoning_end, context_start, pos) -> TurnRecord:
        """What the turn leaves in the episode's record (``TurnRecord``, ``[B]``)."""
        c = self.config
        active = block.active
        _, _, _, rsum, _, nexe, neff = stepped_envs
        penalty = active & parsed.format_penalty & ~reply.failed  # an API failure is not the model's format
        return TurnRecord(
            reward=jnp.where(active, rsum + jnp.where(penalty, c.format_penalty, 0.0) + reasoning_reward, 0.0),
            format_penalty=jnp.where(penalty, c.format_penalty, 0.0), reasoning_reward=reasoning_reward,
            took_turn=active, last_token=jnp.where(active & (reply.length > 0), pos - 1, -1),
            prompt_end=jnp.where(active, prompt_end, 0), reasoning_start=jnp.where(active, prompt_end, 0),
            reasoning_end=jnp.where(active, reasoning_end, 0), parsed=active & ~parsed.format_penalty,
            actions_executed=nexe, actions_effective=neff, context_start=context_start,
            anchor=jnp.where(active, block.anchor, jnp.uint32(0)), reply_cut=active & ~reply.stopped,
            observation=jnp.where(active[:, None], block.observation, 0),
            observation_len=jnp.where(active, block.observation_len, 0),
            describes_state=describes,
        )

    def _user_block(self, carry: TurnCarry, t) -> UserBlock:
        """Turn ``t``'s user block from the env state (previous close, reward, warning, board), and
        which rows take the turn: a live row whose block and whole turn still fit the transcript."""
        c, cd = self.config, self.codec
        pieces, n_pieces = self.env.render_batch(carry.state, self.env_params, self.fmt)
        actions_left = c.max_actions_per_traj - carry.num_actions
        ids, valid = jax.vmap(
            lambda p, n, e, r, w, a: cd.turn_pieces(t, p, n, eot_emitted=e, reward_id=r, warning=w, actions_left=a)
        )(pieces, n_pieces, carry.eot, carry.reward_id, carry.warn, actions_left)
        chunk, clen, src = jax.vmap(cd.chunk)(ids, valid)
        fits = (clen <= cd.chunk_len) & (carry.pos + clen + c.max_new_tokens + cd.end_len <= c.max_seq_len)
        live = ~carry.done
        active = live & fits
        clen = jnp.where(active, clen, 0)
        # Where this turn's user content starts (after the previous assistant's close).
        close_len = jnp.sum((src == 0) & (jnp.arange(cd.chunk_len)[None] < clen[:, None]), axis=1)
        turn_starts = carry.turn_starts.at[:, t].set(jnp.where(active, carry.pos + close_len, carry.turn_starts[:, t]))
        return UserBlock(chunk=chunk, length=clen, source=src, close_len=close_len, active=active,
                         done=carry.done | (live & ~fits), truncated=carry.truncated | (live & ~fits),
                         turn_starts=turn_starts, anchor=observation_hash(pieces, n_pieces),
                         observation=pieces.astype(jnp.int32), observation_len=n_pieces.astype(jnp.int32))

    def _reply(self, model, cache, last_logits, start, active, keys, forced, t, greedy: bool = False):
        """Sample (or, with ``forced``, replay) up to ``max_new_tokens`` reply tokens from cache slot
        ``start``. -> ``(tokens [B, N], lengths [B], log-probs [B, N], stopped [B], cache, keys)``;
        ``stopped``: the reply ended on a stop (a scripted reply always counts as stopped)."""
        c, cd = self.config, self.codec
        B, N = active.shape[0], c.max_new_tokens
        if forced is None:
            sampling = SamplingConfig.create(0.0 if greedy else c.temperature, c.top_k, c.top_p)
            out = generate(model, cache, last_logits, start, active, keys, sampling, self.stop_ids,
                           self.stop_sequences, N, pad_id=cd.pad_id)
            return out.tokens, out.lengths, out.logprobs, out.stopped, out.cache, out.keys
        ftok = jnp.zeros((B, N), jnp.int32).at[:, : forced.tokens.shape[2]].set(forced.tokens[:, t])
        rlen = jnp.where(active, forced.lengths[:, t], 0)
        ftok = jnp.where(jnp.arange(N)[None] < rlen[:, None], ftok, cd.pad_id)
        _, cache = prefill(model, cache, ftok, start, rlen, c.prefill_pieces)
        return ftok, rlen, jnp.zeros((B, N), jnp.float32), active, cache, keys

    def _remote_reply(self, buf, context_start, prompt_end, active, t):
        """The replies of a model behind a chat API (``remote.RemoteReplies``, on the host) ->
        ``(tokens [B, N], lengths [B], log-probs [B, N] (0: the API's are not ours), stopped [B],
        failed [B])``; ``failed``: the request failed after its retries (the episode ends)."""
        B, N = active.shape[0], self.config.max_new_tokens
        shapes = (jax.ShapeDtypeStruct((B, N), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32),
                  jax.ShapeDtypeStruct((B,), jnp.bool_), jax.ShapeDtypeStruct((B,), jnp.bool_))
        # Unordered: each turn's call depends on the previous turn's replies through ``buf``.
        tokens, lengths, stopped, failed = io_callback(self.remote, shapes, buf, context_start, prompt_end, active, t)
        lengths = jnp.where(active, lengths, 0)
        return tokens, lengths, jnp.zeros((B, N), jnp.float32), stopped & active, failed & active

    def _parse(self, reply, rlen, gen_start):
        """Reply tokens → bytes → ``parser.parse_reply``; plus where the reasoning ends in the
        transcript (the token holding ``</think>``; ``gen_start``, an empty span, when the reply
        does not parse) and the reply's bytes (``uint8 [B, reply_bytes]``, the forced prefix first;
        their counts [B])."""
        c = self.config
        B, N = reply.shape
        pid = jnp.concatenate([jnp.full((B, 1), self.prefix_row, jnp.int32), reply], axis=1)
        pvalid = jnp.concatenate([jnp.ones((B, 1), bool), jnp.arange(N)[None] < rlen[:, None]], axis=1)
        rbytes, nbytes, bsrc = jax.vmap(
            lambda i, v: codec_lib.tokens_to_bytes(self.byte_table, self.byte_len, i, v, self.reply_bytes)
        )(pid, pvalid)
        parsed = jax.vmap(lambda b, n: parser_lib.parse_reply(b, n, self.vocab, c.max_actions_per_turn,
                                                              c.enable_think))(rbytes, nbytes)
        if not c.enable_think:
            return parsed, gen_start, rbytes, nbytes
        # Reasoning span: after the forced "<think>" up to the token holding "</think>". A reply that
        # does not parse has none (empty span): the MI proxy excludes the turn, as the original does,
        # rather than scoring the whole malformed reply as reasoning.
        end_tok = jnp.take_along_axis(bsrc, jnp.clip(parsed.think_end, 0, self.reply_bytes - 1)[:, None], 1)[:, 0]
        return parsed, jnp.where(parsed.matched, gen_start + end_tok - 1, gen_start), rbytes, nbytes

    def _reasoning_reward(self, state, rbytes, nbytes, active):
        """The environment's reward for each reply's reasoning (``AgentFacing.reasoning_reward``) on the
        state it answered; [B] float32, 0 on inactive rows and for an environment without one. The
        reply's bytes open with the forced prefix, which the environment does not see."""
        if not self.env.gives_reasoning_reward(self.env_params):
            return jnp.zeros(active.shape, jnp.float32)
        k = self.prefix_bytes
        r = jax.vmap(lambda s, b, n: self.env.reasoning_reward(s, b, n, self.env_params))(
            state, rbytes[:, k:], jnp.maximum(nbytes - k, 0))
        return jnp.where(active, r, 0.0).astype(jnp.float32)

    def _describes_state(self, state, rbytes, nbytes, active):
        """Whether each reply's reasoning opens with the exact description of the state it answered
        (``AgentFacing.describes_state``): bool [B], False on inactive rows; None for an environment
        without a description."""
        if not self.env.has_description():
            return None
        k = self.prefix_bytes
        d = jax.vmap(self.env.describes_state)(state, rbytes[:, k:], jnp.maximum(nbytes - k, 0))
        return active & d

    def _step_envs(self, env_keys, carry: TurnCarry, parsed, active):
        """The parsed actions, one slot at a time (``lax.scan``), each masked by validity, the
        episode's action budget and termination. -> ``(state, num_actions, env_done, reward sum,
        success, executed, effective)``."""
        c = self.config
        B = active.shape[0]

        def act(sc, k):
            st, nact, env_done, rsum, succ, nexe, neff = sc
            a = jax.tree.map(lambda x: x[:, k], parsed.actions)
            if isinstance(self.vocab, parser_lib.ActionVocab):
                a = jnp.maximum(a, 0)  # -1 pads the unused slots
            do = active & (k < parsed.n_valid) & (nact < c.max_actions_per_traj) & ~env_done
            skeys = jax.vmap(lambda key, n: jax.random.fold_in(key, n + 1))(env_keys, nact)
            st, r, term, trunc, info = self.env.step_batch(skeys, st, a, self.env_params, do)
            ended = do & (term | trunc)
            return (st, nact + do, env_done | ended, rsum + jnp.where(do, r, 0.0),
                    succ | (ended & info["success"] & term), nexe + do,
                    neff + (do & info["action_is_effective"])), None

        init = (carry.state, carry.num_actions, jnp.zeros((B,), bool), jnp.zeros((B,), jnp.float32),
                carry.success, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))
        return jax.lax.scan(act, init, jnp.arange(c.max_actions_per_turn))[0]

    def _assemble(self, carry: TurnCarry, rec: TurnRecord) -> Trajectory:
        """Close each row's last assistant message (the next turn never came) and build the Trajectory."""
        c, cd = self.config, self.codec
        B, L = carry.buf.shape
        rows = jnp.arange(B)
        had_turn = jnp.any(rec.took_turn, axis=1)
        close_id = jnp.where(carry.eot, cd.end_rest, cd.end_full)
        ctoks, clen, _ = jax.vmap(
            lambda i: codec_lib.concat_pieces(cd.table, cd.lengths, i[None], jnp.ones((1,), bool), cd.end_len, cd.pad_id)
        )(close_id)
        clen = jnp.where(had_turn, clen, 0)
        last_turn = jnp.maximum(jnp.sum(rec.took_turn, axis=1) - 1, 0)
        buf = _write(carry.buf, carry.pos, ctoks, clen)
        turn_ids = _write(carry.turn_ids, carry.pos, jnp.broadcast_to(last_turn[:, None], ctoks.shape), clen)
        length = carry.pos + clen

        valid_mask = jnp.arange(L)[None] < length[:, None]
        token_rewards = jnp.zeros((B, L), jnp.float32).at[rows[:, None], jnp.where(rec.last_token >= 0, rec.last_token, L)].add(
            rec.reward, mode="drop")
        num_turns = jnp.sum(rec.took_turn, axis=1).astype(jnp.int32)
        nexe = jnp.sum(rec.actions_executed, axis=1)
        return Trajectory(
            tokens=jnp.where(valid_mask, buf, cd.pad_id),
            valid_mask=valid_mask,
            loss_mask=carry.loss,
            sampler_logprobs=carry.logp,
            turn_ids=jnp.where(valid_mask, turn_ids, -1),
            token_rewards=token_rewards,
            turn_rewards=rec.reward,
            turn_format_penalty=rec.format_penalty,
            turn_reasoning_reward=rec.reasoning_reward,
            turn_mask=rec.took_turn,
            turn_last_token=rec.last_token,
            prompt_end=rec.prompt_end,
            reasoning_start=rec.reasoning_start,
            reasoning_end=rec.reasoning_end,
            group_ids=(rows // c.group_size).astype(jnp.int32),
            episode_return=jnp.sum(rec.reward, axis=1),
            success=carry.success,
            num_turns=num_turns,
            num_actions=carry.num_actions,
            valid_action_rate=jnp.sum(rec.parsed, axis=1) / jnp.maximum(num_turns, 1),
            effective_action_rate=jnp.sum(rec.actions_effective, axis=1) / jnp.maximum(nexe, 1),
            response_length=jnp.sum(carry.loss, axis=1).astype(jnp.int32),
            truncated=carry.truncated,
            context_start=rec.context_start,
            turn_state_hash=rec.anchor,
            turn_observation=rec.observation,
            turn_observation_len=rec.observation_len,
            turn_reply_cut=rec.reply_cut,
            turn_describes_state=rec.describes_state,
        )



def make_rollout(graphdef, env, env_params, tokenizer, config, placement=None, remote=None) -> Rollout:
    """Build the jitted multi-turn rollout; call it as ``rollout(params, key) -> Trajectory``.
    ``remote``: a ``remote.ChatClient`` whose API writes the replies (``graphdef`` and ``params``
    may then be None)."""
    if isinstance(graphdef, nnx.Module):
        graphdef = nnx.split(graphdef)[0]
    return Rollout(graphdef, env, env_params, tokenizer, config, placement=placement, remote=remote)
