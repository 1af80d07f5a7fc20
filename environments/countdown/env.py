"""Countdown (RAGEN's ``countdown``): combine the numbers into an equation that hits the target.

Puzzles. The original reads ``(nums, target)`` pairs from a parquet file and keeps those its
``has_solution`` accepts — a check that only tries ``±`` signs, so puzzles that need ``*`` or ``/``
were silently dropped. Here puzzles are drawn inside jit, always solvable: ``num_numbers`` numbers
in ``1..max_number`` (a count drawn from ``min_numbers..max_numbers``), then a random derivation —
repeatedly two values of the pool are replaced by their sum, difference, product or quotient
(``operators``), every intermediate a positive whole number as in the TV game — until one value
is left; the first of ``candidates`` draws whose value lies in ``1..max_target`` is the puzzle
(if none does, the sum of the numbers is the target: still solvable, above ``max_target``). ``operators="+-"`` gives the original's distribution (targets reachable with signs only).

Answers. The answer is an expression over the numbers, checked on device by a fixed-size parser
(``parse_action``): integer literals, ``+ - * /``, unary ``+``/``-``, parentheses and spaces, at most
``max_action_bytes`` (64) bytes; evaluated in exact rational arithmetic (Python's precedence: unary
minus binds tighter than ``*``; leading zeros are rejected as Python does; values stay exact while
they fit int32, which any expression over the puzzle's numbers does). It costs a scan over at most 64 tokens per answer, once per turn: ~4 ms for a batch of 128 answers
on a 2-core CPU, against the hundreds of milliseconds the model takes to write them.
Scoring, as the original: each number used exactly once and the value equal to the target:
``score`` (1); a well-formed expression over exactly the numbers with another value (or a division
by zero): ``format_score`` (0.1); anything else 0. One answer ends the episode.

Differences from the original, on purpose: its format check compared the runs of digits in the
text with the numbers, so ``2.5 * 2`` passed for ``[2, 5, 2]`` and anything Python's ``eval``
accepts (``**``, ``%``, ``//``) could score; here an expression with other characters is not
well-formed (0), and an unbalanced one too (the original gave those 0.1 when the digits matched).
Equality is exact instead of within 1e-5.
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from environments import render
from environments import text_match as tm
from environments.core import EnvParams, EnvState, Environment
from environments.countdown import expert as countdown_expert
from environments.hashing import expand_words

# Token kinds.
PAD, NUM, PLUS, MINUS, TIMES, DIVIDE, OPEN, CLOSE, BAD = range(9)
# Operator-stack entries: binary ops by token kind, unary minus/plus, "(".
U_MINUS, U_PLUS, PAREN = 9, 10, 11
_PRECEDENCE = {PLUS: 1, MINUS: 1, TIMES: 2, DIVIDE: 2, U_MINUS: 3, U_PLUS: 3}


def _gcd(a, b, iters: int = 48):
    """Euclid with a fixed number of rounds (enough for any pair of int32 magnitudes)."""
    a, b = jnp.abs(a), jnp.abs(b)

    def body(_, ab):
        x, y = ab
        return jnp.where(y == 0, x, y), jnp.where(y == 0, 0, x % jnp.maximum(y, 1))

    return jax.lax.fori_loop(0, iters, body, (a, b))[0]


def _reduced(num, den):
    sign = jnp.where(den < 0, -1, 1)
    num, den = num * sign, den * sign
    g = jnp.maximum(_gcd(num, den), 1)
    return num // g, jnp.where(den == 0, 0, den // g)


def apply_op(op, a, b):
    """Exact ``a op b`` on ``(num, den)`` pairs -> ``(num, den)``; den 0 marks a division by zero."""
    (an, ad), (bn, bd) = a, b
    num = jnp.select([op == PLUS, op == MINUS, op == TIMES], [an * bd + bn * ad, an * bd - bn * ad, an * bn], an * bd)
    den = jnp.select([op == PLUS, op == MINUS, op == TIMES], [ad * bd, ad * bd, ad * bd], ad * bn)
    den = jnp.where((ad == 0) | (bd == 0), 0, den)
    return _reduced(num, den)


def tokenize(text: chex.Array, n: chex.Array):
    """Bytes -> ``(kind int32 [W], value int32 [W], count, bad)``: numbers, operators, brackets."""
    width = text.shape[0]
    idx = jnp.arange(width)
    valid = idx < n
    scan = tm.Scanner(text, n)
    digit = valid & (text >= ord("0")) & (text <= ord("9"))
    prev_digit = jnp.concatenate([jnp.zeros((1,), bool), digit[:-1]])
    # Python rejects leading zeros ("07"; "00" is fine) and no puzzle number has 10 digits.
    starts = digit & ~prev_digit
    bad_literal = starts & (((text == ord("0")) & (scan.digit_run > 1) & (scan.number != 0))
                            | (scan.digit_run > tm.MAX_DIGITS))
    kind = jnp.select(
        [digit & ~prev_digit, text == ord("+"), text == ord("-"), text == ord("*"), text == ord("/"),
         text == ord("("), text == ord(")"), digit | tm.is_space(text)],
        [NUM, PLUS, MINUS, TIMES, DIVIDE, OPEN, CLOSE, PAD], BAD)
    kind = jnp.where(valid, kind, PAD)
    keep = kind != PAD
    slot = jnp.where(keep, jnp.cumsum(keep) - 1, width)
    kinds = jnp.full((width,), PAD, jnp.int32).at[slot].set(kind, mode="drop")
    values = jnp.zeros((width,), jnp.int32).at[slot].set(scan.number, mode="drop")
    return kinds, values, jnp.sum(keep).astype(jnp.int32), jnp.any(kind == BAD) | jnp.any(bad_literal) | (n > width)


def evaluate(kinds, values, count):
    """Shunting-yard over the tokens with fixed stacks -> ``(well_formed, num, den, literals, n_lit)``.

    ``literals`` int32 [W] are the numbers in order of appearance (0 after ``n_lit``).
    """
    width = kinds.shape[0]
    z = jnp.zeros((width,), jnp.int32)
    # carry: value stack (num, den), its size, op stack, its size, expect_operand, ok, literals, n_lit
    init = (z, z, jnp.int32(0), z, jnp.int32(0), jnp.bool_(True), jnp.bool_(True), z, jnp.int32(0))

    def reduce_top(c):
        vn, vd, nv, ops, no, expect, ok, lits, nl = c
        op = ops[no - 1]
        unary = (op == U_MINUS) | (op == U_PLUS)
        need = jnp.where(unary, 1, 2)
        ok = ok & (nv >= need) & (no >= 1) & (op != PAREN)
        a = (vn[jnp.maximum(nv - 2, 0)], vd[jnp.maximum(nv - 2, 0)])
        b = (vn[jnp.maximum(nv - 1, 0)], vd[jnp.maximum(nv - 1, 0)])
        bin_n, bin_d = apply_op(op, a, b)
        un_n = jnp.where(op == U_MINUS, -b[0], b[0])
        res_n, res_d = jnp.where(unary, un_n, bin_n), jnp.where(unary, b[1], bin_d)
        at = jnp.maximum(nv - need, 0)
        vn, vd = vn.at[at].set(res_n), vd.at[at].set(res_d)
        return vn, vd, jnp.maximum(nv - need + 1, 0), ops, jnp.maximum(no - 1, 0), expect, ok, lits, nl

    def reduce_while(c, cond):
        return jax.lax.while_loop(lambda c: c[6] & (c[4] > 0) & cond(c), reduce_top, c)

    def step(c, tok):
        k, v, live = tok
        vn, vd, nv, ops, no, expect, ok, lits, nl = c

        def number(c):
            vn, vd, nv, ops, no, expect, ok, lits, nl = c
            return (vn.at[nv].set(v), vd.at[nv].set(1), nv + 1, ops, no, jnp.bool_(False), ok & expect,
                    lits.at[nl].set(v), nl + 1)

        def open_(c):
            vn, vd, nv, ops, no, expect, ok, lits, nl = c
            return vn, vd, nv, ops.at[no].set(PAREN), no + 1, expect, ok & expect, lits, nl

        def close(c):
            c = reduce_while(c, lambda c: c[3][c[4] - 1] != PAREN)
            vn, vd, nv, ops, no, expect, ok, lits, nl = c
            ok = ok & ~expect & (no > 0) & (ops[jnp.maximum(no - 1, 0)] == PAREN)
            return vn, vd, nv, ops, jnp.maximum(no - 1, 0), jnp.bool_(False), ok, lits, nl

        def operator(c):
            expect = c[5]

            def unary(c):
                vn, vd, nv, ops, no, expect, ok, lits, nl = c
                u = jnp.where(k == MINUS, U_MINUS, U_PLUS)
                ok = ok & ((k == MINUS) | (k == PLUS))
                return vn, vd, nv, ops.at[no].set(u), no + 1, expect, ok, lits, nl

            def binary(c):
                prec = jnp.where((k == TIMES) | (k == DIVIDE), 2, 1)
                top_prec = lambda c: jnp.select(  # noqa: E731
                    [c[3][c[4] - 1] == t for t in _PRECEDENCE], list(_PRECEDENCE.values()), 0)
                c = reduce_while(c, lambda c: top_prec(c) >= prec)
                vn, vd, nv, ops, no, expect, ok, lits, nl = c
                return vn, vd, nv, ops.at[no].set(k), no + 1, jnp.bool_(True), ok, lits, nl

            return jax.lax.cond(expect, unary, binary, c)

        branch = jnp.select([k == NUM, k == OPEN, k == CLOSE], [0, 1, 2], 3)
        new = jax.lax.switch(branch, [number, open_, close, operator], c)
        return jax.tree.map(lambda a, b: jnp.where(live, a, b), new, c), None

    c, _ = jax.lax.scan(step, init, (kinds, values, jnp.arange(width) < count))
    c = reduce_while(c, lambda c: c[3][c[4] - 1] != PAREN)
    vn, vd, nv, ops, no, expect, ok, lits, nl = c
    ok = ok & ~expect & (no == 0) & (nv == 1) & (count > 0)
    return ok, vn[0], vd[0], lits, nl


@chex.dataclass(frozen=True)
class CountdownState(EnvState):
    numbers: chex.Array  # int32 [max_numbers] the puzzle's numbers (0 after count)
    count: chex.Array    # int32 [] how many
    target: chex.Array   # int32 []
    result: chex.Array   # int32 [] -1 before the answer, else 0 wrong format, 1 format only, 2 solved


@chex.dataclass(frozen=True)
class CountdownParams(EnvParams):
    pass


class Countdown(Environment):
    """RAGEN's Countdown with puzzles generated on device (see the module docstring)."""

    name = "countdown"
    action_names = ()
    observation_formats = ("text",)
    observation_format = "text"
    max_action_bytes = 64
    instruction = (
        "You are solving the Countdown puzzle: combine the given numbers with +, -, * and / (and parentheses) "
        "into an expression equal to the target, using every number exactly once. Answer with the expression "
        "only, for example: <think> With [3, 5, 2] and target 4: 2 + 5 = 7 and 7 - 3 = 4. </think>"
        "<answer>2 + 5 - 3</answer>\n"
    )

    def __init__(self, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99, max_target: int = 100,
                 operators: str = "+-*/", candidates: int = 96, score: float = 1.0, format_score: float = 0.1,
                 observation_format: str = "text"):
        if not 2 <= min_numbers <= max_numbers <= 4:
            raise ValueError(f"countdown: need 2 <= min_numbers <= max_numbers <= 4, got {min_numbers}..{max_numbers} "
                             "(exact int32 arithmetic bounds the expression to 4 numbers)")
        if not 1 <= max_number <= 100 or max_target < 1:
            raise ValueError(f"countdown: max_number={max_number} must be in 1..100 and max_target={max_target} >= 1")
        if not operators or set(operators) - set("+-*/"):
            raise ValueError(f"countdown: operators={operators!r} must be a non-empty subset of '+-*/'")
        self.min_numbers, self.max_numbers = int(min_numbers), int(max_numbers)
        self.max_number, self.max_target = int(max_number), int(max_target)
        self.operators, self.candidates = operators, int(candidates)
        self.score, self.format_score = float(score), float(format_score)
        self.observation_format = self.check_format(observation_format)
        t = render.PieceTable(["Target: ", ", nums: [", ", ", "]", "Your answer get ", " points."])
        self._digits = render.digit_ids(t)
        # The original prints the reward as Python does: 0 (an int) for a wrong format.
        self._scores = ["0", repr(format_score), repr(int(score) if float(score).is_integer() else score)]
        t.extend(self._scores)
        self._table = t

    # --- dynamics -------------------------------------------------------------------------
    def default_params(self, max_steps_in_episode: int = 1) -> CountdownParams:
        return CountdownParams(max_steps_in_episode=jnp.int32(max_steps_in_episode))

    WORDS_PER_STEP = 6  # two for the pair, four for the operator draw

    def _candidate(self, words, count):
        """One random puzzle of ``count`` numbers from ``words`` (uint32 [m + 6 (m - 1)]) ->
        ``(numbers, target, acceptable)``.

        Each combination takes two live values ``a >= b`` of the pool (a uniformly random pair) and
        one operator, uniformly among those whose result is a positive whole number (``a - b`` needs
        ``a > b``, ``a / b`` needs ``b`` to divide ``a``: the classic Countdown rule), and puts the
        result back.
        """
        m = self.max_numbers
        u = (words >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
        numbers = 1 + jnp.minimum((u[:m] * self.max_number).astype(jnp.int32), self.max_number - 1)
        numbers = jnp.where(jnp.arange(m) < count, numbers, 0)
        allowed = jnp.asarray([o in self.operators for o in "+-*/"])
        pool, alive = numbers, jnp.arange(m) < count
        for s in range(m - 1):
            w = u[m + self.WORDS_PER_STEP * s: m + self.WORDS_PER_STEP * (s + 1)]
            live = jnp.sum(alive)
            # Ranks of two distinct live slots, then the slots themselves (the k-th live one).
            r1 = jnp.minimum((w[0] * live).astype(jnp.int32), live - 1)
            r2 = jnp.minimum((w[1] * (live - 1)).astype(jnp.int32), jnp.maximum(live - 2, 0))
            r2 = r2 + (r2 >= r1)
            rank = jnp.cumsum(alive) - 1
            i = jnp.argmax(alive & (rank == r1))
            j = jnp.argmax(alive & (rank == r2))
            a, b = jnp.maximum(pool[i], pool[j]), jnp.minimum(pool[i], pool[j])
            results = jnp.stack([a + b, a - b, a * b, a // jnp.maximum(b, 1)])
            ok_op = allowed & jnp.stack([True, a > b, True, (b > 0) & (a % jnp.maximum(b, 1) == 0)])
            op = jnp.argmax(jnp.where(ok_op, w[2:6], -1.0))
            go = (live >= 2) & jnp.any(ok_op)
            pool = jnp.where(go, pool.at[i].set(results[op]), pool)
            alive = jnp.where(go, alive.at[j].set(False), alive)
        value = pool[jnp.argmax(alive)]
        ok = (jnp.sum(alive) == 1) & (value >= 1) & (value <= self.max_target)
        return numbers, value, ok

    def reset_env(self, key, params: CountdownParams):
        # One threefry call; every candidate's words are hashed out of it (environments.hashing).
        seed = jax.random.bits(key, (3,), jnp.uint32)
        span = self.max_numbers + self.WORDS_PER_STEP * (self.max_numbers - 1)
        words = expand_words(seed[:2], (self.candidates, span))
        count = self.min_numbers + (seed[2] % (self.max_numbers - self.min_numbers + 1)).astype(jnp.int32)
        numbers, target, ok = jax.vmap(lambda w: self._candidate(w, count))(words)
        first = jnp.where(jnp.any(ok), jnp.argmax(ok), 0)
        target = jnp.where(jnp.any(ok), target[first], jnp.sum(numbers[0]))
        state = CountdownState(time=jnp.int32(0), numbers=numbers[first], count=count,
                               target=target.astype(jnp.int32), result=jnp.int32(-1))
        return self.observation(state), state

    def parse_action(self, text: chex.Array, n: chex.Array):
        """An expression's bytes -> (its reading: well-formed, exact value, literals sorted; True)."""
        width = text.shape[0]
        body, length = tm.strip(text, n)
        kinds, values, count, bad = tokenize(body, length)
        ok, num, den, lits, nl = evaluate(kinds, values, count)
        big = jnp.int32(1 << 30)
        lits = jnp.sort(jnp.where(jnp.arange(width) < nl, lits, big))[: self.max_numbers + 1]
        action = {"well_formed": ok & ~bad & (n <= width), "num": num, "den": den, "literals": lits,
                  "n_literals": nl}
        return action, n > 0

    def random_action(self, key):
        lits = jnp.full((self.max_numbers + 1,), 1 << 30, jnp.int32)
        return {"well_formed": jnp.bool_(False), "num": jnp.int32(0), "den": jnp.int32(1), "literals": lits,
                "n_literals": jnp.int32(0)}

    def step_env(self, key, state: CountdownState, action, params: CountdownParams):
        m = self.max_numbers
        big = jnp.int32(1 << 30)
        want = jnp.sort(jnp.where(jnp.arange(m) < state.count, state.numbers, big))
        want = jnp.concatenate([want, jnp.full((1,), big)])
        same_numbers = (action["n_literals"] == state.count) & jnp.all(action["literals"] == want)
        formatted = action["well_formed"] & same_numbers
        solved = formatted & (action["den"] != 0) & (action["num"] == state.target * action["den"])
        result = jnp.where(solved, 2, jnp.where(formatted, 1, 0)).astype(jnp.int32)
        reward = jnp.where(solved, self.score, jnp.where(formatted, self.format_score, 0.0)).astype(jnp.float32)
        next_state = state.replace(time=state.time + 1, result=result)
        info = {"action_is_valid": jnp.bool_(True), "action_is_effective": reward > 0, "success": solved}
        return self.observation(next_state), next_state, reward, jnp.bool_(True), jnp.bool_(False), info

    def observation(self, state: CountdownState, params=None) -> chex.Array:
        """int32 [1, max_numbers + 1]: the target and the numbers."""
        return jnp.concatenate([state.target[None], state.numbers])[None]

    # --- text -----------------------------------------------------------------------------
    def render_pieces(self, state: CountdownState, params=None, fmt: str | None = None):
        self.check_format(fmt)
        t = self._table
        playing = state.result < 0
        on = lambda cond, sec: (sec[0], sec[1] & cond)  # noqa: E731
        nums = []
        for i in range(self.max_numbers):
            shown = playing & (i < state.count)
            if i:
                nums.append(on(shown, render.const_section([t.id(", ")])))
            nums.append(on(shown, render.int_section(state.numbers[i], self._digits, 3)))
        score = jnp.asarray(t.ids(self._scores))[jnp.clip(state.result, 0, 2)]
        return render.compact(*render.cat_sections(
            on(playing, render.const_section([t.id("Target: ")])),
            on(playing, render.int_section(state.target, self._digits)),
            on(playing, render.const_section([t.id(", nums: [")])),
            *nums,
            on(playing, render.const_section([t.id("]")])),
            on(~playing, render.const_section([t.id("Your answer get ")])),
            (score[None], ~playing[None]),
            on(~playing, render.const_section([t.id(" points.")])),
        ))

    def render_text(self, state: CountdownState, fmt: str | None = None) -> str:
        """The original's texts: ``Target: 24, nums: [3, 8, 1]`` / ``Your answer get 1 points.``."""
        self.check_format(fmt)
        result = int(np.asarray(state.result))
        if result >= 0:
            return f"Your answer get {self._scores[result]} points."
        nums = [int(v) for v in np.asarray(state.numbers)[: int(np.asarray(state.count))]]
        return f"Target: {int(np.asarray(state.target))}, nums: {nums}"

    def answer_text(self, expression: str) -> str:
        return expression

    # --- the warm-up's expert ------------------------------------------------------------------
    def expert(self, state, params):
        return countdown_expert.plan(self, state, params)

    def random_answer(self, state, rng) -> str:
        """The numbers in a random order joined by random operators."""
        nums = [int(v) for v in np.asarray(state.numbers)[: int(np.asarray(state.count))]]
        rng.shuffle(nums)
        ops = [str(rng.choice(list(self.operators))) for _ in nums[1:]]
        return " ".join(x for pair in zip(map(str, nums), ops + [""]) for x in pair).strip()
