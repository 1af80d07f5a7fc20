"""Countdown's expert: exhaustive search over every way of combining the numbers, and the
warm-up's plan.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from environments.core import Plan



def solve_countdown(numbers: Sequence[int], target: int, operators: str = "+-*/") -> str | None:
    """An expression using every number once whose exact value is ``target`` (None if none exists).

    Exhaustive: repeatedly combine two of the remaining (value, text) pairs with every operator in
    both orders, in exact fractions; sub-expressions are parenthesised, so the text evaluates the
    same under Python's and our parser's precedence.
    """
    from fractions import Fraction

    seen = set()

    def rec(items):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ta), (b, tb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                outs = []
                if "+" in operators and i < j:
                    outs.append((a + b, f"{ta} + {tb}"))
                if "*" in operators and i < j:
                    outs.append((a * b, f"{ta} * {tb}"))
                if "-" in operators:
                    outs.append((a - b, f"{ta} - {tb}"))
                if "/" in operators and b != 0:
                    outs.append((a / b, f"{ta} / {tb}"))
                for v, text in outs:
                    wrapped = text if not rest else f"({text})"
                    found = rec(rest + [(v, wrapped)])
                    if found is not None:
                        return found
        return None

    return rec([(Fraction(int(n)), str(int(n))) for n in numbers])


def plan(env, s, params) -> Plan:
    """An equation of the numbers that hits the target (none when no equation does)."""
    nums = [int(v) for v in np.asarray(s.numbers)[: int(np.asarray(s.count))]]
    target = int(np.asarray(s.target))
    expr = solve_countdown(nums, target, env.operators)
    answers = [] if expr is None else [expr]

    def reasoning(given):
        return f"With {nums} and target {target}: " + (f"{given[0]} = {target}." if given else "no equation works.")

    return Plan(answers, reasoning)
