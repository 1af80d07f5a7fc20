"""Sokoban level generation inside jit: RAGEN's ``generate_room`` at a fixed cost per level.

Level generation follows RAGEN's ``generate_room`` at a fixed cost per level (no data-dependent
loops, so it vmaps):
  1. topology — the random walk of ``int(1.7 * (rows + cols))`` steps that changes direction with
     probability 0.35 and stamps one of five 3x3 floor masks per step; the border is wall;
  2. placement — player and targets uniformly on distinct floor cells; every box starts on its
     target;
  3. reverse play — from the solved room the player walks and *pulls* (RAGEN's reverse moves: a box
     directly behind the player is always dragged along). RAGEN keeps the reachable state with the
     best score ``box_swaps * box displacement`` (0 while a box or the player covers a target).
       * one box: exact breadth-first search over all (box cell, player cell) pairs, stored as
         bitsets of player cells per box cell and expanded by the four reverse moves for a fixed
         number of sweeps; the farthest box (ties at random) with a random player cell is chosen.
         Every reached pair is truly reachable, so a level is solvable even if the sweep budget
         were too small to reach the farthest one.
       * several boxes: ``num_walks`` random reverse walks of ``walk_length`` moves (every state on
         a walk is solvable by replaying the walk forwards), keeping the best-scoring state;
  4. RAGEN's random player jitter (move with probability 0.8 if the displacement is 1 else 0.5, up
     to 3 steps onto free cells, continuing with probability 0.5, never revisiting).
RAGEN retries a room whose best score is 0. Here ``num_candidates`` rooms are drawn at once and
the first valid one is kept (the first success of an i.i.d. sequence has the retry loop's
distribution). With one box a room is valid iff the box can be pulled off its target at all, which
a cheap flood fill of the player's cells decides, so only the kept room pays for the full search.
If every candidate fails — for 6x6 with one box about 0.13 ** 8 ≈ 1e-7 per level — a fixed,
solvable fallback room is used (open interior; box ``i`` one push right of its target in interior
row ``i``, the player right of the first box; transposed for tall narrow rooms). It is the only
departure from RAGEN's level distribution.

Cheap auto-reset. Under ``vmap`` a reset computed inside ``step`` and then selected costs every
lane a full level generation on every step. ``step`` therefore routes the reset through a
``jax.custom_batching.custom_vmap`` function: unbatched it is a ``lax.cond`` on ``done``; batched,
its rule gathers the lanes that finished and generates levels for them only, in chunks, in loops
whose trip counts follow the number of finished lanes (zero when none finished). Each lane's
new level depends only on that lane's key, so batched and unbatched steps agree exactly.

Render codes (``Level.grid``): 0 wall, 1 floor, 2 empty target, 3 box on target, 4 box, 5 player,
6 player on target; ``room_fixed`` holds 0 wall, 1 floor, 2 target as in gym-sokoban.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching

from environments.hashing import lowbias32

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
# Action index -> (d_row, d_col); gym-sokoban's CHANGE_COORDINATES for push actions 1..4.
MOVES = np.array([[-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.int32)

# RAGEN / gym-sokoban constants.
P_CHANGE_DIRECTION = 0.35
# The five 3x3 floor stamps of the topology walk, and its direction list.
TOPOLOGY_MASKS = np.array(
    [
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    ],
    dtype=bool,
)
TOPOLOGY_DIRECTIONS = np.array([[1, 0], [0, 1], [-1, 0], [0, -1]], dtype=np.int32)
# Each mask row as a 3-bit word (bit k = column offset k - 1), for stamping rows of bits.
_MASK_ROW_BITS = (TOPOLOGY_MASKS * (1 << np.arange(3))).sum(-1).astype(np.uint32)  # [5, 3]


@chex.dataclass(frozen=True)
class Level:
    """One generated room. Shapes ``[rows, cols]``."""

    room_fixed: chex.Array  # int8 0 wall, 1 floor, 2 target
    grid: chex.Array        # int8 render codes 0..6 (see the module docstring)
    player: chex.Array      # int32 [2] (row, col)


# =============================================================================================
# Small array helpers
# =============================================================================================


def _shift2d(x: chex.Array, dr: int, dc: int) -> chex.Array:
    """``out[r, c] = x[r - dr, c - dc]`` with zero fill (static shift)."""
    rows, cols = x.shape
    xp = jnp.pad(x, ((max(dr, 0), max(-dr, 0)), (max(dc, 0), max(-dc, 0))))
    r0, c0 = max(-dr, 0), max(-dc, 0)
    return xp[r0 : r0 + rows, c0 : c0 + cols]


def _uniform(bits: chex.Array) -> chex.Array:
    """uint32 random bits -> float32 uniform in [0, 1)."""
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _pick(bits: chex.Array, mask: chex.Array) -> chex.Array:
    """Uniform index among the True entries of ``mask`` (flat), using independent random ``bits``
    of the same shape (the largest key wins, as in Gumbel-max); index 0 if none is True."""
    return jnp.argmax(jnp.where(mask, bits | 1, 0).reshape(-1))


def _pick_nth(bits: chex.Array, mask: chex.Array) -> chex.Array:
    """Uniform index among the True entries of a short ``mask`` from one uint32 of ``bits``."""
    n = jnp.sum(mask)
    r = (bits % jnp.maximum(n, 1).astype(jnp.uint32)).astype(jnp.int32)
    return jnp.argmax(mask & (jnp.cumsum(mask) - 1 == r))


def _counter_table(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return lowbias32(np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B9) + np.uint32(0x6A09E667))


def random_bits(seed: chex.Array, shape) -> chex.Array:
    """uint32 random words from one uint32 ``seed``: ``hash(seed ^ hash(counter))``.

    Level generation draws many small random numbers per level; one threefry call per level for
    the seeds plus this 7-op hash per word costs a fraction of a threefry call per word.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape))
    return lowbias32(seed ^ jnp.asarray(_counter_table(n))).reshape(shape)


