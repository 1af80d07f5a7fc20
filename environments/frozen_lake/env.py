"""FrozenLake with RAGEN's random maps, generated inside jit.

RAGEN (``ragen/env/frozen_lake``) draws every cell frozen with probability ``p``, a random start
and a distinct random goal, and redraws the whole map until a start→goal path exists. Here the
rejection loop becomes a fixed amount of work: ``map_candidates`` i.i.d. candidate maps are drawn
at once and the first one with a path (a flood fill of static length) is kept. The first accepted
draw of an i.i.d. sequence has exactly the rejection loop's distribution, so the maps are RAGEN's
maps. If every candidate fails (probability ``(1 - acceptance)^K``; with the default ``K=4`` that is
~7e-9 for 4×4 at RAGEN's ``p=0.9`` and ~7e-6 at ``p=0.8``; raise ``map_candidates`` for low ``p``),
the first candidate gets an L-shaped path carved from start to goal, so every map is solvable; that
event is the only place the distribution differs from the rejection loop. The candidates share one
bitboard (``Bitboard``), so the path check costs a few integer ops per step of the flood fill.

Randomness: ``reset`` turns the key into one threefry block, expanded by an integer hash into the
~40 words a 4×4 map needs (``random_words``); holes are drawn bit-parallel from them
(``bernoulli_words``), which resolves ``p`` to 16 bits (within 8e-6).

Dynamics are Gymnasium's ``FrozenLake-v1`` with RAGEN's ``success_rate``: the intended move happens
with probability ``success_rate`` and each perpendicular move with ``(1 - success_rate) / 2``;
moves are clamped at the border; holes and the goal are absorbing. Reward +1 on entering the goal.

Note on ``success_rate``: the class default is 0.8 (RAGEN's ``FrozenLakeEnvConfig``), but RAGEN's
``_3_frozen_lake.yaml`` and all RAGEN-2 main-table runs set ``success_rate: 1`` (deterministic).
Pass ``success_rate=1.0`` in ``default_params``/``EnvParams`` to reproduce those runs.

Symbol codes (``observation``): 0 player, 1 frozen, 2 hole, 3 goal, 4 player in hole,
5 player on goal; text symbols come from ``grid_lookup``.
"""
from __future__ import annotations

from typing import Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render, text_match
from environments.core import DescriptionReward, EnvParams, EnvState, Environment
from environments.frozen_lake import expert as frozen_lake_expert
from environments.hashing import expand_words

PLAYER, FROZEN, HOLE, GOAL, PLAYER_IN_HOLE, PLAYER_ON_GOAL = range(6)
DEFAULT_GRID_LOOKUP = {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}
# What each code means; the legend pairs these with the configured symbols.
CODE_MEANINGS = {0: "player", 1: "empty", 2: "hole", 3: "goal", 4: "player in hole", 5: "player on goal"}

# Gymnasium's action order: 0 Left (0, -1), 1 Down (+1, 0), 2 Right (0, +1), 3 Up (-1, 0) as
# (d_row, d_col). Slipping turns direction d into (d - 1) % 4 or (d + 1) % 4: the perpendiculars.
ACTION_NAMES = ("Left", "Down", "Right", "Up")

# The task paragraph (see Sokoban's); the slippery-ice sentence only where moves can slip.
SLIPPERY = "The ice is slippery: a move may take you in a direction you did not intend."
INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Avoid the holes and reach the goal. "
    + SLIPPERY + " "
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)
COORD_INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Avoid the holes and reach the goal. "
    + SLIPPERY + "\n"
    "You are provided with the zero-indexed coordinates of the start, the goal, the player and each hole. \n"
    "Coordinates range from the top-left corner (0, 0) to the bottom-right corner ({last_row}, {last_col}). \n"
    "The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n"
)


@chex.dataclass(frozen=True)
class FrozenLakeState(EnvState):
    pos: chex.Array    # int32 [2] player (row, col)
    start: chex.Array  # int32 [2] start cell (row, col); rendered in "coord" even after leaving it
    goal: chex.Array   # int32 [2] goal cell (row, col)
    holes: chex.Array  # bool [size, size]


