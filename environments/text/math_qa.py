"""Math question answering in the MetaMathQA format (RAGEN's ``metamathqa``), several tries allowed.

Rows have ``query`` (the question) and ``response`` (a worked solution ending in
``The answer is: ...``). ``reset(seed)`` picks a row from the seed; the answer is the text after the
first ``The answer is: `` to the end, stripped (the original's extraction). A reply is correct when
it equals that answer after lower-casing and removing all whitespace; try ``k`` (0-based) of a
correct answer earns ``1 / 2**k``; a wrong one gets ``Incorrect. Please think again.`` and 0, an
empty one is an invalid action.

The shipped file (``environments/data/arithmetic_word_problems.jsonl``) holds generated arithmetic
word problems in that format, so tests and the demo need no download; point ``data_path`` at a
local copy of MetaMathQA (JSONL or parquet) for the real dataset.
"""
from __future__ import annotations

import re

import numpy as np

from environments.text import data_file, load_records

DEFAULT_FILE = "arithmetic_word_problems.jsonl"


def extract_answer(response: str) -> str | None:
    m = re.search(r"The answer is: (.*?)$", response, re.DOTALL)
    return m.group(1).strip() if m else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.lower())


class MathQA:
    """One question per episode; up to the rollout's action budget of answers."""

    action_names = None
    instruction = ("You are solving math word problems. Reason step by step, then give only the final answer, "
                   "for example <answer>42</answer>.\n")

    def __init__(self, data_path: str | None = None, split: str = "train"):
        self.path = data_file(data_path, DEFAULT_FILE, "data_path")
        rows = load_records(self.path, ("query", "response"), "data_path")
        if "split" in rows[0]:
            rows = [r for r in rows if r["split"] == split]
            if not rows:
                raise ValueError(f"{self.path} has no rows with split={split!r} (config.env.split)")
        self.rows = rows
        self.question = self.answer = None
        self.tries = 0

    def reset(self, seed: int) -> str:
        row = self.rows[int(np.random.default_rng(seed).integers(len(self.rows)))]
        self.question, self.answer = row["query"], extract_answer(row["response"])
        self.tries = 0
        return self.question

    def step(self, action: str):
        given = _normalise(action.strip())
        correct = self.answer is not None and given == _normalise(self.answer)
        reward = 1.0 / (2 ** self.tries) if correct else 0.0
        self.tries += 1
        text = "Correct!" if correct else "Incorrect. Please think again."
        return text, reward, correct, {"action_is_valid": given != "", "success": correct}


def generate_problems(n: int = 400, seed: int = 0) -> list[dict]:
    """Arithmetic word problems with worked solutions, MetaMathQA-style (the shipped file)."""
    rng = np.random.default_rng(seed)
    names = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Leo"]
    things = ["apples", "marbles", "stickers", "books", "pencils", "coins", "shells", "cards"]
    rows = []
    for i in range(n):
        who, other = rng.choice(names, 2, replace=False)
        thing = str(rng.choice(things))
        kind = i % 4
        a, b, c = (int(x) for x in rng.integers(2, 30, 3))
        if kind == 0:
            q = f"{who} has {a} {thing}. {other} gives {who} {b} more. How many {thing} does {who} have now?"
            ans, sol = a + b, f"{who} starts with {a} and gets {b} more, so {a} + {b} = {a + b}."
        elif kind == 1:
            a = a + b
            q = f"{who} had {a} {thing} and gave {b} of them to {other}. How many {thing} does {who} have left?"
            ans, sol = a - b, f"{a} - {b} = {a - b}."
        elif kind == 2:
            q = f"{who} buys {a} bags with {b} {thing} in each bag. How many {thing} is that in total?"
            ans, sol = a * b, f"{a} bags of {b} make {a} * {b} = {a * b}."
        else:
            total = a * b
            q = f"{who} shares {total} {thing} equally among {a} friends. How many {thing} does each friend get?"
            ans, sol = b, f"{total} / {a} = {b}."
        rows.append({"query": q, "response": f"{sol} The answer is: {ans}", "split": "test" if i % 10 == 9 else "train"})
    return rows
