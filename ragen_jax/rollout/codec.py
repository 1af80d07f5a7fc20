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
            encoded = self.tokenizer(list(e for e in entries if isinstance(e, str)), add_special_tokens=False)["input_ids"]
            it = iter(encoded)
            for e in entries:
                if isinstance(e, str):
                    ids = list(next(it)) if e else []
                    if decode(self.tokenizer, ids) != e:
                        raise ValueError(
                            f"the tokenizer does not round-trip {e!r} (table {name!r}); the rollout needs a "
                            "lossless tokenizer (byte-level BPE or byte-fallback)"
                        )
                    self.rows.append(ids)
                    self.texts.append(e)
                else:
                    ids, text = self._row(e)
                    self.rows.append(ids)
                    self.texts.append(text)
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