@chex.dataclass(frozen=True)
class FrozenLakeParams(EnvParams):
    p: chex.Array             # float32 [] probability that a cell is frozen (not a hole)
    success_rate: chex.Array  # float32 [] probability that the intended move happens
    # Ours, not the original's: the reward for a reply whose reasoning opens with the board's exact
    # description (``FrozenLake.reasoning_reward``); 0 = none (RAGEN's rewards). Params batched for a
    # vmap over them (one value per env) need this one batched too.
    description_reward: chex.Array = 0.0  # float32 []
    # Ours, not the original's: distance shaping, + c * (d before - d after) a move, d = ``goal_distance``
    # (the fewest moves to the goal around the holes); potential-based (Ng et al., 1999) on the frozen
    # cells, and a move into a hole counts as one move away (-c). 0 = none (RAGEN's rewards).
    distance_shaping: chex.Array = 0.0  # float32 []


def goal_distance(holes: chex.Array, goal: chex.Array) -> chex.Array:
    """int32 ``[n, n]``: the fewest moves from each cell to ``goal`` without entering a hole (the goal
    0; a hole, or a cell walled off by holes, ``n * n``): the potential of ``distance_shaping``.
    Breadth-first search as ``n * n`` rounds of relaxation over the 4-neighbours."""
    n = holes.shape[0]
    far = n * n
    cells = jnp.arange(n)
    at_goal = (cells[:, None] == goal[0]) & (cells[None, :] == goal[1])
    dist = jnp.where(at_goal, 0, far).astype(jnp.int32)

    def relax(_, d):
        pad = jnp.pad(d, 1, constant_values=far)
        nearest = jnp.minimum(jnp.minimum(pad[:-2, 1:-1], pad[2:, 1:-1]), jnp.minimum(pad[1:-1, :-2], pad[1:-1, 2:]))
        return jnp.where(holes, far, jnp.minimum(d, nearest + 1))

    return jax.lax.fori_loop(0, far, relax, dist)


def check_params(params: FrozenLakeParams) -> FrozenLakeParams:
    """Raise ``ValueError`` on out-of-range parameters (only when they are concrete, not traced)."""
    checks = (
        ("p", params.p, 0.0, 1.0),
        ("success_rate", params.success_rate, 0.0, 1.0),
    )
    for name, value, lo, hi in checks:
        if isinstance(value, jax.core.Tracer):
            continue
        v = np.asarray(value)
        if not np.all((v >= lo) & (v <= hi)):
            raise ValueError(f"FrozenLake: {name}={v} is outside [{lo}, {hi}]; pass a probability")
    for name in ("description_reward", "distance_shaping"):
        bonus = getattr(params, name)
        if not isinstance(bonus, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(bonus))):
            raise ValueError(f"FrozenLake: {name}={np.asarray(bonus)} must be a finite number")
    steps = params.max_steps_in_episode
    if not isinstance(steps, jax.core.Tracer) and not np.all(np.asarray(steps) >= 1):
        raise ValueError(
            f"FrozenLake: max_steps_in_episode={np.asarray(steps)} must be >= 1 (it is the truncation cap)"
        )
    return params


def random_words(seed: chex.Array, shape: tuple[int, ...]) -> chex.Array:
    """``uint32 [*shape]`` random words from ``seed`` (uint32 [2], one threefry draw).

    A 4×4 map needs 40 random words per reset and ``step`` regenerates a map for every lane (the
    auto-reset selects, it does not branch). Threefry costs ~6x more per word than this hash on
    CPU, so one threefry block is drawn and expanded by hashing a counter with it twice, keyed by
    its two words. The words are still a pure function of the key.
    """
    return expand_words(seed, shape)


# Worst case, over every set of free cells and every seed cell, of the flood-fill steps needed to
# converge on a size x size board (exhaustive search; larger boards use size**2 - 1).
FLOOD_STEPS = {2: 2, 3: 6, 4: 10}


