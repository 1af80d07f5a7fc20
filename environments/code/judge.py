"""The tests of a function-style problem, run where the program cannot reach them.

The program runs in the sandbox (``sandbox.py``) under a small server: it loads the program, then
answers calls of its function that arrive on a pipe, returning each result (or the exception) as
plain data (``plain_data.py``). The tests run in a separate trusted process, the judge: it runs the
problem's prompt (for helpers such as HumanEval's ``poly``) and its test code with the function's
name bound to a proxy that calls through the pipe, counts the tests that pass, and reports the
verdict on its own standard output, which only the host reads.

So the expected answers and the verdict never enter the program's process: writing a verdict file,
patching the harness, ``exec`` or ``builtins``, exiting early, ``atexit`` hooks, threads and
children that write after the run, objects whose ``__eq__`` always holds — none of it reaches what
the judge compares or reports. All the program controls is the plain data its function returns.

Limits of the design, said plainly: a test sees the function's return value, not arguments it
mutated in place (a test that checks a mutation fails); tests may call the entry point and the
prompt's own helpers, not other functions the program defines; test code runs with the standard
library only (the judge starts with ``python -I -S``).

    verdict = run_function_tests(sandbox, prelude=prompt, program=program, test=check_program,
                                 tests=asserts, entry_point="f")
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from environments.code.sandbox import RunResult, Sandbox

_PLAIN_DATA = (Path(__file__).parent / "plain_data.py").read_text(encoding="utf-8")
MAX_MESSAGE_BYTES = 4 << 20  # one call's arguments or result

# Inside the sandbox (untrusted: the program can change any of it; it only ever sends data).
_SERVER = _PLAIN_DATA + r'''
import json, linecache, os, sys, traceback

def _send(obj):
    try:
        data = (json.dumps(obj) + "\n").encode()
    except (TypeError, ValueError, RecursionError) as e:
        data = (json.dumps({"raise": ["TypeError", f"a result that plain data cannot carry: {e}"[:500], ""]}) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(4, view):]

def _failure(e, name):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == name]
    return [type(e).__name__, str(e)[:2000], (frames[-1].line or "") if frames else ""]

_spec = json.load(open("spec.json"))
_source = open("solution.py").read()
linecache.cache["solution.py"] = (len(_source), None, _source.splitlines(True), "solution.py")
_scope = {"__name__": "__solution__"}
try:
    exec(compile(_source, "solution.py", "exec"), _scope)
    _fn = _scope.get(_spec["entry_point"])
    if not callable(_fn):
        raise NameError(f"the program defines no function {_spec['entry_point']}()")
except BaseException as e:
    _send({"load": _failure(e, "solution.py")})
    raise SystemExit(0)
_send({"ready": True})
with os.fdopen(3, "rb") as _calls:
    for _line in _calls:
        _call = json.loads(_line)
        try:
            _value = _fn(*decode(_call["args"]), **decode(_call["kwargs"]))
            _reply = {"value": encode(_value)}
        except BaseException as e:
            _reply = {"raise": _failure(e, "solution.py")}
        _send(_reply)
'''

# The judge (trusted): the only process that sees the tests, and the one that reports the verdict.
_JUDGE = _PLAIN_DATA + r'''
import builtins, json, linecache, os, select, sys, time, traceback

class Abort(BaseException):
    """The program stopped answering (ended, hung, spoke garbage): the tests left fail."""
    def __init__(self, why):
        self.why = why

class CandidateError(Exception):
    """An exception the program's function raised, of a type that is not one of Python's built-ins."""

ERRORS = {n: t for n, t in vars(builtins).items() if isinstance(t, type) and issubclass(t, Exception)}
spec = json.loads(sys.stdin.read())
deadline = time.monotonic() + spec["timeout_s"]
calls, results = spec["calls_fd"], spec["results_fd"]
os.set_blocking(calls, False)
buffer = bytearray()

def wait(fd, writing):
    left = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(left, 0))[1] if writing else select.select([fd], [], [], max(left, 0))[0]
    if left <= 0 or not ready:
        raise Abort("timeout")

def send(obj):
    view = memoryview((json.dumps(obj) + "\n").encode())
    while view:
        wait(calls, True)
        try:
            view = view[os.write(calls, view):]
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            raise Abort("ended")

def receive():
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line = bytes(buffer[:end])
            del buffer[:end + 1]
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):
                raise Abort("garbled")
            if type(message) is not dict:
                raise Abort("garbled")
            return message
        if len(buffer) > spec["max_message_bytes"]:
            raise Abort("garbled")
        wait(results, False)
        chunk = os.read(results, 1 << 16)
        if not chunk:
            raise Abort("ended")
        buffer.extend(chunk)

def candidate_error(info):
    if type(info) is not list or len(info) != 3:
        raise Abort("garbled")
    name, text, line = (str(x) for x in info)
    cls = ERRORS.get(name[:100])
    try:
        error = cls(text[:2000]) if cls else CandidateError(f"{name[:100]}: {text[:2000]}")
    except Exception:
        error = CandidateError(f"{name[:100]}: {text[:2000]}")
    error.candidate_line = line[:500]
    return error

class Candidate:
    """The program's function, called through the pipe; returns what the judge decoded."""
    def __init__(self, name):
        self.__name__ = self.__qualname__ = name
    def __repr__(self):
        return f"<the program's {self.__name__}>"
    def __call__(self, *args, **kwargs):
        try:
            call = {"args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        except Exception as e:
            raise TypeError(f"the test passes an argument plain data cannot carry ({e})") from None
        send(call)
        reply = receive()
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (PlainDataError, RecursionError, ValueError, TypeError, OverflowError, MemoryError) as e:
                raise CandidateError(f"the function returned something that is not plain data ({e})") from None
        if "raise" in reply:
            raise candidate_error(reply["raise"])
        raise Abort("garbled")

def compiled(source, name):
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return compile(source, name, "exec")

def describe(stage, e, name, test=""):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == name]
    return {"stage": stage, "error": type(e).__name__, "message": str(e)[:2000],
            "line": (frames[-1].line or "") if frames else "", "test": test}

