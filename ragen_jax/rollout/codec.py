"""Text ↔ tokens on device, through tables built once from the tokenizer.

Two directions:
  * **text → tokens** (observations, prompt pieces). Every string the loop may ever write — the
    env's ``piece_table``, the fixed prompt fragments, the printed numbers — is tokenised once into
    a padded table ``tokens [P, W]`` with ``lengths [P]``. A text on device is a list of piece ids;
    its tokens are the concatenation of the pieces' rows (:func:`concat_pieces`: cumsum of lengths
    gives each piece's offset, one scatter writes them all; static output length).
  * **tokens → bytes** (the model's reply). ``token_bytes [V, max_bytes]`` holds each token's UTF-8
    bytes (special tokens map to no bytes, as ``decode(skip_special_tokens=True)`` in the original);
    a reply's byte string is again a concatenation, the same :func:`concat_pieces`.

Because every piece is tokenised on its own, the token sequence can differ from tokenising the
whole text at once; it always *decodes* to the same text (checked per piece at build time), and the
trainer consumes the exact tokens the model read, so the difference never matters for learning.
"""
from __future__ import annotations

import functools
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.rollout import prompts


# --------------------------------------------------------------------------------------------
# Device: concatenation of table rows
# --------------------------------------------------------------------------------------------
def concat_pieces(table, lengths, ids, valid, out_len: int, pad_id: int = 0):
    """Concatenate table rows selected by ``ids`` (those with ``valid``) into a fixed-size buffer.

    Args:
      table: ``[P, W]`` padded rows (token ids or bytes).
      lengths: int32 ``[P]`` valid entries per row.
      ids: int32 ``[M]`` piece ids in order.
      valid: bool ``[M]`` piece present (invalid pieces contribute nothing).
      out_len: static output length; entries past it are dropped (callers size it from the bound).
    Returns:
      ``(out [out_len], n int32 [], src int32 [out_len])`` — the concatenation, its length (not
      clipped) and, per output entry, the index ``m`` of the piece it came from (-1 for padding).
    """
    ids = jnp.asarray(ids, jnp.int32)
    lens = jnp.where(valid, lengths[ids], 0)
    ends = jnp.cumsum(lens)
    starts = ends - lens
    width = table.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)
    dest = starts[:, None] + j[None, :]  # [M, W]
    dest = jnp.where(j[None, :] < lens[:, None], dest, out_len)  # out of range -> dropped
    flat = dest.reshape(-1)
    out = jnp.full((out_len,), pad_id, table.dtype).at[flat].set(table[ids].reshape(-1), mode="drop")
    m = jnp.broadcast_to(jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None], dest.shape).reshape(-1)
    src = jnp.full((out_len,), -1, jnp.int32).at[flat].set(m, mode="drop")
    n = ends[-1] if ids.shape[0] else jnp.int32(0)
    return out, n, src


