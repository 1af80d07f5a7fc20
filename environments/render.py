"""Text renders as piece sequences: the device side of every grid environment's observation text.

The language model reads the state as text, but the rollout runs under ``jit``, where strings do
not exist. So each environment owns a static *piece table* (``tuple[str]``, built once on the host)
and renders on device to a left-packed sequence of piece ids ``(pieces int32 [max_pieces], n)``.
The rollout's codec tokenises every table entry once, after which turning an observation into
tokens is a gather plus a cumsum/scatter — no Python per turn.

Conventions shared by all environments:
  * piece id 0 is the empty string ``""`` (``PAD``), so padding decodes to nothing;
  * a grid is one symbol piece per cell with a ``"\\n"`` piece between rows (no trailing newline),
    which is exactly ``"\\n".join("".join(row) for row in rows)``;
  * a coordinate line such as ``Targets: (1, 1), (2, 3)`` is a header piece, one piece per
    coordinate string ``"(r, c)"`` (all of them live in the table, so the device never builds
    digits) and ``", "`` separators. A line whose mask is empty disappears entirely, including
    its line break; the break is therefore emitted *before* the line (every coordinate render
    starts with an always-present ``Board size: ...`` line, in Sokoban and FrozenLake alike).

Every device function is pure, works on one example (``vmap`` for batches) and has static output
shapes. Sections are ``(pieces, keep)`` pairs (``keep`` bool, same shape) until one final
``compact``; ``concat`` joins already-compacted ``(pieces, n)`` sections.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import chex
import jax.numpy as jnp
import numpy as np

PAD = 0  # id of the empty string in every piece table


class PieceTable:
    """Static, de-duplicated string table; id 0 is always ``""``.

    >>> t = PieceTable(["#", "_", "\\n", "#"])
    >>> t.pieces, t.id("_"), list(t.ids(["#", "\\n"]))
    (('', '#', '_', '\\n'), 2, [1, 3])
    """

    def __init__(self, strings: Iterable[str] = ()):
        self._index: dict[str, int] = {"": PAD}
        self._pieces: list[str] = [""]
        self.extend(strings)

    def extend(self, strings: Iterable[str]) -> "PieceTable":
        for s in strings:
            if not isinstance(s, str):
                raise TypeError(f"piece table entries must be str, got {type(s).__name__}: {s!r}")
            if s not in self._index:
                self._index[s] = len(self._pieces)
                self._pieces.append(s)
        return self

    @property
    def pieces(self) -> tuple[str, ...]:
        return tuple(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def __contains__(self, s: str) -> bool:
        return s in self._index

    def id(self, s: str) -> int:
        if s not in self._index:
            raise KeyError(f"{s!r} is not in the piece table; add it when the table is built")
        return self._index[s]

    def ids(self, strings: Iterable[str]) -> np.ndarray:
        """int32 ids of ``strings``, keeping their shape (nested lists become an array)."""
        arr = np.asarray(strings, dtype=object)
        return np.vectorize(self.id, otypes=[np.int32])(arr) if arr.size else arr.astype(np.int32)


def coord_string(r: int, c: int) -> str:
    """The original's coordinate spelling: ``(r, c)`` (zero-indexed, row first)."""
    return f"({r}, {c})"


def coord_strings(rows: int, cols: int) -> list[str]:
    """Every coordinate string of a ``rows x cols`` board, row-major."""
    return [coord_string(r, c) for r in range(rows) for c in range(cols)]


def coord_ids(table: PieceTable, rows: int, cols: int) -> np.ndarray:
    """int32 [rows, cols]: the piece id of ``(r, c)`` at each cell (strings must be in ``table``)."""
    return table.ids(coord_strings(rows, cols)).reshape(rows, cols)


def join(pieces_table: Sequence[str], pieces, n=None) -> str:
    """Host decode: the text of ``pieces[:n]`` (padding decodes to ``""`` anyway)."""
    pieces = np.asarray(pieces).reshape(-1)
    n = len(pieces) if n is None else int(n)
    return "".join(pieces_table[int(p)] for p in pieces[:n])


# --- device ---------------------------------------------------------------------------------


def grid_pieces(codes: chex.Array, symbol_ids: chex.Array, newline_id: int) -> chex.Array:
    """Symbol grid -> pieces, one per cell, a newline piece between rows, none at the end.

    Args:
      codes: int [rows, cols] render codes.
      symbol_ids: int32 [num_codes] piece id of each code's symbol.
      newline_id: piece id of ``"\\n"``.
    Returns:
      int32 [rows * (cols + 1) - 1] pieces, all of them valid.
    """
    rows, _ = codes.shape
    cells = jnp.asarray(symbol_ids, jnp.int32)[codes]
    newline_col = jnp.full((rows, 1), newline_id, jnp.int32)
    return jnp.concatenate([cells, newline_col], axis=1).reshape(-1)[:-1]


def grid_section(codes, symbol_ids, newline_id) -> tuple[chex.Array, chex.Array]:
    """``grid_pieces`` as a ``(pieces, keep)`` section (every piece kept)."""
    pieces = grid_pieces(codes, symbol_ids, newline_id)
    return pieces, jnp.ones(pieces.shape, bool)


