"""Sokoban's text: the piece table the device render indexes, and the host reference render.

RAGEN's three formats: ``grid`` (one symbol per cell, rows joined by newlines), ``coord`` (board
size, then the coordinates of targets, boxes, boxes on target, the player and the player on a
target) and ``grid_coord`` (both, labelled). ``render_pieces`` (device, ids into ``piece_table``)
and ``render_text`` (host, NumPy, the original's strings) must agree exactly; the tests check it.
"""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from environments import render
from environments.sokoban.levels import BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET, TARGET

DEFAULT_GRID_LOOKUP = {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}
# The meaning of each code; a custom lookup without a vocab gets its legend from these.
CODE_MEANINGS = {
    0: "wall", 1: "empty", 2: "target", 3: "box on target", 4: "box", 5: "player", 6: "player on target",
}


def check_lookup(grid_lookup: Mapping[int, str] | None, grid_vocab: Mapping[str, str] | None):
    """``(code -> symbol, symbol -> meaning)`` with RAGEN's defaults; raises on an incomplete table."""
    lookup = dict(DEFAULT_GRID_LOOKUP if grid_lookup is None else grid_lookup)
    missing = sorted(set(range(7)) - {int(k) for k in lookup})
    if missing:
        raise ValueError(f"Sokoban: grid_lookup lacks codes {missing}; give a symbol for each code 0..6")
    if any(not isinstance(v, str) or not v for v in lookup.values()):
        raise ValueError("Sokoban: grid_lookup symbols must be non-empty strings")
    lookup = {int(k): v for k, v in lookup.items()}
    if grid_vocab is None:
        grid_vocab = {lookup[c]: CODE_MEANINGS[c] for c in range(7)}
    return lookup, dict(grid_vocab)


class SokobanRenderer:
    """The renders of one room shape and symbol table (formats checked by the env)."""

    def __init__(self, dim_room: tuple[int, int], grid_lookup: Mapping[int, str]):
        rows, cols = dim_room
        self.dim_room = (rows, cols)
        self.grid_lookup = dict(grid_lookup)
        symbols = [self.grid_lookup[c] for c in range(7)]
        self._board_size = f"Board size: {rows} rows x {cols} cols (zero-indexed)."
        self._headers = ["\nTargets: ", "\nBoxes: ", "\nBoxes on target: ", "\nPlayer: ", "\nPlayer on target: "]
        table = render.PieceTable(symbols + ["\n", ", ", self._board_size, "Coordinates: \n", "\nGrid Map: \n"])
        table.extend(self._headers)
        table.extend(render.coord_strings(rows, cols))
        self._table = table
        self._symbol_ids = table.ids(symbols)
        self._coord_ids = render.coord_ids(table, rows, cols)

    @property
    def piece_table(self) -> tuple[str, ...]:
        return self._table.pieces

    def max_pieces(self, fmt: str) -> int:
        rows, cols = self.dim_room
        grid = rows * (cols + 1) - 1
        coord = 1 + len(self._headers) * (1 + 2 * rows * cols)
        return {"grid": grid, "coord": coord, "grid_coord": 2 + coord + grid}[fmt]

    def render_pieces(self, state, fmt: str):
        """Device render -> ``(pieces int32 [max_pieces(fmt)], n int32)`` into ``piece_table``."""
        t = self._table
        grid = state.grid.astype(jnp.int32)
        sections = []
        if fmt in ("coord", "grid_coord"):
            if fmt == "grid_coord":
                sections.append(render.const_section([t.id("Coordinates: \n")]))
            sections.append(render.const_section([t.id(self._board_size)]))
            fixed = state.room_fixed
            masks = [
                fixed == TARGET,
                grid == BOX,
                grid == BOX_ON_TARGET,
                grid == PLAYER,
                grid == PLAYER_ON_TARGET,
            ]
            for header, mask in zip(self._headers, masks):
                sections.append(render.coord_line(mask, self._coord_ids, t.id(header), t.id(", ")))
            if fmt == "grid_coord":
                sections.append(render.const_section([t.id("\nGrid Map: \n")]))
        if fmt in ("grid", "grid_coord"):
            sections.append(render.grid_section(grid, self._symbol_ids, t.id("\n")))
        return render.compact(*render.cat_sections(*sections))

    def render_text(self, state, fmt: str) -> str:
        """Host render from NumPy arrays (RAGEN's ``_render_text``): the reference for the device path.

        Accepts a ``SokobanState`` (or any object with ``room_fixed`` and ``grid``); works from
        gym-sokoban's representation (``room_state`` with the player as 5) like the original.
        """
        fixed = np.asarray(state.room_fixed)
        room_state = np.asarray(state.grid).astype(np.int64)
        room_state[room_state == PLAYER_ON_TARGET] = PLAYER
        room = np.where((room_state == PLAYER) & (fixed == TARGET), PLAYER_ON_TARGET, room_state)
        grid_text = "\n".join("".join(self.grid_lookup.get(int(c), "?") for c in row) for row in room)
        if fmt == "grid":
            return grid_text
        rows, cols = fixed.shape
        lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
        entities = [
            ("Targets", fixed == TARGET),
            ("Boxes", room_state == BOX),
            ("Boxes on target", room_state == BOX_ON_TARGET),
            ("Player", (room_state == PLAYER) & (fixed != TARGET)),
            ("Player on target", (room_state == PLAYER) & (fixed == TARGET)),
        ]
        for label, mask in entities:
            cells = np.argwhere(mask)
            if len(cells):
                lines.append(f"{label}: " + ", ".join(f"({r}, {c})" for r, c in cells))
        coord = "\n".join(lines)
        if fmt == "coord":
            return coord
        return "Coordinates: \n" + coord + "\n" + "Grid Map: \n" + grid_text