# --------------------------------------------------------------------------------------------
# Host: tables
# --------------------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with special-token strings recognised and nothing added around it."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode(tokenizer, ids) -> str:
    """Exact text of ``ids`` (special tokens kept, no whitespace clean-up)."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class TokenTable:
    """A padded token table over a list of entries; an entry is a string or a tuple of token ids.

    ``index[name]`` gives the row of a named entry; ``add_block`` appends many entries at once and
    returns the first row. ``build()`` freezes the table into device arrays.
    """

    def __init__(self, tokenizer, pad_id: int):
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.rows: list[list[int]] = []
        self.texts: list[str] = []
        self.index: dict[str, int] = {}

    def _row(self, entry) -> tuple[list[int], str]:
        if isinstance(entry, str):
            ids = encode(self.tokenizer, entry) if entry else []
            if decode(self.tokenizer, ids) != entry:
                raise ValueError(
                    f"the tokenizer does not round-trip the prompt piece {entry!r} (decodes to "
                    f"{decode(self.tokenizer, ids)!r}); the rollout needs a lossless tokenizer "
                    "(byte-level BPE or byte-fallback)"
                )
            return ids, entry
        ids = [int(i) for i in entry]
        return ids, decode(self.tokenizer, ids)

    def add(self, name: str, entry) -> int:
        if name in self.index:
            raise ValueError(f"duplicate table entry {name!r}")
        ids, text = self._row(entry)
        self.index[name] = len(self.rows)
        self.rows.append(ids)
        self.texts.append(text)
        return self.index[name]

    def add_block(self, name: str, entries: Sequence) -> int:
        first = len(self.rows)
        if entries:
            strings = [e for e in entries if isinstance(e, str)]
            encoded = self.tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else []
            it = iter(encoded)
            for e in entries:
                if isinstance(e, str):
                    ids = list(next(it))
                    if decode(self.tokenizer, ids) != e:
                        raise ValueError(
                            f"the tokenizer does not round-trip {e!r} (table {name!r}); the rollout needs a "
                            "lossless tokenizer (byte-level BPE or byte-fallback)"
                        )
                    self.rows.append(ids)
                    self.texts.append(e)
                else:  # token ids, kept as given
                    self.rows.append([int(i) for i in e])
                    self.texts.append("")
        self.index[name] = first
        return first

    def length(self, row: int) -> int:
        return len(self.rows[row])

    def build(self) -> tuple[jax.Array, jax.Array]:
        width = max(1, max((len(r) for r in self.rows), default=1))
        table = np.full((len(self.rows), width), self.pad_id, np.int32)
        for i, r in enumerate(self.rows):
            table[i, : len(r)] = r
        lengths = np.array([len(r) for r in self.rows], np.int32)
        return jnp.asarray(table), jnp.asarray(lengths)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte → printable-unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "generic"
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "generic"


def token_byte_table(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes uint8 [V, max_bytes], lengths int32 [V])``: each token id's UTF-8 bytes.

    Special tokens (``<|im_end|>``, ...) have no bytes, like ``decode(skip_special_tokens=True)``.
    Byte-level BPE and SentencePiece byte-fallback vocabularies are mapped exactly; any other
    tokenizer falls back to decoding each id alone (exact for tokens that are whole characters).
    """
    vocab = len(tokenizer)
    kind = _decoder_kind(tokenizer)
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    added = tokenizer.added_tokens_decoder
    toks = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    bdec = _byte_decoder()
    out: list[bytes] = []
    for i, t in enumerate(toks):
        if i in special or t is None:
            out.append(b"")
        elif i in added:
            out.append(str(added[i]).encode("utf-8"))
        elif kind == "byte_level":
            try:
                out.append(bytes(bdec[c] for c in t))
            except KeyError:
                out.append(t.encode("utf-8"))
        elif kind == "sentencepiece":
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                out.append(bytes([int(t[3:5], 16)]))
            else:
                out.append(t.replace("\u2581", " ").encode("utf-8"))
        else:
            out.append(tokenizer.decode([i], skip_special_tokens=True).encode("utf-8"))
    width = max(1, max(len(b) for b in out))
    table = np.zeros((vocab, width), np.uint8)
    lengths = np.zeros((vocab,), np.int32)
    for i, b in enumerate(out):
        table[i, : len(b)] = np.frombuffer(b, np.uint8)
        lengths[i] = len(b)
    return table, lengths


def tokens_to_bytes(byte_table, byte_lengths, tokens, valid, out_len: int):
    """A reply's bytes. ``tokens`` int32 ``[N]``, ``valid`` bool ``[N]`` →
    ``(bytes uint8 [out_len], n int32 [], token_index int32 [out_len])`` (token each byte came from)."""
    return concat_pieces(byte_table, byte_lengths, tokens, valid, out_len, pad_id=0)