def _or_reduce(x: chex.Array, axes: tuple[int, ...]) -> chex.Array:
    return jax.lax.reduce(x, np.uint32(0), jax.lax.bitwise_or, axes)


# =============================================================================================
# Level generation (single level; vmap for batches)
# =============================================================================================


@functools.lru_cache(maxsize=None)
def _stamp_table(rows: int, cols: int) -> np.ndarray:
    """uint32 [5, rows, cols, rows]: row words of mask m stamped centred on (r, c) (bit j = column j)."""
    table = np.zeros((len(TOPOLOGY_MASKS), rows, cols, rows), np.uint32)
    for m, mask in enumerate(TOPOLOGY_MASKS):
        for r in range(1, rows - 1):
            for c in range(1, cols - 1):
                for i, j in np.argwhere(mask):
                    table[m, r, c, r - 1 + i] |= np.uint32(1) << np.uint32(c - 1 + j)
    return table


def topology(seed: chex.Array, rows: int, cols: int, num_steps: int) -> chex.Array:
    """RAGEN's random-walk room topology from a uint32 ``seed``. Returns bool [rows, cols] floor."""
    t = num_steps
    bits = random_bits(seed, 3 * t + 3)
    change = _uniform(bits[:t]) < P_CHANGE_DIRECTION
    new_dir = (bits[t : 2 * t] % 4).astype(jnp.int32)
    mask_idx = (bits[2 * t : 3 * t] % len(TOPOLOGY_MASKS)).astype(jnp.int32)
    # Start anywhere in [1, dim - 1] (inclusive, like random.randint); the first step clamps it.
    r = (1 + bits[3 * t] % (rows - 1)).astype(jnp.int32)
    c = (1 + bits[3 * t + 1] % (cols - 1)).astype(jnp.int32)
    d = (bits[3 * t + 2] % 4).astype(jnp.int32)
    # The walk is short and its state two scalars: unrolled, with the direction table
    # TOPOLOGY_DIRECTIONS = (1,0), (0,1), (-1,0), (0,-1) as arithmetic, it fuses into a few batched
    # kernels (a lax.scan pays a loop trip per step, a table lookup a gather).
    path = []
    for i in range(t):
        d = jnp.where(change[i], new_dir[i], d)
        r = jnp.clip(r + (d == 0).astype(jnp.int32) - (d == 2).astype(jnp.int32), 1, rows - 2)
        c = jnp.clip(c + (d == 1).astype(jnp.int32) - (d == 3).astype(jnp.int32), 1, cols - 2)
        path.append(r * cols + c)
    stamps = jnp.asarray(_stamp_table(rows, cols)).reshape(len(TOPOLOGY_MASKS) * rows * cols, rows)
    words = stamps[mask_idx * (rows * cols) + jnp.stack(path)]  # [t, rows]
    row_words = words[0]
    for i in range(1, t):
        row_words = row_words | words[i]
    floor = ((row_words[:, None] >> jnp.arange(cols, dtype=jnp.uint32)) & 1).astype(bool)
    interior = np.zeros((rows, cols), bool)
    interior[1:-1, 1:-1] = True
    return floor & jnp.asarray(interior)  # the outer border is wall, as in the original