class Bitboard:
    """Static layout of ``boards`` stacked ``size × size`` boards as uint32 words, whole rows per word.

    Board ``k``'s cell ``(r, c)`` sits on global row ``g = k * size + r``: bit
    ``(g % rows_per_word) * size + c`` of word ``g // rows_per_word`` (a 4×4 board is 16 bits, so
    two candidate maps share a word). A 4-neighbour flood step is ~20 integer ops per word, for all
    boards at once; vertical moves are masked at board boundaries so boards never leak into each
    other.
    """

    def __init__(self, size: int, boards: int = 1):
        n = self.size = size
        self.boards = boards
        rpw = self.rows_per_word = 32 // n
        total = boards * n
        self.num_words = -(-total // rpw)
        self.rows = [min(rpw, total - w * rpw) for w in range(self.num_words)]

        def row_bits(w, pick):  # bits of the rows of word w whose global row satisfies pick
            return sum(((1 << n) - 1) << (i * n) for i in range(self.rows[w]) if pick(w * rpw + i))

        self.mask = [(1 << (n * r)) - 1 for r in self.rows]
        self.col_first = [sum(1 << (i * n) for i in range(r)) for r in self.rows]
        self.col_last = [sum(1 << (i * n + n - 1) for i in range(r)) for r in self.rows]
        self.board_first_row = [row_bits(w, lambda g: g % n == 0) for w in range(self.num_words)]
        self.board_last_row = [row_bits(w, lambda g: g % n == n - 1) for w in range(self.num_words)]

    def position(self, board: chex.Array, cell: chex.Array) -> tuple[chex.Array, chex.Array]:
        """(board, row-major cell index) -> (word index, bit index), both int32, any shape."""
        g = board * self.size + cell // self.size
        return g // self.rows_per_word, (g % self.rows_per_word) * self.size + cell % self.size

    def one_hot(self, board: chex.Array, cell: chex.Array) -> list[chex.Array]:
        """Words with one bit set per board: board ``k`` at ``cell[k]``. board, cell: int [boards]."""
        word, bit = self.position(board, cell)
        bits = jnp.uint32(1) << bit.astype(jnp.uint32)
        return [jnp.sum(jnp.where(word == w, bits, 0), axis=-1, dtype=jnp.uint32) for w in range(self.num_words)]

    def bit(self, words: list[chex.Array], board: chex.Array, cell: chex.Array) -> chex.Array:
        """The bit of ``(board, cell)`` (same-shape int arrays) in ``words`` -> bool."""
        word, bit = self.position(board, cell)
        picked = sum(jnp.where(word == w, x, jnp.uint32(0)) for w, x in enumerate(words))
        return ((picked >> bit.astype(jnp.uint32)) & 1) == 1

    def spread(self, x: list[chex.Array]) -> list[chex.Array]:
        """One step of 4-neighbour dilation, within each board."""
        n, u32, last = self.size, jnp.uint32, self.num_words - 1
        out = []
        for w, v in enumerate(x):
            y = (v | ((v << 1) & u32(self.mask[w] & ~self.col_first[w]))
                 | ((v >> 1) & u32(self.mask[w] & ~self.col_last[w])))
            down = (v << n) & u32(self.mask[w])
            if w > 0:  # the previous word's last row moves down into our first row
                down = down | (x[w - 1] >> (n * (self.rows[w - 1] - 1)))
            up = v >> n
            if w < last:  # the next word's first row moves up into our last row
                up = up | ((x[w + 1] & u32((1 << n) - 1)) << (n * (self.rows[w] - 1)))
            out.append(y | (down & u32(~self.board_first_row[w] & 0xFFFFFFFF))
                       | (up & u32(~self.board_last_row[w] & 0xFFFFFFFF)))
        return out

    def flood(self, free: list[chex.Array], seed: list[chex.Array]) -> list[chex.Array]:
        """Cells 4-connected to ``seed`` through ``free`` cells, in every board at once.

        The fill converges after as many steps as the longest shortest path from the seed: at most
        ``size**2 - 1``, and exactly ``FLOOD_STEPS[size]`` at worst for small boards (found by
        exhausting every free-cell mask and seed; the tests redo that search). Extra steps are
        harmless because the fill is monotone.
        """
        def body(_, reach):
            return [s & f for s, f in zip(self.spread(reach), free)]

        n_iter = FLOOD_STEPS.get(self.size, self.size * self.size - 1)
        return jax.lax.fori_loop(0, n_iter, body, list(seed), unroll=True if n_iter <= 24 else 8)


def bernoulli_words(p16: chex.Array, words: chex.Array) -> chex.Array:
    """Each bit independently 1 with probability ``p16 / 2**16``, 32 bits per output word.

    Bit-parallel sampling: going through the 16 bits of ``p16`` from the least significant,
    ``acc | r`` (bit 1) or ``acc & r`` (bit 0) with a fresh random word ``r`` maps the probability
    ``x`` of each bit of ``acc`` to ``(1 + x) / 2`` or ``x / 2``, i.e. prepends that binary digit.
    p16: uint32 [] in [0, 2**16]; words: uint32 [16, ...] -> uint32 [...].
    """
    acc = jnp.zeros(words.shape[1:], jnp.uint32)
    for i in range(16):
        acc = jnp.where(((p16 >> i) & 1) == 1, acc | words[i], acc & words[i])
    return jnp.where(p16 >= 65536, jnp.uint32(0xFFFFFFFF), acc)


def _carve_l_path(holes: chex.Array, start: chex.Array, goal: chex.Array) -> chex.Array:
    """Clear the holes on the path start → (start row, goal col) → goal (fallback only).

    holes bool [size, size]; start, goal int32 [2].
    """
    size = holes.shape[-1]
    r = jnp.arange(size)[:, None]
    c = jnp.arange(size)[None, :]
    lo_c, hi_c = jnp.minimum(start[1], goal[1]), jnp.maximum(start[1], goal[1])
    lo_r, hi_r = jnp.minimum(start[0], goal[0]), jnp.maximum(start[0], goal[0])
    along_row = (r == start[0]) & (c >= lo_c) & (c <= hi_c)
    along_col = (c == goal[1]) & (r >= lo_r) & (r <= hi_r)
    return holes & ~(along_row | along_col)


def _uniform_index(word: chex.Array, n: int) -> chex.Array:
    """uint32 word -> int32 uniform in [0, n) (24-bit float resolution: bias below n / 2**24)."""
    u = (word >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
    return jnp.minimum((u * n).astype(jnp.int32), n - 1)


def generate_map(seed: chex.Array, p: chex.Array, size: int, num_candidates: int):
    """RAGEN's random map: i.i.d. holes, distinct start and goal, a start→goal path.

    All ``num_candidates`` candidate maps live side by side in one ``Bitboard``. ``p`` is resolved
    to 16 bits (a cell is frozen with probability ``round(p * 2**16) / 2**16``, within 8e-6 of
    ``p``).

    seed: uint32 [2] (``jax.random.bits(key, (2,), jnp.uint32)``).
    Returns ``(holes bool [size, size], start int32 [2], goal int32 [2])``.
    """
    board = Bitboard(size, num_candidates)
    cells, k = size * size, jnp.arange(num_candidates)
    words = random_words(seed, (16 * board.num_words + 2 * num_candidates,))
    p16 = jnp.round(jnp.clip(p, 0.0, 1.0) * 65536.0).astype(jnp.uint32)
    frozen = bernoulli_words(p16, words[: 16 * board.num_words].reshape(16, board.num_words))
    start = _uniform_index(words[-2 * num_candidates:-num_candidates], cells)       # int32 [K]
    # Goal uniform over the other cells: RAGEN redraws everything when start == goal, and that
    # event does not depend on the board, so conditioning on start != goal is exact.
    goal = (start + 1 + _uniform_index(words[-num_candidates:], cells - 1)) % cells
    start_bits, goal_bits = board.one_hot(k, start), board.one_hot(k, goal)
    # S and G overwrite whatever was drawn there; cells past the last board stay 0.
    free = [(frozen[w] & jnp.uint32(board.mask[w])) | s | g
            for w, (s, g) in enumerate(zip(start_bits, goal_bits))]
    reach = board.flood(free, start_bits)
    valid = board.bit(reach, k, goal)                                                 # bool [K]

    # The first valid candidate (candidate 0 when none is), picked with masks, not gathers.
    first = jnp.argmax(valid).astype(jnp.int32)
    holes = ~board.bit(free, first, jnp.arange(cells)).reshape(size, size)
    pick = k == first
    start, goal = jnp.sum(jnp.where(pick, start, 0)), jnp.sum(jnp.where(pick, goal, 0))
    start = jnp.stack([start // size, start % size]).astype(jnp.int32)
    goal = jnp.stack([goal // size, goal % size]).astype(jnp.int32)
    holes = jnp.where(jnp.any(valid), holes, _carve_l_path(holes, start, goal))
    return holes, start, goal


def _validate_lookup(grid_lookup: Mapping[int, str] | None, grid_vocab: Mapping[str, str] | None):
    lookup = dict(DEFAULT_GRID_LOOKUP if grid_lookup is None else grid_lookup)
    if sorted(lookup) != list(range(6)):
        raise ValueError(
            f"FrozenLake: grid_lookup must map exactly the codes 0..5 "
            f"({', '.join(f'{k}={v}' for k, v in CODE_MEANINGS.items())}); got keys {sorted(lookup)}"
        )
    symbols = [lookup[c] for c in range(6)]
    if any(not isinstance(s, str) or not s or "\n" in s for s in symbols):
        raise ValueError(f"FrozenLake: grid_lookup symbols must be non-empty strings without newlines; got {symbols}")
    if len(set(symbols)) != 6:
        raise ValueError(f"FrozenLake: grid_lookup symbols must be distinct so the grid is readable; got {symbols}")
    if grid_vocab is None:
        vocab = {lookup[c]: CODE_MEANINGS[c] for c in range(6)}
    else:
        vocab = dict(grid_vocab)
        if set(vocab) != set(symbols):
            raise ValueError(
                f"FrozenLake: grid_vocab must describe exactly the grid_lookup symbols {symbols}; "
                f"got {sorted(vocab)}"
            )
    return lookup, vocab


class FrozenLake(DescriptionReward, Environment):
    """RAGEN's FrozenLake: random valid maps, slippery moves, text renders.

    Static (shapes / tables): ``size``, ``observation_format``, ``grid_lookup``, ``grid_vocab``,
    ``is_slippery``, ``map_candidates``; ``expert_reasoning`` picks the warm-up expert's reasoning
    text (ours, not the original's: it has no expert; see ``expert.frozen_lake_reasoning``).
    Traced: ``FrozenLakeParams(p, success_rate, max_steps_in_episode)``; ``default_params()`` gives
    RAGEN's class defaults ``p=0.9``, ``success_rate=0.8`` and a cap of 100 steps (Gymnasium's 4×4
    limit; RAGEN's agent loop stops earlier through its own action budget). ``is_slippery=False`` makes every move the intended one
    whatever ``success_rate`` says (Gymnasium's meaning of the flag).

    Actions: 0 Left, 1 Down, 2 Right, 3 Up (RAGEN's ids 1..4 minus one); anything else is an
    invalid action that leaves the state unchanged. ``info``: ``action_is_valid``,
    ``action_is_effective`` (the player moved), ``success`` (the player is on the goal).
    ``terminated`` on the goal or a hole; ``truncated`` when the step cap is reached first.
    """

    name = "frozen_lake"
    action_names = ACTION_NAMES

    def __init__(
        self,
        size: int = 4,
        observation_format: str = "grid",
        grid_lookup: Mapping[int, str] | None = None,
        grid_vocab: Mapping[str, str] | None = None,
        is_slippery: bool = True,
        map_candidates: int = 4,
        expert_reasoning: str = "after_move",
    ):
        if not isinstance(size, (int, np.integer)) or size < 2 or size > 30:
            raise ValueError(
                f"FrozenLake: size={size!r} must be an int in [2, 30] (a start and a distinct goal "
                "need at least 2x2 cells; rows are 32-bit masks)"
            )
        if not isinstance(map_candidates, (int, np.integer)) or map_candidates < 1:
            raise ValueError(f"FrozenLake: map_candidates={map_candidates!r} must be a positive int")
        self.size = int(size)
        self.is_slippery = bool(is_slippery)
        self.map_candidates = int(map_candidates)
        if expert_reasoning not in frozen_lake_expert.EXPERT_REASONING:
            raise ValueError(f"FrozenLake: expert_reasoning={expert_reasoning!r} must be one of "
                             f"{frozen_lake_expert.EXPERT_REASONING} (the warm-up expert's reasoning text)")
        self.expert_reasoning = expert_reasoning
        self.grid_lookup, self.grid_vocab = _validate_lookup(grid_lookup, grid_vocab)
        self.observation_format = self.check_format(observation_format)
        self._init_render()

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, p: float = 0.9, success_rate: float = 0.8,
                       max_steps_in_episode: int = 100, description_reward: float = 0.0,
                       distance_shaping: float = 0.0) -> FrozenLakeParams:
        """``distance_shaping`` c adds ``c * (d_before - d_after)`` to each move's reward, ``d`` the fewest
        moves to the goal around the holes (``goal_distance``), a move into a hole counting as one move
        away: every move that gets nearer is paid even when the episode fails (ours)."""
        return check_params(FrozenLakeParams(
            p=jnp.float32(p),
            success_rate=jnp.float32(success_rate),
            max_steps_in_episode=jnp.int32(max_steps_in_episode),
            description_reward=jnp.float32(description_reward),
            distance_shaping=jnp.float32(distance_shaping),
        ))

    def reset_env(self, key: chex.PRNGKey, params: FrozenLakeParams):
        check_params(params)
        return self._reset_from_seed(jax.random.bits(key, (2,), jnp.uint32), params)

    def _reset_from_seed(self, seed: chex.Array, params: FrozenLakeParams):
        holes, start, goal = generate_map(seed, params.p, self.size, self.map_candidates)
        state = FrozenLakeState(time=jnp.int32(0), pos=start, start=start, goal=goal, holes=holes)
        return self.observation(state, params), state

    def step_env(self, key, state: FrozenLakeState, action, params: FrozenLakeParams):
        """One move; the slip is decided by ``u = jax.random.uniform(key)``."""
        return self.transition(state, action, jax.random.uniform(key), params)

    def step(self, key: chex.PRNGKey, state: FrozenLakeState, action, params: FrozenLakeParams | None = None):
        """``step_env`` + auto-reset (``Environment.step`` semantics) from a single threefry draw.

        The base class splits the key and draws the slip and the next map separately; here one
        ``bits(key, 4)`` call feeds both (word 0 -> the slip's uniform, words 2-3 -> the map seed),
        which halves the PRNG work of a step, the dominant cost at large batch on CPU.
        """
        params = self.default_params() if params is None else params
        words = jax.random.bits(key, (4,), jnp.uint32)
        u = (words[0] >> 8).astype(jnp.float32) * (1.0 / (1 << 24))  # uniform [0, 1), 24 bits
        _, next_state, reward, terminated, truncated, info = self.transition(state, action, u, params)
        _, state_reset = self._reset_from_seed(words[2:], params)
        done = terminated | truncated
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_reset, next_state)
        # One observation of the selected state instead of selecting between two.
        return self.observation(next_state, params), next_state, reward, terminated, truncated, info

    def transition(self, state: FrozenLakeState, action, u, params: FrozenLakeParams):
        """The move for a given uniform draw ``u`` in [0, 1) -> ``step_env``'s 6-tuple.

        Gymnasium's ``categorical_sample`` over the directions ``[(d-1)%4, d, (d+1)%4]`` with
        probabilities ``[(1-s)/2, s, (1-s)/2]`` picks the first whose cumulative probability
        exceeds ``u``. An action outside ``0..3`` is invalid and leaves the state unchanged.
        """
        action = jnp.asarray(action, jnp.int32)
        valid = (action >= 0) & (action < 4)
        intended = jnp.clip(action, 0, 3)
        if self.is_slippery:
            slip = (1.0 - params.success_rate) / 2.0
            turn = jnp.where(u < slip, -1, jnp.where(u < slip + params.success_rate, 0, 1))
            direction = (intended + turn) % 4
        else:
            direction = intended
        was_terminal = self._on_hole(state, state.pos) | self._on_goal(state, state.pos)
        # The move of ``direction`` as selects (a table gather per lane is slow under vmap on CPU).
        d_row = jnp.where(direction == 1, 1, jnp.where(direction == 3, -1, 0))
        d_col = jnp.where(direction == 2, 1, jnp.where(direction == 0, -1, 0))
        moved = jnp.clip(state.pos + jnp.stack([d_row, d_col]), 0, self.size - 1)
        pos = jnp.where(valid & ~was_terminal, moved, state.pos)  # holes and the goal absorb

        on_goal = self._on_goal(state, pos)
        terminated = on_goal | self._on_hole(state, pos)
        reward = (on_goal & ~was_terminal).astype(jnp.float32)
        dist = goal_distance(state.holes, state.goal)
        before = dist[state.pos[0], state.pos[1]]
        # A move into a hole counts as one move away (-c), not as the potential's far value: with the
        # hole at n * n, bumping into a wall (0) was the safest reply and a SmolLM2 policy collapsed
        # onto it within 8 StarPO steps.
        after = jnp.where(state.holes[pos[0], pos[1]], before + 1, dist[pos[0], pos[1]])
        reward = reward + params.distance_shaping * jnp.where(was_terminal, 0.0, (before - after).astype(jnp.float32))
        time = state.time + 1
        truncated = (time >= params.max_steps_in_episode) & ~terminated
        next_state = state.replace(time=time, pos=pos)
        info = {
            "action_is_valid": valid,
            "action_is_effective": jnp.any(pos != state.pos),
            "success": on_goal,
        }
        return self.observation(next_state, params), next_state, reward, terminated, truncated, info

    @staticmethod
    def _on_goal(state: FrozenLakeState, pos: chex.Array) -> chex.Array:
        return jnp.all(pos == state.goal)

    def _on_hole(self, state: FrozenLakeState, pos: chex.Array) -> chex.Array:
        return jnp.any(state.holes & self._cell_mask(pos))

    def _cell_mask(self, pos: chex.Array) -> chex.Array:
        """int32 [2] -> bool [size, size], True at ``pos`` only."""
        r = jnp.arange(self.size)[:, None]
        c = jnp.arange(self.size)[None, :]
        return (r == pos[0]) & (c == pos[1])

    def observation(self, state: FrozenLakeState, params=None) -> chex.Array:
        """Symbol grid ``int32 [size, size]``: 0 P, 1 frozen, 2 hole, 3 goal, 4 X, 5 √."""
        is_goal = self._cell_mask(state.goal)
        is_player = self._cell_mask(state.pos)
        under = jnp.where(state.holes, HOLE, jnp.where(is_goal, GOAL, FROZEN))
        player = jnp.where(state.holes, PLAYER_IN_HOLE, jnp.where(is_goal, PLAYER_ON_GOAL, PLAYER))
        return jnp.where(is_player, player, under).astype(jnp.int32)

    # --- text -----------------------------------------------------------------------------
    def _init_render(self):
        """Build the static piece table and the ids the device render needs."""
        n = self.size
        self._board_line = f"Board size: {n} rows x {n} cols (zero-indexed)."
        self._player_headers = ("\nPlayer: ", "\nPlayer on goal: ", "\nPlayer in hole: ")
        table = render.PieceTable([self.grid_lookup[c] for c in range(6)])
        table.extend(["\n", ", ", self._board_line, "\nStart: ", "\nGoal: ", *self._player_headers,
                      "Holes: ", "Coordinates: \n", "\nGrid Map: \n"])
        table.extend(render.coord_strings(n, n))
        self._table = table
        self._symbol_ids = np.asarray(table.ids([self.grid_lookup[c] for c in range(6)]), np.int32)
        self._coord_ids = render.coord_ids(table, n, n)

    def render_pieces(self, state: FrozenLakeState, params=None, fmt: str | None = None):
        """Device render of one state -> ``(pieces int32 [max_pieces(fmt)], n int32)``."""
        fmt = self.check_format(fmt)
        t = self._table
        grid = render.grid_section(self.observation(state, params), self._symbol_ids, t.id("\n"))
        if fmt == "grid":
            return render.compact(*grid)
        coord_ids = jnp.asarray(self._coord_ids)

        def single(header, pos: chex.Array):
            """A one-coordinate line, e.g. ``"\\nGoal: (2, 0)"`` (header piece, coordinate piece)."""
            return jnp.stack([jnp.asarray(header, jnp.int32), coord_ids[pos[0], pos[1]]]), jnp.ones((2,), bool)

        on_goal = self._on_goal(state, state.pos)
        in_hole = self._on_hole(state, state.pos)
        player_header = jnp.where(on_goal, t.id(self._player_headers[1]),
                                  jnp.where(in_hole, t.id(self._player_headers[2]), t.id(self._player_headers[0])))
        coord = [
            render.const_section([t.id(self._board_line)]),
            single(t.id("\nStart: "), state.start),
            single(t.id("\nGoal: "), state.goal),
            single(player_header, state.pos),
            render.coord_line(state.holes, coord_ids, t.id("Holes: "), t.id(", "), t.id("\n")),
        ]
        if fmt == "coord":
            return render.compact(*render.cat_sections(*coord))
        return render.compact(*render.cat_sections(
            render.const_section([t.id("Coordinates: \n")]), *coord,
            render.const_section([t.id("\nGrid Map: \n")]), grid,
        ))

    def legend(self) -> str:
        """``"P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal"``."""
        return ", ".join(f"{symbol}: {meaning}" for symbol, meaning in self.grid_vocab.items())

    def render_text(self, state: FrozenLakeState, fmt: str | None = None) -> str:
        """Host reference render (RAGEN's strings) of one unbatched state, plain NumPy."""
        fmt = self.check_format(fmt)
        pos, start, goal = (tuple(int(v) for v in np.asarray(a)) for a in (state.pos, state.start, state.goal))
        holes = np.asarray(state.holes, bool)
        # RAGEN: copy desc, S -> F, player cell -> P / X (on H) / √ (on G), then grid_lookup.
        codes = np.where(holes, HOLE, FROZEN)
        codes[goal] = GOAL
        codes[pos] = PLAYER_IN_HOLE if holes[pos] else PLAYER_ON_GOAL if pos == goal else PLAYER
        grid_text = "\n".join("".join(self.grid_lookup[int(c)] for c in row) for row in codes)
        if fmt == "grid":
            return grid_text
        cell = render.coord_string
        lines = [self._board_line, f"Start: {cell(*start)}", f"Goal: {cell(*goal)}"]
        if pos == goal:
            lines.append(f"Player on goal: {cell(*pos)}")
        elif holes[pos]:
            lines.append(f"Player in hole: {cell(*pos)}")
        else:
            lines.append(f"Player: {cell(*pos)}")
        hole_cells = [cell(int(r), int(c)) for r, c in np.argwhere(holes)]
        if hole_cells:
            lines.append("Holes: " + ", ".join(hole_cells))
        coord = "\n".join(lines)
        if fmt == "coord":
            return coord
        return "Coordinates: \n" + coord + "\n" + "Grid Map: \n" + grid_text

    # --- the system prompt ---------------------------------------------------------------------
    def slips(self, params=None) -> bool:
        """Whether moves can slip: ``is_slippery`` and, when concrete, ``success_rate < 1``."""
        if not self.is_slippery:
            return False
        rate = getattr(params, "success_rate", None)
        try:
            return rate is None or float(rate) < 1.0
        except jax.errors.ConcretizationTypeError:  # traced params: keep the cautious sentence
            return True

    def instruction_text(self, fmt, board_shape, params=None) -> str:
        """The task paragraph; without the slippery-ice sentence when no move can slip (the original
        kept it even when every move went where it was meant to)."""
        if fmt in ("coord", "grid_coord"):
            text = COORD_INSTRUCTION.format(last_row=board_shape[0] - 1, last_col=board_shape[1] - 1)
        else:
            text = INSTRUCTION
        return text if self.slips(params) else text.replace(" " + SLIPPERY, "")

    # --- the board's description (what reasoning that reads the board right opens with) -----------
    def description_bytes(self, state: FrozenLakeState) -> tuple[chex.Array, chex.Array]:
        """The board's description as the expert's reasoning opens (``expert_reasoning``'s style), up
        to and including its first ``;``: "The player is at (3, 3) and the goal at (0, 0), hole at
        (3, 2);" (``before_move``) or "The player is at (3, 3) and the goal at (0, 0);"
        (``after_move``). -> ``(uint8 [description_width], int32 [] length)``, built on device."""
        digits = len(str(self.size - 1))

        def text(literal: str, when=True):
            return text_match.masked(text_match.literal(literal), when)

        def cell(rc, when=True):  # "(r, c)"
            return text_match.cell(rc, digits, when)

        parts = [text("The player is at "), *cell(state.pos), text(" and the goal at "), *cell(state.goal)]
        if self.expert_reasoning == "before_move":
            # Every hole next to the player, in the expert's order (Left, Down, Right, Up).
            cells = state.pos[None] + jnp.array([[0, -1], [1, 0], [0, 1], [-1, 0]], jnp.int32)
            inside = jnp.all((cells >= 0) & (cells < self.size), axis=1)
            cells = jnp.clip(cells, 0, self.size - 1)
            near = inside & state.holes[cells[:, 0], cells[:, 1]]
            count, before = jnp.sum(near), jnp.cumsum(near) - near  # holes named before each
            parts += [text(", no hole near", count == 0), text(", hole at ", count == 1), text(", holes at ", count > 1)]
            for k in range(4):
                parts += [text(", ", near[k] & (before[k] > 0)), *cell(cells[k], near[k])]
        parts.append(text(";"))
        return text_match.concat(parts, self.description_width)

    @property
    def description_width(self) -> int:
        """The longest description ``description_bytes`` can build (four holes named)."""
        cell = len("(, )") + 2 * len(str(self.size - 1))
        return len("The player is at  and the goal at , holes at ;") + 6 * cell + 3 * len(", ")

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return frozen_lake_expert.plan(self, state, params)
