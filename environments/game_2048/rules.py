"""2048's sliding rule on the host: the reference the device tables are built from and the
expert searches with."""
from __future__ import annotations

SIZE = 4  # the board's side


def merge_line(line) -> tuple[list[int], int]:
    """Slide one line of exponents towards index 0 and merge equal neighbours once (host)."""
    tiles = [int(v) for v in line if v]
    out, gained, i = [], 0, 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] + 1)
            gained += 2 ** (tiles[i] + 1)
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (SIZE - len(out)), gained
