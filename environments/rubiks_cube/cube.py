"""The 2×2 cube's geometry: sticker layout, colours and the permutation of every move (NumPy), shared
by the environment (its device tables) and the expert (its search). See ``env``'s docstring for the
layout and the one deliberate difference from the original's back turn."""
from __future__ import annotations

import numpy as np

ACTION_NAMES = ("U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'")
COLOURS = ("W", "O", "G", "R", "B", "Y")
FACE_LABELS = ("Up (U):    ", "Left (L):  ", "Front (F): ", "Right (R): ", "Back (B):  ", "Down (D):  ")
SOLVED = np.repeat(np.arange(6), 4).astype(np.int32)

# Clockwise quarter turns as cycles of sticker indices: (a, b, c, d) means the sticker at b moves to
# a, c to b, d to c and a to d (``new[a] = old[b]``, ...). Each turn rotates its own face and cycles
# four pairs of side stickers.
_FACE = lambda f: [(4 * f, 4 * f + 2, 4 * f + 3, 4 * f + 1)]  # noqa: E731
_TURNS = {
    "U": _FACE(0) + [(8, 12, 16, 4), (9, 13, 17, 5)],
    "D": _FACE(5) + [(10, 6, 18, 14), (11, 7, 19, 15)],
    "L": _FACE(1) + [(0, 19, 20, 8), (2, 17, 22, 10)],
    "R": _FACE(3) + [(1, 9, 21, 18), (3, 11, 23, 16)],
    "F": _FACE(2) + [(2, 7, 21, 12), (3, 5, 20, 14)],
    "B": _FACE(4) + [(0, 13, 23, 6), (1, 15, 22, 4)],
}
# The original's back turn (``_move_B``): its right-face pair lands reversed on the bottom face.
_RAGEN_B = _FACE(4) + [(0, 13, 22, 6), (1, 15, 23, 4)]


def _perm(cycles) -> np.ndarray:
    """``new = old[perm]`` for a list of 4-cycles ``new[a] = old[b], new[b] = old[c], ...``."""
    perm = np.arange(24)
    for a, b, c, d in cycles:
        perm[[a, b, c, d]] = [b, c, d, a]
    return perm


def move_table(moves: str = "physical") -> np.ndarray:
    """int32 [12, 24]: ``new_state = state[table[action]]`` for every action (prime = three turns)."""
    if moves not in ("physical", "ragen"):
        raise ValueError(f"rubikscube: moves={moves!r}; choose 'physical' (true cube turns) or 'ragen' "
                         "(the original's back turn)")
    table = []
    for face in "UDLRFB":
        cycles = _RAGEN_B if (face == "B" and moves == "ragen") else _TURNS[face]
        p = _perm(cycles)
        table += [p, p[p[p]]]
    return np.stack(table).astype(np.int32)