def coord_line(
    mask: chex.Array,
    coord_ids_grid: chex.Array,
    header_id: int,
    sep_id: int,
    line_break_id: int | None = None,
) -> tuple[chex.Array, chex.Array]:
    """A coordinate list line, e.g. ``"\\nTargets: (1, 1), (2, 3)"``, as a ``(pieces, keep)`` section.

    Cells are listed in row-major order (``np.argwhere`` order). An empty mask keeps nothing —
    the header and the line break vanish too, as in the original, which only writes non-empty
    lines.

    Args:
      mask: bool [rows, cols], the cells to list.
      coord_ids_grid: int32 [rows, cols] piece ids of ``"(r, c)"`` (see ``coord_ids``).
      header_id: piece id of the header, e.g. ``"Targets: "``.
      sep_id: piece id of ``", "``.
      line_break_id: piece id of ``"\\n"`` put before the header, or None for no line break.
    Returns:
      pieces int32 [prefix + 2 * rows * cols], keep bool of the same shape; ``prefix`` is 2 with a
      line break else 1.
    """
    flat = mask.reshape(-1)
    coords = jnp.asarray(coord_ids_grid, jnp.int32).reshape(-1)
    any_cell = flat.any()
    # Each cell contributes (", ", "(r, c)"); the separator is dropped for the first listed cell.
    first = jnp.cumsum(flat) == 1
    sep_keep = flat & ~first
    cell_pieces = jnp.stack([jnp.full_like(coords, sep_id), coords], axis=1).reshape(-1)
    cell_keep = jnp.stack([sep_keep, flat], axis=1).reshape(-1)
    head = [header_id] if line_break_id is None else [line_break_id, header_id]
    head_pieces = jnp.asarray(head, jnp.int32)
    head_keep = jnp.full((len(head),), any_cell)
    return jnp.concatenate([head_pieces, cell_pieces]), jnp.concatenate([head_keep, cell_keep])


def digit_ids(table: PieceTable) -> np.ndarray:
    """int32 [10]: the piece ids of ``"0"`` .. ``"9"`` (added to ``table`` when missing)."""
    table.extend(str(d) for d in range(10))
    return table.ids([str(d) for d in range(10)])


def int_section(value: chex.Array, digits: chex.Array, max_digits: int = 10) -> tuple[chex.Array, chex.Array]:
    """A non-negative int as decimal digit pieces (``str(value)``), a ``(pieces, keep)`` section.

    value: int32 [] (negative values print as ``0``); digits: int32 [10] from ``digit_ids``;
    ``max_digits`` must cover the largest value (int32 needs 10).
    """
    v = jnp.maximum(jnp.asarray(value, jnp.int32), 0)
    # Powers of ten as int64 would not exist without x64; 10**9 is the largest that fits int32.
    powers = jnp.asarray([10 ** k for k in range(max_digits - 1, -1, -1)], jnp.int32)
    each = (v // powers) % 10
    n = jnp.maximum(jnp.sum(v >= powers), 1)
    keep = jnp.arange(max_digits) >= max_digits - n
    return jnp.asarray(digits, jnp.int32)[each], keep


def const_section(ids: Sequence[int]) -> tuple[chex.Array, chex.Array]:
    """Fixed pieces that are always present (headers, the board-size line, ...)."""
    pieces = jnp.asarray(list(ids), jnp.int32).reshape(-1)
    return pieces, jnp.ones(pieces.shape, bool)


def cat_sections(*sections: tuple[chex.Array, chex.Array]) -> tuple[chex.Array, chex.Array]:
    """Concatenate ``(pieces, keep)`` sections (static total length)."""
    return (
        jnp.concatenate([p for p, _ in sections]),
        jnp.concatenate([k for _, k in sections]),
    )


def compact(pieces: chex.Array, keep: chex.Array, size: int | None = None) -> tuple[chex.Array, chex.Array]:
    """Left-pack the kept pieces: ``(pieces int32 [size], n int32)``, padding is ``PAD``.

    A cumsum gives each kept piece its output slot; a scatter writes it there (dropped pieces are
    sent out of range). Fixed cost, no sort, vmap-able.
    """
    size = pieces.shape[0] if size is None else size
    slot = jnp.cumsum(keep) - 1
    target = jnp.where(keep, slot, size)
    out = jnp.full((size,), PAD, jnp.int32).at[target].set(pieces.astype(jnp.int32), mode="drop")
    return out, jnp.sum(keep).astype(jnp.int32)


def concat(*sections: tuple[chex.Array, chex.Array]) -> tuple[chex.Array, chex.Array]:
    """Join left-packed ``(pieces [max_i], n_i)`` sections into one ``(pieces [sum max_i], n)``."""
    keeps = [jnp.arange(p.shape[0]) < n for p, n in sections]
    return compact(jnp.concatenate([p for p, _ in sections]), jnp.concatenate(keeps))


__all__ = [
    "PAD",
    "PieceTable",
    "cat_sections",
    "digit_ids",
    "int_section",
    "compact",
    "concat",
    "const_section",
    "coord_ids",
    "coord_line",
    "coord_string",
    "coord_strings",
    "grid_pieces",
    "grid_section",
    "join",
]
