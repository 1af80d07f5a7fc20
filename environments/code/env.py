"""Code generation with execution feedback (RAGEN's ``deepcoder`` protocol), a Python environment.

Each episode is one problem (``problems.py``: HumanEval by default). Each turn the answer is a
complete program — for a function-style problem, the function (with its imports) the tests call;
for a stdin/stdout problem, a script. It runs in the sandbox (``sandbox.py``) against the problem's
tests: all pass -> reward 1.0, success, the episode ends; otherwise reward 0.0 and the next turn
shows the first failure — the error type and message, the failing assertion or the
input / expected / got triple, cut to ``max_feedback_chars`` — and the count passed, until the
rollout's turn or action budget is spent. ``partial_credit=True`` pays the fraction of tests passed
instead (off by default, as in RAGEN); it counts the ``tests`` list or the ``io`` pairs (a single
``check()`` program is one test).

The answer may be wrapped in a Markdown code fence (removed). The import lines of a function-style
problem's prompt (``from typing import List``) are put before the answer, which may omit them.
"""
from __future__ import annotations

import collections
import re
import threading

import numpy as np

from environments.code.judge import run_function_tests
from environments.code.problems import CodeProblem, load_problems, problem_sources, split_problems
from environments.code.sandbox import Limits, Sandbox

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def extract_program(answer: str) -> str:
    """The code of an answer: the inside of a Markdown fence when the whole answer is one."""
    m = _FENCE.match(answer)
    return m.group(1) if m else answer.strip("\n")