scope = {"__name__": "__judge__"}
try:  # the prompt's helpers (HumanEval's tests call some); a prompt in prose is no code
    exec(compile(spec["prelude"], "prompt.py", "exec"), scope)
except Exception:
    pass
candidate = Candidate(spec["entry_point"])
scope[spec["entry_point"]] = candidate
passed, failure, stopped = 0, None, None
try:
    first = receive()
    if "load" in first:
        error = candidate_error(first["load"])
        failure = {"stage": "load", "error": type(error).__name__ if not isinstance(error, CandidateError) else
                   str(first["load"][0])[:100], "message": str(first["load"][1])[:2000],
                   "line": error.candidate_line, "test": ""}
        stopped = "load"
    elif first.get("ready") is not True:
        raise Abort("garbled")
    else:
        units = ([("test.py", spec["test"], "")] if spec["test"] else []) + \
            [(f"test{i}.py", t, t) for i, t in enumerate(spec["tests"])]
        for name, code, shown in units:
            try:
                exec(compiled(code, name), scope)
                if name == "test.py":
                    scope["check"](candidate)
                passed += 1
            except Abort:
                raise
            except BaseException as e:
                failure = failure or describe("test", e, name, shown)
except Abort as a:
    stopped = a.why
sys.stdout.write(json.dumps({"passed": passed, "failure": failure, "stopped": stopped}) + "\n")
'''


@dataclasses.dataclass(frozen=True)
class FunctionVerdict:
    """What the judge found. ``passed`` of ``total`` tests; ``failure``: the first failing test
    (``stage`` load | test, ``error``, ``message``, ``line``, ``test``) or None; ``stopped``: why the
    program stopped answering (``load``, ``ended``, ``timeout``, ``garbled``) or None; ``judge_error``:
    the judge itself failed (then nothing passed); ``run``: how the program's run ended."""

    passed: int
    total: int
    failure: dict | None
    stopped: str | None
    judge_error: str | None
    run: RunResult


def run_function_tests(sandbox: Sandbox, *, prelude: str, program: str, test: str, tests: tuple[str, ...],
                       entry_point: str, judge_python: str | None = None) -> FunctionVerdict:
    """Run ``program``'s ``entry_point`` against ``test`` (a program defining ``check(candidate)``)
    and ``tests`` (statements run one by one) with the judge outside the sandbox."""
    total = (1 if test else 0) + len(tests)
    calls_r, calls_w = os.pipe()
    results_r, results_w = os.pipe()
    try:
        running = sandbox.start(_SERVER, files={"solution.py": program,
                                                "spec.json": json.dumps({"entry_point": entry_point})},
                                channel_fds=(calls_r, results_w))
    except BaseException:
        for fd in (calls_w, results_r):
            os.close(fd)
        raise
    finally:
        os.close(calls_r)
        os.close(results_w)
    with running:
        if running.error:
            os.close(calls_w)
            os.close(results_r)
            return FunctionVerdict(0, total, None, None, None, running.finish())
        try:
            judge = subprocess.Popen([judge_python or sys.executable, "-I", "-S", "-c", _JUDGE],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=(calls_w, results_r), env={"PATH": os.defpath})
        finally:
            os.close(calls_w)
            os.close(results_r)
        spec = {"prelude": prelude, "test": test or "", "tests": list(tests), "entry_point": entry_point,
                "calls_fd": calls_w, "results_fd": results_r, "max_message_bytes": MAX_MESSAGE_BYTES,
                "timeout_s": max(0.0, running.deadline - time.monotonic())}
        try:
            out, err = judge.communicate(json.dumps(spec).encode(), timeout=spec["timeout_s"] + 10)
        except subprocess.TimeoutExpired:
            judge.kill()
            out, err = judge.communicate()
        # The verdict is in; the server ends when the judge's pipe closes (a program that lingers
        # past a short grace is killed, and its run reads as a time-out).
        running.wait(until=time.monotonic() + 0.5)
        result = running.finish()
    try:
        verdict = json.loads(out.decode().strip().splitlines()[-1])
        passed, failure, stopped = verdict["passed"], verdict["failure"], verdict["stopped"]
        if type(passed) is not int or not 0 <= passed <= total or not (failure is None or type(failure) is dict) \
                or not (stopped is None or type(stopped) is str):
            raise ValueError("malformed verdict")
        if failure is not None:
            failure = {k: str(failure.get(k, ""))[:2000] for k in ("stage", "error", "message", "line", "test")}
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError):
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {judge.returncode}"]
        return FunctionVerdict(0, total, None, None, tail[0][:500], result)
    return FunctionVerdict(passed, total, failure, stopped, None, result)