# --------------------------------------------------------------------------------------------
# The agent's user turns as pieces
# --------------------------------------------------------------------------------------------
class PromptCodec:
    """Token tables for every text the agent loop writes, and the device assembly of a turn.

    One table holds: the environment's ``piece_table`` (observations), the chat framing, the fixed
    prompt fragments, the printed integers ``0..max_int`` (turn numbers, actions left) and the
    printed rewards. Rewards are printed to ``reward_decimals`` places (``prompts.reward_text``):
    the table holds every multiple of ``10**-reward_decimals`` in ``[-reward_limit, reward_limit]``;
    a turn reward outside that range is printed clipped to the nearest end (the trainer still sees
    the exact value — only the text the model reads is clipped).

    A turn's chunk (what ``prefill`` writes for turn ``t``, 0-based) is::

        [close of the previous assistant message + user header]        (t > 0)
        ["Reward:\\n" r "\\n"]                                            (t > 0)
        "\\nTurn " t+1 ":\\nState:\\n" <observation> "\\n" [warning]
        "You have " n " actions left. Always output: ... (tokens).\\n"
        <generation prompt> <forced "<think>">

    The close is ``assistant_end`` when the model did not emit the end-of-turn token itself and the
    rest of it when it did.
    """

    def __init__(
        self,
        tokenizer,
        framing,
        env_pieces,
        system_text: str,
        *,
        enable_think: bool,
        max_words: int,
        max_int: int,
        max_obs_pieces: int,
        max_obs_tokens: int | None = None,
        reward_decimals: int = 1,
        reward_limit: float = 50.0,
    ):
        self.framing = framing
        self.enable_think = enable_think
        self.max_words = max_words
        self.reward_decimals = reward_decimals
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_id = int(pad_id)
        t = TokenTable(tokenizer, self.pad_id)
        self.table_builder = t
        strip = framing.trims_content

        if isinstance(env_pieces, str) and env_pieces == "tokens":
            # Host environments hand over token ids: piece i is token i.
            env_pieces = [(i,) for i in range(len(tokenizer))]
        self.env_offset = t.add_block("env", list(env_pieces))
        end_ids = encode(tokenizer, framing.assistant_end)
        eot_ids = encode(tokenizer, framing.end_of_turn)
        if len(eot_ids) != 1 or end_ids[:1] != eot_ids:
            raise ValueError(
                f"the end-of-turn string {framing.end_of_turn!r} must be a single token that opens "
                f"the assistant close {framing.assistant_end!r}"
            )
        self.eot_id = eot_ids[0]
        self.close_full_ids = end_ids
        header = framing.user_header
        self.close_full = t.add("close_full", tuple(end_ids + encode(tokenizer, header)))
        self.close_rest = t.add("close_rest", tuple(end_ids[1:] + encode(tokenizer, header)))
        self.end_full = t.add("end_full", tuple(end_ids))
        self.end_rest = t.add("end_rest", tuple(end_ids[1:]))
        self.reward_head = t.add("reward_head", "Reward:\n")
        self.newline = t.add("newline", "\n")
        self.turn_head = t.add("turn_head", "\nTurn ")
        self.turn_head_first = t.add("turn_head_first", "Turn " if strip else "\nTurn ")
        self.state_head = t.add("state_head", ":\nState:\n")
        self.warning = t.add("warning", prompts.INVALID_ACTION_WARNING)
        self.you_have = t.add("you_have", "You have ")
        tail = (
            f" actions left. Always output: {prompts.format_instruction(enable_think)} with no extra text. "
            f"Strictly follow this format. Max response length: {max_words} words (tokens).\n"
        )
        self.tail = t.add("tail", tail.rstrip() if strip else tail)
        self.gen_prompt = t.add("gen_prompt", framing.user_to_assistant)
        self.forced = t.add("forced", prompts.forced_prefix(enable_think))
        self.int_offset = t.add_block("ints", [str(i) for i in range(max_int + 1)])
        self.max_int = max_int
        scale = 10**reward_decimals
        self.reward_kmax = int(round(reward_limit * scale))
        self.reward_limit = self.reward_kmax / scale
        self.reward_offset = t.add_block(
            "rewards", [prompts.reward_text(k / scale, reward_decimals) for k in range(-self.reward_kmax, self.reward_kmax + 1)]
        )
        self.reward_zero = t.add("reward_unstepped", prompts.reward_text(None))
        self.table, self.lengths = t.build()
        self.max_obs_pieces = max_obs_pieces

        self.chunk_len = self._max_chunk_len(t, len(env_pieces), max_int, max_obs_pieces, max_obs_tokens)
        L = t.length
        self.preamble_text = framing.preamble + (system_text.strip() if strip else system_text) + framing.system_to_user
        self.preamble_ids = np.asarray(encode(tokenizer, self.preamble_text), np.int32)
        if decode(tokenizer, self.preamble_ids) != self.preamble_text:
            raise ValueError("the tokenizer does not round-trip the system prompt; use a lossless tokenizer")
        self.forced_len = L(self.forced)
        self.end_len = L(self.end_full)

    def _max_chunk_len(self, t: TokenTable, num_env_pieces: int, max_int: int, max_obs_pieces: int,
                       max_obs_tokens: int | None) -> int:
        """Static bound on a turn chunk's length: the longest candidate of every slot."""
        L = t.length
        env_max = max(L(self.env_offset + i) for i in range(num_env_pieces)) if num_env_pieces else 0
        int_max = max(L(self.int_offset + i) for i in range(max_int + 1))
        rew_max = max(L(self.reward_offset + i) for i in range(2 * self.reward_kmax + 1))
        return (
            max(L(self.close_full), L(self.close_rest))
            + L(self.reward_head) + max(rew_max, L(self.reward_zero)) + L(self.newline)
            + max(L(self.turn_head), L(self.turn_head_first)) + int_max + L(self.state_head)
            + self.obs_bound(max_obs_pieces * env_max, max_obs_tokens) + L(self.newline) + L(self.warning)
            + L(self.you_have) + int_max + L(self.tail) + L(self.gen_prompt) + L(self.forced)
        )

    @staticmethod
    def obs_bound(safe: int, requested: int | None) -> int:
        return safe if requested is None else min(safe, int(requested))

    # ---- device -------------------------------------------------------------------------
    def reward_id(self, reward, stepped):
        """Table row printing a turn's env reward (``"0"`` when the env was not stepped)."""
        scale = 10.0**self.reward_decimals
        k = jnp.clip(jnp.round(reward * scale).astype(jnp.int32), -self.reward_kmax, self.reward_kmax)
        return jnp.where(stepped, self.reward_offset + self.reward_kmax + k, self.reward_zero).astype(jnp.int32)

    def int_id(self, i):
        return (self.int_offset + jnp.clip(i, 0, self.max_int)).astype(jnp.int32)

    def turn_pieces(self, t, obs_pieces, obs_n, *, eot_emitted, reward_id, warning, actions_left):
        """Piece ids ``[M]`` and validity ``[M]`` of one row's chunk for turn ``t`` (0-based).

        ``obs_pieces`` int32 ``[max_obs_pieces]`` / ``obs_n`` from ``env.render_pieces``;
        ``eot_emitted``: the previous reply ended with the end-of-turn token.
        """
        later = t > 0
        c = lambda x: jnp.asarray(x, jnp.int32)
        head = [
            (jnp.where(eot_emitted, self.close_rest, self.close_full), later),
            (c(self.reward_head), later),
            (reward_id, later),
            (c(self.newline), later),
            (jnp.where(later, self.turn_head, self.turn_head_first), True),
            (self.int_id(t + 1), True),
            (c(self.state_head), True),
        ]
        tail = [
            (c(self.newline), True),
            (c(self.warning), warning),
            (c(self.you_have), True),
            (self.int_id(actions_left), True),
            (c(self.tail), True),
            (c(self.gen_prompt), True),
            (c(self.forced), True),
        ]
        ids = jnp.concatenate(
            [jnp.stack([jnp.asarray(i, jnp.int32) for i, _ in head]),
             self.env_offset + obs_pieces.astype(jnp.int32),
             jnp.stack([jnp.asarray(i, jnp.int32) for i, _ in tail])]
        )
        valid = jnp.concatenate(
            [jnp.stack([jnp.asarray(v, bool) for _, v in head]),
             jnp.arange(obs_pieces.shape[0]) < obs_n,
             jnp.stack([jnp.asarray(v, bool) for _, v in tail])]
        )
        return ids, valid

    def chunk(self, ids, valid):
        """``(tokens [chunk_len], n, src [chunk_len])`` of a piece list (one row)."""
        return concat_pieces(self.table, self.lengths, ids, valid, self.chunk_len, self.pad_id)

    # ---- host reference -----------------------------------------------------------------
    def user_text(self, t: int, state_text: str, actions_left: int, warning: bool, prev_reward) -> str:
        """Host text of turn ``t``'s user message (``prev_reward``: float, or None when not stepped)."""
        text = prompts.turn_block(
            t + 1, state_text, actions_left, warning=warning, enable_think=self.enable_think, max_words=self.max_words
        )
        if t > 0:
            text = prompts.reward_message(prev_reward, self.reward_decimals, self.reward_limit) + text
        return text