def _imports(prompt: str) -> str:
    return "".join(line + "\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))


def cut_text(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters, ``...`` marking the cut (feedback shown to the model)."""
    return text if len(text) <= n else text[: max(0, n - 3)] + "..."


def plain_text(text: str) -> str:
    """Text the program controls, made safe to show: printable ASCII and newlines only (other
    characters escaped), so ``n`` characters are at most ``n`` tokens of any byte-level tokenizer
    and a cut observation always fits ``max_obs_tokens``."""
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if c == "\n" or " " <= c <= "~" else f"\\x{ord(c):02x}" for c in text)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def _same_output(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing empty lines ignored."""
    return _lines(got) == _lines(expected)


class CodeEnv:
    """One coding problem per episode; answers run in the sandbox (see the module docstring).

    ``counters``: how runs ended since the host last took them (``HostEnv.take_counters``, logged
    as ``env/*`` each step): ``runs``, ``timeouts``, ``killed``, ``output_limit``,
    ``program_stopped`` (it ended or spoke garbage before the tests finished), ``sandbox_errors``
    (the sandbox or the judge failed: reward 0, never an exception out of ``step``).
    """

    action_names = None  # free text: the program
    instruction = ("You are an expert Python programmer. Solve the problem with a complete Python program. Write "
                   "the whole program inside <answer> </answer>: for a function, its full definition with the imports "
                   "it needs; for a problem with input, a script that reads standard input and prints the answer. "
                   "If a test fails you will see it and may answer again.\n")
    _sandboxes: dict = {}  # one sandbox (one worker pool) per set of settings, shared by every row
    _lock = threading.Lock()

    def __init__(self, dataset: str = "humaneval", data_path: str | None = None, split: str = "train",
                 validation_fraction: float = 0.2, split_seed: int = 0, partial_credit: bool = False,
                 timeout_s: float = 5.0, memory_mb: int = 1024, max_workers: int = 4, disk_mb: int = 64,
                 max_feedback_chars: int = 400, python: str | None = None, allow_unsandboxed: bool = False,
                 expose_packages: bool = False):
        if not 0.0 <= float(validation_fraction) < 1.0:
            raise ValueError(f"config.env.validation_fraction={validation_fraction!r} must be in [0, 1)")
        self.problems = split_problems(load_problems(dataset, data_path), split, float(validation_fraction),
                                       int(split_seed))
        self.partial_credit = bool(partial_credit)
        self.max_feedback_chars = int(max_feedback_chars)
        self.limits = Limits(timeout_s=float(timeout_s), memory_mb=int(memory_mb), max_workers=int(max_workers),
                             disk_mb=int(disk_mb))
        # The problem files (tests, expected outputs, canonical solutions) are hidden from programs.
        hide = problem_sources(dataset, data_path)
        key = (self.limits, python, bool(allow_unsandboxed), bool(expose_packages), hide)
        with CodeEnv._lock:
            if key not in CodeEnv._sandboxes:
                CodeEnv._sandboxes[key] = Sandbox(self.limits, python=python, allow_unsandboxed=bool(allow_unsandboxed),
                                                  expose_packages=bool(expose_packages), hide=hide)
        self.sandbox = CodeEnv._sandboxes[key]
        self.parallel_steps = int(max_workers)  # HostEnv steps this many rows at once
        self.problem: CodeProblem | None = None
        self.counters: collections.Counter = collections.Counter()

    # ---- the episode --------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.problem = self.problems[int(np.random.default_rng(seed).integers(len(self.problems)))]
        return self.problem_text(self.problem)

    @staticmethod
    def problem_text(p: CodeProblem) -> str:
        if p.function_style:
            return (f"Write the Python function {p.entry_point}() described below (tests call it directly).\n\n"
                    f"{p.prompt.strip()}\n")
        return f"Write a Python program that reads standard input and prints the answer.\n\n{p.prompt.strip()}\n"

    def step(self, action: str):
        program = extract_program(action)
        if not program.strip():
            return "The answer held no program. Write the whole program inside <answer> </answer>.", 0.0, False, \
                {"action_is_valid": False, "success": False}
        passed, total, feedback = self.run_tests(self.problem, program)
        solved = total > 0 and passed == total
        reward = 1.0 if solved else (passed / total if self.partial_credit and total else 0.0)
        reward = min(max(float(reward), 0.0), 1.0)
        text = "All tests passed." if solved else f"{feedback}\nPassed {passed}/{total} tests. Fix the program."
        return text, reward, solved, {"success": solved, "tests_passed": passed, "tests_total": total}

    def take_counters(self) -> dict:
        """The counters since the last call (then zeroed)."""
        out, self.counters = dict(self.counters), collections.Counter()
        return out

    # ---- execution ----------------------------------------------------------------------
    def run_tests(self, problem: CodeProblem, program: str) -> tuple[int, int, str]:
        """``(tests passed, tests, feedback on the first failure)`` of ``program`` on ``problem``.
        Never raises for anything the program does: a sandbox failure is 0 passed and a line of
        feedback, counted in ``counters["sandbox_errors"]``."""
        total = (1 if problem.test else 0) + len(problem.tests) if problem.function_style else len(problem.io)
        try:
            if problem.function_style:
                passed, total, feedback = self._run_function_tests(problem, program)
            else:
                passed, total, feedback = self._run_io_tests(problem, program)
        except Exception as e:  # noqa: BLE001 — no program may abort training through the sandbox
            self.counters["sandbox_errors"] += 1
            return 0, total, cut_text(f"The sandbox failed to run the program ({type(e).__name__}).",
                                      self.max_feedback_chars)
        return min(max(int(passed), 0), total), total, feedback

    def _count(self, result) -> None:
        self.counters["runs"] += 1
        if result.status in ("timeout", "killed", "output_limit"):
            self.counters[{"timeout": "timeouts"}.get(result.status, result.status)] += 1
        if result.status == "sandbox_error":
            self.counters["sandbox_errors"] += 1

    def _run_function_tests(self, p: CodeProblem, program: str) -> tuple[int, int, str]:
        verdict = run_function_tests(self.sandbox, prelude=p.prompt, program=_imports(p.prompt) + program,
                                     test=p.test or "", tests=p.tests, entry_point=p.entry_point)
        result = verdict.run
        self._count(result)
        if verdict.judge_error is not None or result.status == "sandbox_error":
            if result.status != "sandbox_error":
                self.counters["sandbox_errors"] += 1
            return 0, verdict.total, "The test harness failed; this answer was not judged."
        fail = verdict.failure
        if verdict.stopped in ("ended", "timeout", "garbled"):
            self.counters["program_stopped"] += 1
            limit = self._limit_feedback(result)
            if verdict.stopped == "garbled":
                why = "its function's results could not be read (it wrote to the harness's channel)"
            else:
                tail = plain_text(result.stderr).strip().splitlines()[-1:]
                why = limit or (tail[0] if tail else f"exit code {result.exit_code}")
            text = f"The program stopped before the tests finished: {why}"
            if fail is not None:
                text = self._failure_text(fail) + "\n" + text
            return verdict.passed, verdict.total, cut_text(text, self.max_feedback_chars)
        if fail is None:
            return verdict.passed, verdict.total, ""
        return verdict.passed, verdict.total, cut_text(self._failure_text(fail), self.max_feedback_chars)

    @staticmethod
    def _failure_text(fail: dict) -> str:
        fail = {k: plain_text(v) for k, v in fail.items()}
        head = f"{fail['error']}: {fail['message']}".rstrip(": ") if fail["message"] else fail["error"]
        if fail["stage"] == "load":
            return f"Running the program failed: {head}" + (f"\nat: {fail['line']}" if fail["line"] else "")
        failing = fail["test"] or fail["line"]
        return f"A test failed: {failing}\n{head}" if failing else f"A test failed: {head}"

    def _run_io_tests(self, p: CodeProblem, program: str) -> tuple[int, int, str]:
        passed, feedback = 0, ""
        for given, expected in p.io:
            result = self.sandbox.run(program, stdin=given)
            self._count(result)
            limit = self._limit_feedback(result)
            if result.status == "sandbox_error":
                bad = "The sandbox failed to run the program; this answer was not judged."
            elif limit or result.exit_code != 0:
                bad = limit or "Runtime error: " + (plain_text(result.stderr).strip().splitlines() or ["(no message)"])[-1]
            elif _same_output(result.stdout, expected):
                passed += 1
                continue
            else:
                bad = (f"Wrong answer.\nInput:\n{cut_text(given, 150)}\nExpected:\n{cut_text(expected, 150)}\n"
                       f"Got:\n{cut_text(plain_text(result.stdout), 150)}")
            feedback = feedback or cut_text(bad, self.max_feedback_chars)
            if not self.partial_credit or result.status == "sandbox_error":
                break  # the reward is all or nothing: the first failure decides it
        return passed, len(p.io), feedback

    def _limit_feedback(self, result) -> str:
        if result.status == "timeout":
            return f"Time limit exceeded: the program ran over {self.limits.timeout_s:g} s (an endless loop?)."
        if result.status == "output_limit":
            return f"Output limit exceeded: the program wrote over {self.limits.max_output_bytes} bytes."
        if result.status == "killed":
            return "The program was killed (CPU time limit or a signal)."
        return ""