def place(seed: chex.Array, floor: chex.Array, num_boxes: int) -> tuple[chex.Array, chex.Array, chex.Array]:
    """Player then targets, uniformly on distinct floor cells (sequential draws without replacement).

    Returns ``(player int32 [2], targets int32 [num_boxes, 2], ok bool)``; ``ok`` is RAGEN's
    ``#floor > num_boxes + 1`` requirement.
    """
    rows, cols = floor.shape
    bits = random_bits(seed, rows * cols)
    avail = floor.reshape(-1)
    cells = []
    for _ in range(num_boxes + 1):
        idx = _pick(bits, avail)
        cells.append(idx)
        avail = avail & (jnp.arange(rows * cols) != idx)
    idx = jnp.stack(cells)
    cells = jnp.stack([idx // cols, idx % cols], axis=-1).astype(jnp.int32)
    ok = jnp.sum(floor) > num_boxes + 1
    return cells[0], cells[1:], ok


class _OneBoxSearch:
    """Exact reverse-play BFS for one box over (box cell, player cell) pairs, as bitsets.

    Only interior cells are represented (the border is wall). ``reach[b]`` holds the player cells
    reachable with the box on interior cell ``b`` (flat index): one uint32 word for the whole
    interior when it has <= 32 cells (bit ``i * w + j``), else one word per interior row (bit
    ``j``). A sweep applies the four reverse moves in turn, each a few word operations on the
    ``[boxes, words]`` array.
    """

    def __init__(self, rows: int, cols: int):
        h, w = rows - 2, cols - 2
        self.h, self.w = h, w
        self.packed = h * w <= 32
        self.nw = 1 if self.packed else h
        nb = h * w
        bi, bj = np.divmod(np.arange(nb), w)
        self.bi, self.bj = bi, bj

        def words_of(i, j):
            inside = (i >= 0) & (i < h) & (j >= 0) & (j < w)
            out = np.zeros((len(i), self.nw), np.uint32)
            k = np.arange(len(i))[inside]
            if self.packed:
                out[k, 0] = np.uint32(1) << (i * w + j)[inside].astype(np.uint32)
            else:
                out[k, i[inside]] = np.uint32(1) << j[inside].astype(np.uint32)
            return out, inside

        # at[d][b]: the word(s) of cell b + MOVES[d]; d = -1 is the cell b itself.
        self.at = {-1: words_of(bi, bj)[0]}
        self.two_ahead = {}  # (flat index of b + 2 MOVES[d], inside)
        for d in range(4):
            dr, dc = (int(v) for v in MOVES[d])
            self.at[d] = words_of(bi + dr, bj + dc)[0]
            ti, tj = bi + 2 * dr, bj + 2 * dc
            inside = (ti >= 0) & (ti < h) & (tj >= 0) & (tj < w)
            self.two_ahead[d] = (np.where(inside, ti * w + tj, 0), inside)
        if self.packed:
            col = np.tile(np.arange(w), h)
            weights = np.uint32(1) << np.arange(nb, dtype=np.uint32)
            self.not_first_col = np.uint32(weights[col != 0].sum())
            self.not_last_col = np.uint32(weights[col != w - 1].sum())

    def shift(self, x: chex.Array, dr: int, dc: int) -> chex.Array:
        """Move every player bit by (dr, dc); bits leaving the interior are dropped."""
        if self.packed:
            s = dr * self.w + dc
            x = x << s if s > 0 else x >> (-s)
            if dc == 1:  # wrapped from the last column of the previous row
                x = x & self.not_first_col
            elif dc == -1:
                x = x & self.not_last_col
            return x
        if dr:
            zeros = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
            x = jnp.concatenate([zeros, x[..., :-1]], -1) if dr > 0 else jnp.concatenate([x[..., 1:], zeros], -1)
        if dc > 0:
            x = x << 1
        elif dc < 0:
            x = x >> 1
        return x

    def to_words(self, cells: chex.Array) -> chex.Array:
        """bool [h, w] -> uint32 [nw]."""
        if self.packed:
            weights = jnp.uint32(1) << jnp.arange(self.h * self.w, dtype=jnp.uint32)
            return jnp.sum(jnp.where(cells.reshape(-1), weights, jnp.uint32(0)), dtype=jnp.uint32)[None]
        weights = jnp.uint32(1) << jnp.arange(self.w, dtype=jnp.uint32)
        return jnp.sum(jnp.where(cells, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)

    def to_cells(self, words: chex.Array) -> chex.Array:
        """uint32 [..., nw] -> bool [..., h * w]."""
        if self.packed:
            bits = words[..., 0, None] >> jnp.arange(self.h * self.w, dtype=jnp.uint32)
        else:
            bits = (words[..., None] >> jnp.arange(self.w, dtype=jnp.uint32)).reshape(words.shape[:-1] + (-1,))
        return (bits & 1).astype(bool)

    def flood(self, floor: chex.Array, target: chex.Array, player: chex.Array, iters: int):
        """Player cells reachable in the solved room (box on ``target``) and whether a pull is possible.

        Returns ``(cells uint32 [nw], valid bool)``; ``valid`` iff some first pull exists, i.e. iff
        a reverse state with neither box nor player on the target exists (RAGEN's score > 0).
        """
        inner = floor[1:-1, 1:-1]
        b0 = (target[0] - 1) * self.w + (target[1] - 1)
        free = self.to_words(inner) & ~jnp.asarray(self.at[-1])[b0]
        start = jnp.asarray(self.at[-1])[(player[0] - 1) * self.w + (player[1] - 1)]

        def body(_, cells):
            for d in range(4):
                dr, dc = (int(v) for v in MOVES[d])
                cells = cells | (self.shift(cells, dr, dc) & free)
            return cells

        cells = jax.lax.fori_loop(0, iters, body, start)
        flat = inner.reshape(-1)
        valid = jnp.zeros((), bool)
        for d in range(4):
            idx, inside = self.two_ahead[d]
            beside = jnp.any((cells & jnp.asarray(self.at[d])[b0]) != 0)
            valid = valid | (beside & flat[jnp.asarray(idx)[b0]] & jnp.asarray(inside)[b0])
        return cells, valid

    def search(self, floor: chex.Array, target: chex.Array, cells: chex.Array, sweeps: int) -> chex.Array:
        """Reachable (box, player) pairs from the solved room -> uint32 [boxes, nw]."""
        b0 = (target[0] - 1) * self.w + (target[1] - 1)
        nb = self.h * self.w
        reach = jnp.zeros((nb, self.nw), jnp.uint32).at[b0].set(cells)
        free = self.to_words(floor[1:-1, 1:-1])[None, :] & ~jnp.asarray(self.at[-1])  # floor but the box
        two_free = self._two_free(floor)

        def sweep(_, reach):
            for d in range(4):
                dr, dc = (int(v) for v in MOVES[d])
                ahead = jnp.asarray(self.at[d])  # the cell beside the box on side d
                # A player not on side d moves freely; one on side d steps away and drags the box.
                moved = self.shift(reach & ~ahead, dr, dc) & free
                pull = jnp.any((reach & ahead) != 0, axis=-1) & two_free[d]
                pulled_to = _shift2d(pull.reshape(self.h, self.w), dr, dc).reshape(-1)
                reach = reach | moved | jnp.where(pulled_to[:, None], ahead, jnp.uint32(0))
            return reach

        return jax.lax.fori_loop(0, sweeps, sweep, reach)

    def choose(self, seed: chex.Array, reach: chex.Array, floor: chex.Array, target: chex.Array):
        """The reverse state RAGEN's search keeps: the farthest box, right after the pull that put it there.

        RAGEN records a state when its score first beats the best so far; since only pulls change
        the displacement, that is the state just after a pull: the box at ``b``, the player one
        cell beyond it in the pull direction. Among those with the farthest box one is chosen at
        random (the DFS order of the original is arbitrary as well). If every such state has the
        player on the target, any reachable player cell with that box is taken instead.

        Returns ``(box [2], player [2], displacement int32)`` in full-grid coordinates;
        displacement 0 means no valid reverse state.
        """
        nb = self.h * self.w
        bits = random_bits(seed, (3, 4 * nb))
        t = target - 1
        b0 = t[0] * self.w + t[1]
        target_word = jnp.asarray(self.at[-1])[b0][None, :]
        # RAGEN scores a state 0 while the target is covered, by the box or by the player.
        uncovered = reach & ~target_word
        has = jnp.any(uncovered != 0, axis=-1)
        dist = jnp.abs(jnp.asarray(self.bi) - t[0]) + jnp.abs(jnp.asarray(self.bj) - t[1])
        score = jnp.where(has, dist, 0)
        best = jnp.max(score)
        at_best = (score == best) & has
        two_free = self._two_free(floor)
        post = []
        for d in range(4):
            dr, dc = (int(v) for v in MOVES[d])
            ahead = jnp.asarray(self.at[d])
            pull = jnp.any((reach & ahead) != 0, axis=-1) & two_free[d]
            landed = _shift2d(pull.reshape(self.h, self.w), dr, dc).reshape(-1)  # box now at b
            player_ok = jnp.any((ahead & ~target_word) != 0, axis=-1)  # b + d exists, not the target
            post.append(landed & player_ok & at_best)
        post = jnp.stack(post, axis=-1)  # [nb, 4]
        k = _pick(bits[0], post.reshape(-1))
        b_post, d_post = k // 4, k % 4
        b_any = _pick(bits[1, :nb], at_best)
        p_any = _pick(bits[2, :nb], self.to_cells(uncovered[b_any]))
        use_post = jnp.any(post)
        b = jnp.where(use_post, b_post, b_any)
        moves = jnp.asarray(MOVES)
        post_player = jnp.stack([b_post // self.w, b_post % self.w]) + moves[d_post]
        any_player = jnp.stack([p_any // self.w, p_any % self.w])
        player = jnp.where(use_post, post_player, any_player) + 1
        box = jnp.stack([b // self.w, b % self.w]) + 1
        return box.astype(jnp.int32), player.astype(jnp.int32), best.astype(jnp.int32)

    def _two_free(self, floor: chex.Array) -> list[chex.Array]:
        """Per direction d, bool [boxes]: the cell two steps from each box cell is floor."""
        inner = floor[1:-1, 1:-1].reshape(-1)
        return [inner[jnp.asarray(self.two_ahead[d][0])] & jnp.asarray(self.two_ahead[d][1]) for d in range(4)]


def reverse_walks(seed, floor, player, targets, num_walks: int, walk_length: int):
    """RAGEN's reverse play for several boxes as ``num_walks`` random walks of ``walk_length`` moves.

    Each move goes to a random free neighbour; a box directly behind the player is dragged along.
    Every state is scored ``box_swaps * total displacement`` (0 while a target is covered) and the
    best one over all walks is returned: ``(boxes [k, 2], player [2], score, displacement)``.
    """
    moves = jnp.asarray(MOVES)

    def move(walk, bits):
        p, boxes, last_pull, swaps, best = walk
        ahead = p[None, :] + moves  # [4, 2]
        on_box = jnp.any(jnp.all(ahead[:, None, :] == boxes[None, :, :], -1), -1)
        legal = floor[ahead[:, 0], ahead[:, 1]] & ~on_box
        d = _pick_nth(bits, legal)
        moved = legal[d]
        is_behind = jnp.all(boxes == (p - moves[d])[None, :], -1) & moved  # [k]
        pulled = jnp.any(is_behind)
        j = jnp.argmax(is_behind).astype(jnp.int32)
        boxes = jnp.where(is_behind[:, None], p[None, :], boxes)
        p = jnp.where(moved, ahead[d], p)
        swaps = swaps + (pulled & (j != last_pull)).astype(jnp.int32)
        last_pull = jnp.where(pulled, j, last_pull)
        covered = jnp.any(jnp.all(boxes[:, None, :] == targets[None, :, :], -1)) | jnp.any(
            jnp.all(p[None, :] == targets, -1)
        )
        score = jnp.where(covered, 0, swaps * jnp.sum(jnp.abs(boxes - targets)))
        b_score, b_p, b_boxes = best
        better = score > b_score
        best = (
            jnp.where(better, score, b_score),
            jnp.where(better, p, b_p),
            jnp.where(better, boxes, b_boxes),
        )
        return (p, boxes, last_pull, swaps, best), None

    def one_walk(bits):
        init = (player, targets, jnp.int32(-1), jnp.int32(0), (jnp.int32(0), player, targets))
        (_, _, _, _, best), _ = jax.lax.scan(move, init, bits)
        return best

    bits = random_bits(seed, (num_walks, walk_length))
    scores, players, boxes = jax.vmap(one_walk)(bits)
    i = jnp.argmax(scores)
    return boxes[i], players[i], scores[i], jnp.sum(jnp.abs(boxes[i] - targets))


def jitter(seed: chex.Array, grid: chex.Array, room_fixed: chex.Array, player: chex.Array, displacement):
    """RAGEN's post-generation random player walk (free cells only, so solvability is kept).

    Moves with probability 0.8 if the displacement is 1 else 0.5; then up to 3 steps to unvisited
    free neighbours, continuing after each step with probability 0.5.
    """
    bits = random_bits(seed, 7)
    p_move = jnp.where(displacement == 1, 0.8, 0.5)
    alive = _uniform(bits[0]) < p_move
    moves = jnp.asarray(MOVES)
    p, visited = player, [player]
    for s in range(3):
        ahead = p[None, :] + moves
        cell = grid[ahead[:, 0], ahead[:, 1]]
        legal = (cell == FLOOR) | (cell == TARGET)
        for v in visited:
            legal = legal & ~jnp.all(ahead == v[None, :], -1)
        d = _pick_nth(bits[1 + 2 * s], legal)
        moving = alive & legal[d]
        p = jnp.where(moving, ahead[d], p)
        visited.append(p)
        alive = moving & (_uniform(bits[2 + 2 * s]) < 0.5)
    code = jnp.where(room_fixed[p[0], p[1]] == TARGET, PLAYER_ON_TARGET, PLAYER).astype(grid.dtype)
    grid = grid.at[player[0], player[1]].set(room_fixed[player[0], player[1]])
    grid = grid.at[p[0], p[1]].set(code)
    return grid, p


def build_level(floor, targets, boxes, player) -> Level:
    """Room arrays from cells (boxes are never on targets here: the score rule excludes it)."""
    room_fixed = floor.astype(jnp.int8)
    room_fixed = room_fixed.at[targets[:, 0], targets[:, 1]].set(TARGET)
    grid = room_fixed.at[boxes[:, 0], boxes[:, 1]].set(BOX)
    grid = grid.at[player[0], player[1]].set(PLAYER)
    return Level(room_fixed=room_fixed, grid=grid, player=player.astype(jnp.int32))


def fallback_room(rows: int, cols: int, num_boxes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The fixed solvable room used when every candidate fails; None if the room cannot hold it.

    Open interior; box i sits one cell right of its target in interior row i and the player stands
    right of the first box (push Left, then step Right/Down and push Left again, ...). Tall narrow
    rooms use the transposed layout.
    """
    h, w = rows - 2, cols - 2
    if w >= 3 and h >= num_boxes:
        fixed = np.zeros((rows, cols), np.int8)
        fixed[1:-1, 1:-1] = FLOOR
        grid = fixed.copy()
        for i in range(num_boxes):
            fixed[1 + i, 1] = TARGET
            grid[1 + i, 1] = TARGET
            grid[1 + i, 2] = BOX
        grid[1, 3] = PLAYER
        return fixed, grid, np.array([1, 3], np.int32)
    if h >= 3 and w >= num_boxes:
        fixed, grid, player = fallback_room(cols, rows, num_boxes)
        return fixed.T.copy(), grid.T.copy(), player[::-1].copy()
    return None


TRIP_COST_LEVELS = 6.0


def _make_reset_where(generate, chunks_for):
    """``reset_where(done, key) -> Level``: ``generate(key)`` where ``done``, zeros elsewhere.

    Batched (``vmap``), only finished lanes are generated. A ``while`` loop at the batch level
    runs until every finished lane has its level; each trip generates one chunk, its size one of
    ``chunks_for(batch)``, picked for the lowest cost per level still needed. A trip has a fixed
    cost of about ``TRIP_COST_LEVELS`` levels (measured on CPU: ~100 us against ~17 us per level),
    so a step where ~15 of 1,024 episodes end pays for one 16-level trip rather than four 4-level
    trips, and a step where nothing ended pays for nothing.
    """

    def zeros(key):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(generate, key))

    @custom_batching.custom_vmap
    def reset_where(done, key):
        return jax.lax.cond(done, generate, zeros, key)

    @reset_where.def_vmap
    def rule(axis_size, in_batched, done, key):
        done_b, key_b = in_batched
        done = done if done_b else jnp.broadcast_to(done, (axis_size,))
        key = key if key_b else jnp.broadcast_to(key, (axis_size,) + key.shape)
        sizes = chunks_for(axis_size)
        # Finished lanes first; the padding index ``axis_size`` is dropped by the scatter below.
        lanes = jnp.nonzero(done, size=axis_size + sizes[-1], fill_value=axis_size)[0]
        shapes = jax.eval_shape(generate, key[0])
        out = jax.tree.map(lambda s: jnp.zeros((axis_size,) + s.shape, s.dtype), shapes)

        def fill(size):
            def run(start, out):
                idx = jax.lax.dynamic_slice(lanes, (start,), (size,))
                levels = jax.vmap(generate)(key[jnp.minimum(idx, axis_size - 1)])
                out = jax.tree.map(lambda o, l: o.at[idx].set(l, mode="drop"), out, levels)
                return start + size, out

            return run

        def trip(carry):
            start, out = carry
            rest = jnp.sum(done) - start
            # Cost per level actually needed, with a trip's fixed cost ~= TRIP_COST_LEVELS levels.
            c = jnp.asarray(sizes, jnp.float32)
            per_level = (TRIP_COST_LEVELS + c) / jnp.minimum(c, rest.astype(jnp.float32))
            return jax.lax.switch(jnp.argmin(per_level), [fill(c) for c in sizes], start, out)

        n = jnp.sum(done)
        _, out = jax.lax.while_loop(lambda c: c[0] < n, trip, (jnp.int32(0), out))
        return out, jax.tree.map(lambda _: True, out)

    return reset_where


# =============================================================================================
# The generator of one room shape
# =============================================================================================


class LevelGenerator:
    """``generate(key) -> Level`` for one room shape and box count, and ``reset_where(done, key)``:
    a level where ``done``, generated under ``vmap`` for the finished lanes only (module docstring).

    Args: see ``environments.sokoban.Sokoban`` (``search_depth``, ``num_candidates``, ``bfs_sweeps``,
    ``num_walks``, ``walk_length``, ``reset_chunk``); ``dim_room`` and ``num_boxes`` are checked there.
    """

    def __init__(self, dim_room: tuple[int, int], num_boxes: int, *, search_depth: int = 300,
                 num_candidates: int | None = None, bfs_sweeps: int | None = None, num_walks: int = 32,
                 walk_length: int | None = None, reset_chunk: int | None = None):
        rows, cols = dim_room
        self.dim_room = (rows, cols)
        self.num_boxes = int(num_boxes)
        fallback = fallback_room(rows, cols, self.num_boxes)
        if fallback is None:
            raise ValueError(
                f"Sokoban: a {rows}x{cols} room cannot hold {num_boxes} pushable box(es): the interior "
                f"({rows - 2}x{cols - 2}) needs one side >= 3 and the other >= num_boxes; "
                "use a larger dim_room or fewer boxes"
            )
        self._fallback = fallback
        if int(search_depth) < 1:
            raise ValueError(f"Sokoban: search_depth={search_depth} must be >= 1")
        self.search_depth = int(search_depth)
        self.num_gen_steps = int(1.7 * (rows + cols))
        self.num_candidates = int(num_candidates) if num_candidates is not None else (8 if num_boxes == 1 else 4)
        default_sweeps = rows * cols * 2 // 3
        self.bfs_sweeps = min(int(bfs_sweeps) if bfs_sweeps is not None else default_sweeps, self.search_depth)
        self.num_walks = int(num_walks)
        self.walk_length = min(int(walk_length) if walk_length is not None else 3 * rows * cols, self.search_depth)
        self.reset_chunk = None if reset_chunk is None else int(reset_chunk)
        knobs = dict(num_candidates=self.num_candidates, bfs_sweeps=self.bfs_sweeps, num_walks=self.num_walks,
                     walk_length=self.walk_length, reset_chunk=self.reset_chunk or 1)
        bad = {k: v for k, v in knobs.items() if v < 1}
        if bad:
            raise ValueError(f"Sokoban: generator settings must be >= 1, got {bad}")
        self._search = _OneBoxSearch(rows, cols) if self.num_boxes == 1 else None
        self._flood_iters = (rows - 2) * (cols - 2)  # a path visits each interior cell at most once
        self.reset_where = _make_reset_where(self.generate, self._chunks_for)

    def _rooms(self, seeds):
        """Candidate rooms from uint32 seeds [2, M]: floor [M, R, C], player [M, 2], targets [M, k, 2], ok [M]."""
        rows, cols = self.dim_room
        floor = jax.vmap(lambda s: topology(s, rows, cols, self.num_gen_steps))(seeds[0])
        player, targets, ok = jax.vmap(lambda s, f: place(s, f, self.num_boxes))(seeds[1], floor)
        return floor, player, targets, ok

    def _seeds(self, key):
        """One threefry call per level: uint32 [3, M] seeds (topology, placement, search) + 2 more."""
        m = self.num_candidates
        bits = jax.random.bits(key, (3 * m + 2,))
        return bits[: 3 * m].reshape(3, m), bits[3 * m], bits[3 * m + 1]

    def _generate_one_box(self, key) -> tuple[Level, chex.Array]:
        seeds, s_choose, s_jitter = self._seeds(key)
        floor, player, targets, ok = self._rooms(seeds[:2])
        cells, pullable = jax.vmap(lambda f, t, p: self._search.flood(f, t, p, self._flood_iters))(
            floor, targets[:, 0], player
        )
        valid = ok & pullable
        i = jnp.argmax(valid)
        floor, player, target, cells = floor[i], player[i], targets[i], cells[i]
        reach = self._search.search(floor, target[0], cells, self.bfs_sweeps)
        box, player, displacement = self._search.choose(s_choose, reach, floor, target[0])
        level = build_level(floor, target, box[None, :], player)
        grid, player = jitter(s_jitter, level.grid, level.room_fixed, player, displacement)
        return level.replace(grid=grid, player=player), valid.any()

    def _generate_walks(self, key) -> tuple[Level, chex.Array]:
        seeds, _, s_jitter = self._seeds(key)
        floor, player, targets, ok = self._rooms(seeds[:2])
        walk = lambda s, f, p, t: reverse_walks(s, f, p, t, self.num_walks, self.walk_length)
        boxes, players, scores, displacement = jax.vmap(walk)(seeds[2], floor, player, targets)
        valid = ok & (scores > 0)
        i = jnp.argmax(valid)
        level = build_level(floor[i], targets[i], boxes[i], players[i])
        grid, player = jitter(s_jitter, level.grid, level.room_fixed, players[i], displacement[i])
        return level.replace(grid=grid, player=player), valid.any()

    def generate(self, key: chex.PRNGKey) -> Level:
        """One level (the first valid of ``num_candidates`` rooms, else the fixed fallback room)."""
        gen = self._generate_one_box if self.num_boxes == 1 else self._generate_walks
        level, valid = gen(key)
        fixed, grid, player = (jnp.asarray(a) for a in self._fallback)
        fallback = Level(room_fixed=fixed, grid=grid, player=player)
        return jax.tree.map(lambda a, b: jnp.where(valid, a, b), level, fallback)

    def _chunks_for(self, batch: int) -> tuple[int, ...]:
        """Ascending auto-reset chunk sizes for a batch (see ``_make_reset_where``)."""
        big = max(1, min(batch, self.reset_chunk or 64))
        return tuple(sorted({min(4, big), min(16, big), big}))
