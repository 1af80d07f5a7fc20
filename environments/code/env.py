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

import json
import re
import threading

import numpy as np

from environments.code.problems import CodeProblem, load_problems, split_problems
from environments.code.sandbox import Limits, Sandbox

_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)

# Runs the answer and the tests in one interpreter inside the sandbox and writes outcome.json:
# {"passed": k, "failure": {...} | None} (the parent knows how many tests it sent). The answer's own output goes to stdout.
_HARNESS = r'''
import json, linecache, sys, traceback

def compiled(source, name):
    # Registered with linecache so a traceback can quote the failing line of code given as a string.
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return compile(source, name, "exec")

def where(e, name):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == name]
    return (frames[-1].line or "") if frames else ""

def failure(stage, e, name, test=""):
    return {"stage": stage, "error": type(e).__name__, "message": str(e)[:2000], "line": where(e, name), "test": test}

def finish(passed, fail):
    with open("outcome.json", "w") as f:
        json.dump({"passed": passed, "failure": fail}, f)
    sys.stdout.flush()

spec = json.load(open("spec.json"))
scope = {"__name__": "__solution__"}
try:
    exec(compiled(open("solution.py").read(), "solution.py"), scope)
    if not callable(scope.get(spec["entry_point"])):
        raise NameError(f"the program defines no function {spec['entry_point']}()")
except BaseException as e:
    finish(0, failure("load", e, "solution.py"))
    raise SystemExit(0)
passed, fail = 0, None
if spec["test"]:
    try:
        exec(compiled(spec["test"], "test.py"), scope)
        scope["check"](scope[spec["entry_point"]])
        passed += 1
    except BaseException as e:
        fail = failure("test", e, "test.py")
for i, test in enumerate(spec["tests"]):
    try:
        exec(compiled(test, f"test{i}.py"), scope)
        passed += 1
    except BaseException as e:
        fail = fail or failure("test", e, f"test{i}.py", test)
finish(passed, fail)
'''


def extract_program(answer: str) -> str:
    """The code of an answer: the inside of a Markdown fence when the whole answer is one."""
    m = _FENCE.match(answer)
    return m.group(1) if m else answer.strip("\n")


def _imports(prompt: str) -> str:
    return "".join(line + "\n" for line in prompt.splitlines() if line.startswith(("import ", "from ")))


def cut_text(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters, ``...`` marking the cut (feedback shown to the model)."""
    return text if len(text) <= n else text[: max(0, n - 3)] + "..."


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def _same_output(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing empty lines ignored."""
    return _lines(got) == _lines(expected)


class CodeEnv:
    """One coding problem per episode; answers run in the sandbox (see the module docstring)."""

    action_names = None  # free text: the program
    instruction = ("You are an expert Python programmer. Solve the problem with a complete Python program. Write "
                   "the whole program inside <answer> </answer>: for a function, its full definition with the imports "
                   "it needs; for a problem with input, a script that reads standard input and prints the answer. "
                   "If a test fails you will see it and may answer again.\n")
    _sandboxes: dict = {}  # one sandbox (one worker pool) per set of limits, shared by every row
    _lock = threading.Lock()

    def __init__(self, dataset: str = "humaneval", data_path: str | None = None, split: str = "train",
                 validation_fraction: float = 0.2, split_seed: int = 0, partial_credit: bool = False,
                 timeout_s: float = 5.0, memory_mb: int = 1024, max_workers: int = 4,
                 max_feedback_chars: int = 400, python: str | None = None):
        if not 0.0 <= float(validation_fraction) < 1.0:
            raise ValueError(f"config.env.validation_fraction={validation_fraction!r} must be in [0, 1)")
        self.problems = split_problems(load_problems(dataset, data_path), split, float(validation_fraction),
                                       int(split_seed))
        self.partial_credit = bool(partial_credit)
        self.max_feedback_chars = int(max_feedback_chars)
        self.limits = Limits(timeout_s=float(timeout_s), memory_mb=int(memory_mb), max_workers=int(max_workers))
        key = (self.limits, python)
        with CodeEnv._lock:
            if key not in CodeEnv._sandboxes:
                CodeEnv._sandboxes[key] = Sandbox(self.limits, python=python)
        self.sandbox = CodeEnv._sandboxes[key]
        self.parallel_steps = int(max_workers)  # HostEnv steps this many rows at once
        self.problem: CodeProblem | None = None

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
        text = "All tests passed." if solved else f"{feedback}\nPassed {passed}/{total} tests. Fix the program."
        return text, float(reward), solved, {"success": solved, "tests_passed": passed, "tests_total": total}

    # ---- execution ----------------------------------------------------------------------
    def run_tests(self, problem: CodeProblem, program: str) -> tuple[int, int, str]:
        """``(tests passed, tests, feedback on the first failure)`` of ``program`` on ``problem``."""
        if problem.function_style:
            return self._run_function_tests(problem, program)
        return self._run_io_tests(problem, program)

    def _run_function_tests(self, p: CodeProblem, program: str) -> tuple[int, int, str]:
        spec = {"entry_point": p.entry_point, "test": p.test or "", "tests": list(p.tests)}
        total = (1 if p.test else 0) + len(p.tests)
        result = self.sandbox.run(_HARNESS, files={"solution.py": _imports(p.prompt) + program,
                                                   "spec.json": json.dumps(spec)}, keep=("outcome.json",))
        limit = self._limit_feedback(result)
        if limit:
            return 0, total, limit
        try:
            outcome = json.loads(result.files.get("outcome.json", ""))
            passed, fail = int(outcome["passed"]), outcome["failure"]
        except (ValueError, KeyError, TypeError):
            # No report: the program ended the interpreter itself (exit(), os._exit, a crash).
            tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
            return 0, total, cut_text(f"The program stopped before the tests finished: {tail[0]}", self.max_feedback_chars)
        if fail is None:
            return passed, total, ""
        head = f"{fail['error']}: {fail['message']}".rstrip(": ") if fail["message"] else fail["error"]
        if fail["stage"] == "load":
            text = f"Running the program failed: {head}" + (f"\nat: {fail['line']}" if fail["line"] else "")
        else:
            failing = fail["test"] or fail["line"]
            text = f"A test failed: {failing}\n{head}" if failing else f"A test failed: {head}"
        return passed, total, cut_text(text, self.max_feedback_chars)

    def _run_io_tests(self, p: CodeProblem, program: str) -> tuple[int, int, str]:
        passed, feedback = 0, ""
        for given, expected in p.io:
            result = self.sandbox.run(program, stdin=given)
            limit = self._limit_feedback(result)
            if limit or result.exit_code != 0:
                bad = limit or "Runtime error: " + (result.stderr.strip().splitlines() or ["(no message)"])[-1]
            elif _same_output(result.stdout, expected):
                passed += 1
                continue
            else:
                bad = (f"Wrong answer.\nInput:\n{cut_text(given, 150)}\nExpected:\n{cut_text(expected, 150)}\n"
                       f"Got:\n{cut_text(result.stdout, 150)}")
            feedback = feedback or cut_text(bad, self.max_feedback_chars)
            if not self.partial_credit:
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
