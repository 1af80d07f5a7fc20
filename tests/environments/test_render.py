"""Device piece renders against hand-written strings (worked examples of RAGEN's texts)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from environments import render

SOKO_SYMBOLS = ["#", "_", "O", "√", "X", "P", "S"]


def _table(rows, cols, extra=()):
    t = render.PieceTable(SOKO_SYMBOLS + ["\n", ", ", "\nTargets: ", "\nBoxes: ", "\nPlayer: ", "Holes: "])
    t.extend(render.coord_strings(rows, cols))
    t.extend(extra)
    return t


def test_piece_table_dedups_and_reserves_empty_string():
    t = render.PieceTable(["a", "b", "a"])
    assert t.pieces == ("", "a", "b")
    assert t.id("b") == 2 and render.PAD == 0
    np.testing.assert_array_equal(t.ids([["a", "b"], ["b", "a"]]), [[1, 2], [2, 1]])
    with pytest.raises(KeyError, match="not in the piece table"):
        t.id("zzz")
    with pytest.raises(TypeError):
        render.PieceTable([3])


def test_grid_pieces_spec_example():
    # RAGEN, CoordSokoban seed 10000 (codes: 0 wall, 1 floor, 2 target, 4 box, 5 player).
    codes = np.array(
        [[0, 0, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 4, 1, 0, 0, 0], [0, 1, 5, 1, 0, 0],
         [0, 0, 0, 0, 0, 0]]
    )
    t = _table(6, 6)
    pieces = render.grid_pieces(jnp.asarray(codes), t.ids(SOKO_SYMBOLS), t.id("\n"))
    assert pieces.shape == (6 * 7 - 1,)
    assert render.join(t.pieces, pieces) == "######\n#O####\n#__###\n#X_###\n#_P_##\n######"


def test_grid_pieces_multibyte_and_non_square():
    t = _table(2, 3)
    codes = jnp.array([[3, 6, 1], [0, 2, 4]])
    out = render.join(t.pieces, render.grid_pieces(codes, t.ids(SOKO_SYMBOLS), t.id("\n")))
    assert out == "√S_\n#OX"


def test_coord_line_lists_row_major_with_separators():
    t = _table(4, 5)
    mask = np.zeros((4, 5), bool)
    mask[3, 0] = mask[0, 4] = mask[1, 2] = True
    p, k = render.coord_line(jnp.asarray(mask), render.coord_ids(t, 4, 5), t.id("\nTargets: "), t.id(", "))
    out, n = render.compact(p, k)
    assert render.join(t.pieces, out, n) == "\nTargets: (0, 4), (1, 2), (3, 0)"
    # With a separate line-break piece and a header without it (FrozenLake-style "Holes: ").
    p, k = render.coord_line(
        jnp.asarray(mask), render.coord_ids(t, 4, 5), t.id("Holes: "), t.id(", "), line_break_id=t.id("\n")
    )
    out, n = render.compact(p, k)
    assert render.join(t.pieces, out, n) == "\nHoles: (0, 4), (1, 2), (3, 0)"
    assert p.shape == (2 + 2 * 20,)


def test_empty_coord_line_vanishes_with_its_line_break():
    t = _table(3, 3, extra=["Board size: 3 rows x 3 cols (zero-indexed)."])
    ids = render.coord_ids(t, 3, 3)
    boxes = np.zeros((3, 3), bool)
    player = np.zeros((3, 3), bool)
    player[2, 1] = True
    sections = [
        render.const_section([t.id("Board size: 3 rows x 3 cols (zero-indexed).")]),
        render.coord_line(jnp.asarray(boxes), ids, t.id("\nBoxes: "), t.id(", ")),
        render.coord_line(jnp.asarray(player), ids, t.id("\nPlayer: "), t.id(", ")),
    ]
    out, n = render.compact(*render.cat_sections(*sections))
    assert render.join(t.pieces, out, n) == "Board size: 3 rows x 3 cols (zero-indexed).\nPlayer: (2, 1)"
    # Padding beyond n decodes to "" as well.
    assert render.join(t.pieces, out) == render.join(t.pieces, out, n)


def test_compact_and_concat_match_numpy_under_vmap():
    rng = np.random.default_rng(0)  # seeded: reproducible
    pieces = rng.integers(1, 50, size=(16, 30)).astype(np.int32)
    keep = rng.random((16, 30)) < 0.4
    out, n = jax.vmap(render.compact)(jnp.asarray(pieces), jnp.asarray(keep))
    for b in range(16):
        expect = pieces[b][keep[b]]
        assert int(n[b]) == len(expect)
        np.testing.assert_array_equal(np.asarray(out[b, : n[b]]), expect)
        assert (np.asarray(out[b, n[b]:]) == render.PAD).all()
    # concat of two packed sections == numpy concatenation of their valid prefixes.
    a, na = out[0], n[0]
    b, nb = out[1], n[1]
    cat, ncat = render.concat((a, na), (b, nb))
    np.testing.assert_array_equal(np.asarray(cat[:ncat]), np.concatenate([pieces[0][keep[0]], pieces[1][keep[1]]]))
    assert cat.shape == (60,)


def test_frozen_lake_style_coord_render_spec_example():
    # RAGEN, CoordFrozenLake seed 123: built only from the generic pieces.
    headers = ["Board size: 4 rows x 4 cols (zero-indexed).", "\nStart: ", "\nGoal: ", "\nPlayer: ",
               "\nPlayer on goal: ", "\nPlayer in hole: ", "\nHoles: ", ", "]
    t = render.PieceTable(headers + render.coord_strings(4, 4))
    ids = render.coord_ids(t, 4, 4)

    def mask_at(*cells):
        m = np.zeros((4, 4), bool)
        for r, c in cells:
            m[r, c] = True
        return jnp.asarray(m)

    empty = mask_at()
    sections = [
        render.const_section([t.id(headers[0])]),
        render.coord_line(mask_at((1, 3)), ids, t.id("\nStart: "), t.id(", ")),
        render.coord_line(mask_at((2, 0)), ids, t.id("\nGoal: "), t.id(", ")),
        render.coord_line(mask_at((1, 3)), ids, t.id("\nPlayer: "), t.id(", ")),
        render.coord_line(empty, ids, t.id("\nPlayer on goal: "), t.id(", ")),
        render.coord_line(empty, ids, t.id("\nPlayer in hole: "), t.id(", ")),
        render.coord_line(mask_at((1, 2)), ids, t.id("\nHoles: "), t.id(", ")),
    ]
    out, n = jax.jit(lambda: render.compact(*render.cat_sections(*sections)))()
    assert render.join(t.pieces, out, n) == (
        "Board size: 4 rows x 4 cols (zero-indexed).\nStart: (1, 3)\nGoal: (2, 0)\nPlayer: (1, 3)\nHoles: (1, 2)"
    )
