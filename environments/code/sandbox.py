"""Run untrusted Python in an isolated, limited process: the one place code environments execute
what a model wrote.

    result = Sandbox(Limits(timeout_s=5)).run(source, stdin="")   # -> RunResult

The threat model: the program is an adversary that RL has optimised to collect reward. It must not
reach the verdict, the expected answers, the host or the next episode. Two isolation levels:

**``namespaces``** (the default; as root, or as any user where the kernel allows unprivileged user
namespaces, as bubblewrap uses them). A small trusted launcher, before it runs the program:

* enters new mount, PID, network, IPC and UTS namespaces (not root: inside a new user namespace that
  maps only the caller's own user and group ids);
* builds a new root from scratch (``pivot_root``; the host's root is detached): read-only, no-suid
  binds of ``/usr`` (and the merged ``/bin``, ``/lib*``), a few ``/etc`` files the dynamic linker
  reads, the interpreter's own prefix and the standard library. The interpreter's site-packages
  are hidden (``expose_packages=True`` shows them) and so is every path in ``hide`` (the problem
  files: the tests and the expected answers are never readable). Nothing else of the host — its
  home directories, the project, the data, ``/tmp``, ``/dev/shm``, other processes — exists there;
* mounts one small tmpfs (``disk_mb``, ``max_files`` inodes) for its working directory ``/work``,
  ``/tmp`` and ``/dev/shm``, a fresh ``/proc`` of its own PID namespace, and binds of ``/dev/null``,
  ``zero``, ``full``, ``random``, ``urandom``;
* sets rlimits: address space (``memory_mb``), CPU seconds, file size (``max_output_bytes``), open
  files, no core dumps, processes (as root: per worker slot's user id; otherwise the user's current
  count plus ``max_processes``); sets ``no_new_privs``; as root drops to a user id of its own per
  worker slot (``base_uid + slot``); a non-root launcher's capabilities end at the ``exec``;
* starts the program with an environment of five variables (nothing the host holds is inherited),
  its standard input from memory and its standard output / error into anonymous host files.

So: no network; no host process to see, signal or trace (its PID namespace holds only its own); no
host file to read or write beyond the read-only system files; SysV IPC, ``/tmp`` and ``/dev/shm``
die with the run; the disk it can fill is its tmpfs; when the program ends or is killed the kernel
kills everything it started, and nothing is left on the host's disk to clean up (the run's files
live in its tmpfs). What remains: a kernel exploit, and what the read-only system files hold.

**``none``** — only where the kernel refuses the namespaces, and only when asked
(``allow_unsandboxed=True``; otherwise ``Sandbox`` raises ``SandboxUnavailable`` naming the fix). The
program then runs with the rlimits above in a fresh host directory as the trainer's own user
(as root: a slot's user id): it can read whatever that user can (the problem file included), signal
and trace the trainer, write its files, reach the network and leave processes behind. Only for
programs you trust.

The parent waits at most ``timeout_s`` wall-clock seconds, then kills the program (and with it its
PID namespace). ``max_workers`` runs go on at once (a slot each); more wait for a free slot.
``start`` returns a handle for a run that talks to a trusted process while it runs (``judge.py``:
the program's function is called through a pipe, the tests never enter the sandbox).
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ISOLATION_LEVELS = ("namespaces", "none")
# The namespaces every isolated run enters: mount, PID, network, IPC, UTS (+ user, when not root).
UNSHARE_FLAGS = 0x20000 | 0x20000000 | 0x40000000 | 0x8000000 | 0x4000000

# The trusted part of the child: isolation and limits, then exec of the program's interpreter.
# argv[1]: a JSON object (the run's settings); the fd ``setup`` carries the program's files and
# standard input (JSON), read after the new root exists; the fd ``report`` gets "pid N" from the
# launcher and "error ..." from a setup that failed; it closes (on exec) when the program starts.
_LAUNCHER = r"""
import ctypes, fcntl, json, os, platform, resource, signal, sys
cfg = json.loads(sys.argv[1])

def high(fd):  # out of the way of fds 0-9, which the program's channels take
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 100)
    os.close(fd)
    return new

report, setup = high(cfg["report_fd"]), high(cfg["setup_fd"])
channels = [high(fd) for fd in cfg["channel_fds"]]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, NOATIME, NODIRATIME, BIND, REC, PRIVATE, RELATIME = (
    1, 2, 4, 8, 32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21)
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

def fail(what):
    os.write(report, ("error " + what.replace("\n", " ")[:500] + "\n").encode())
    os._exit(125)

def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        fail(f"{what}: {os.strerror(e)} (errno {e})")

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    return libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data))

def readonly(path):
    # A bind mount's flags change with a remount; inside a user namespace the flags the host set on
    # the source (nodev, noexec, ...) are locked, so they are kept.
    keep = 0
    try:
        f = os.statvfs(path).f_flag
        keep = ((NOEXEC if f & os.ST_NOEXEC else 0) | (NOATIME if f & os.ST_NOATIME else 0)
                | (NODIRATIME if f & os.ST_NODIRATIME else 0) | (RELATIME if f & getattr(os, "ST_RELATIME", 4096) else 0))
    except OSError:
        pass
    check(mount(None, path, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | keep), f"read-only remount of {path}")

def setup_root(root):
    check(mount(None, "/", None, REC | PRIVATE), "making / private")
    check(mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=8m,nr_inodes=4096,mode=0755"), f"tmpfs at {root}")
    for src in cfg["binds"]:
        dst = root + src
        if os.path.islink(src):  # a merged-/usr link such as /bin -> usr/bin
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.lexists(dst):
                os.symlink(os.readlink(src), dst)
            continue
        if not os.path.exists(src) or os.path.lexists(dst) and os.path.ismount(dst):
            continue
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "a").close()
        check(mount(src, dst, None, BIND | REC), f"bind of {src}")
        readonly(dst)
    for path in cfg["hide"]:  # site-packages, the problem files: an empty read-only tmpfs on top
        dst = root + path
        if os.path.isdir(dst):
            check(mount("tmpfs", dst, "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=4k,nr_inodes=16,mode=0555"),
                  f"hiding {path}")
        elif os.path.isfile(dst):
            check(mount("/dev/null", dst, None, BIND), f"hiding {path}")
    os.makedirs(root + "/dev", exist_ok=True)
    for name in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + name):
            open(root + "/dev/" + name, "a").close()
            check(mount("/dev/" + name, root + "/dev/" + name, None, BIND), f"bind of /dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    # One tmpfs, capped in bytes and inodes, for everything the program may write.
    scratch = root + "/.scratch"
    os.makedirs(scratch)
    owner = cfg["uid"] if cfg["uid"] >= 0 else os.getuid()
    group = cfg["uid"] if cfg["uid"] >= 0 else os.getgid()
    check(mount("tmpfs", scratch, "tmpfs", NOSUID | NODEV,
                f"size={cfg['disk_bytes']},nr_inodes={cfg['max_files']},mode=0755,uid={owner},gid={group}"),
          "the scratch tmpfs")
    for sub, where, mode in (("work", "/work", 0o700), ("tmp", "/tmp", 0o1777), ("shm", "/dev/shm", 0o1777)):
        os.makedirs(scratch + "/" + sub)
        os.chmod(scratch + "/" + sub, mode)
        os.chown(scratch + "/" + sub, owner, group)
        os.makedirs(root + where, exist_ok=True)
        check(mount(scratch + "/" + sub, root + where, None, BIND), f"bind of {where}")
    os.makedirs(root + "/proc", exist_ok=True)
    # A /proc of the new PID namespace; a kernel that refuses it (some containers) gets none.
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.chdir(root)
    os.makedirs(".old")
    number = PIVOT_ROOT.get(platform.machine())
    if number is not None and libc.syscall(number, b".", b".old") == 0:
        os.chdir("/")
        check(libc.umount2(b"/.old", 2), "detaching the old root")  # MNT_DETACH
        os.rmdir("/.old")
    else:
        os.rmdir(".old")
        os.chroot(".")
        os.chdir("/")
    check(libc.umount2(b"/.scratch", 2), "detaching the scratch mount point")
    readonly("/")
    return owner, group

def write_files(work, owner, group):
    data = b""
    while True:
        chunk = os.read(setup, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(setup)
    payload = json.loads(data)
    for name, text in payload["files"].items():
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write(text)
        if owner >= 0:
            os.chown(os.path.join(work, name), owner, group)
    fd = os.memfd_create("stdin")
    view = memoryview(payload["stdin"].encode())
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, 0)
    os.dup2(fd, 0)
    os.close(fd)

def limits(owner):
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS: no setuid or file caps
    if cfg["uid"] >= 0:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])

isolated = cfg["isolation"] == "namespaces"
if isolated:
    uid, gid = os.getuid(), os.getgid()
    flags = cfg["unshare_flags"] | (NEWUSER if cfg["user_namespace"] else 0)
    check(libc.unshare(flags), "unshare")
    if cfg["user_namespace"]:  # map only our own ids: inside, the program is who it was outside
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
child = os.fork()
if child:
    # The program's pid: on a time-out the parent kills it (its PID namespace goes with it) and this
    # launcher reaps it and ends the same way.
    os.close(setup)
    for fd in channels:
        os.close(fd)
    os.write(report, f"pid {child}\n".encode())
    os.close(report)
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))
os.set_inheritable(report, False)
try:
    if isolated:
        owner, group = setup_root(cfg["new_root"])
        work = "/work"
        try:
            libc.sethostname(b"sandbox", 7)
        except Exception:
            pass
    else:
        work = cfg["work"]
        owner = group = cfg["uid"]
    write_files(work, owner if cfg["uid"] >= 0 else -1, group)
    os.chdir(work)
    for target, fd in enumerate(channels, start=3):
        os.dup2(fd, target)
        os.close(fd)
    limits(owner)
except Exception as e:
    fail(f"{type(e).__name__}: {e}")
env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": "/tmp" if isolated else work, "LANG": "C.UTF-8",
       "PYTHONHASHSEED": "0"}
try:
    os.execve(cfg["python"], cfg["argv"], env)
except Exception as e:
    fail(f"exec of {cfg['python']}: {e}")
"""


class SandboxUnavailable(ValueError):
    """The kernel refused the isolation the sandbox needs (and unsandboxed runs were not allowed)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use."""

    timeout_s: float = 5.0  # wall clock
    memory_mb: int = 1024  # address space
    max_output_bytes: int = 64 * 1024  # stdout, stderr, and any one file the program writes
    max_processes: int = 32  # processes (see the module docstring)
    max_workers: int = 4  # runs at once
    disk_mb: int = 64  # its tmpfs: /work, /tmp and /dev/shm together
    max_files: int = 2048  # inodes of that tmpfs

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"sandbox limit {f.name}={value!r} must be a number > 0")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a run ended. ``status``: ``"exited"`` (``exit_code`` holds the code), ``"timeout"``,
    ``"killed"`` (a signal, e.g. the CPU limit), ``"output_limit"`` (it wrote past
    ``max_output_bytes``), ``"sandbox_error"`` (the launcher could not set the run up; ``stderr``
    says why — the program never ran). ``isolation``: the level it ran under."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: str

    @property
    def network_isolated(self) -> bool:
        return self.isolation == "namespaces"


class Running:
    """A started run: ``wait()`` it (or let the deadline pass), then ``finish()`` for its result.
    Always ``finish()`` (a ``with`` block does): it kills what is left and frees the slot."""

    def __init__(self, sandbox: "Sandbox", slot: int, proc: subprocess.Popen, program: int | None, error: str,
                 out, err, t0: float, work: Path | None):
        self.sandbox, self.slot, self.proc, self.program, self.error = sandbox, slot, proc, program, error
        self._out, self._err, self.t0, self._work = out, err, t0, work
        self.deadline = t0 + float(sandbox.limits.timeout_s)
        self._code: int | None = None
        self._timed_out = False
        self._result: RunResult | None = None

    def wait(self, until: float | None = None) -> bool:
        """Wait for the program to end, at most until ``until`` (monotonic; the run's deadline at
        the latest). True if it ended."""
        until = self.deadline if until is None else min(until, self.deadline)
        if self._code is None:
            try:
                self._code = self.proc.wait(timeout=max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._timed_out = time.monotonic() >= self.deadline
                return False
        return True

    def finish(self) -> RunResult:
        if self._result is not None:
            return self._result
        try:
            seconds = time.monotonic() - self.t0
            ended = self._code is not None
            self.sandbox._kill_all(self.proc, self.program, self.slot)
            code = self.proc.returncode if ended else None
            cap = int(self.sandbox.limits.max_output_bytes)
            self._out.seek(0)
            self._err.seek(0)
            out, err = self._out.read(cap + 1), self._err.read(cap + 1)
            if self.error:
                status, err = "sandbox_error", self.error.encode()
            elif not ended:
                status = "timeout"
            elif len(out) > cap or len(err) > cap:
                status = "output_limit"
            else:
                status = "exited" if code >= 0 else "killed"
            self._result = RunResult(status=status, exit_code=code if status in ("exited", "killed") else None,
                                     stdout=out[:cap].decode("utf-8", errors="replace"),
                                     stderr=err[:cap].decode("utf-8", errors="replace"), seconds=seconds,
                                     isolation=self.sandbox.isolation)
            return self._result
        finally:
            self._out.close()
            self._err.close()
            if self._work is not None:
                remove_tree(self._work)
            self.sandbox._slots.put(self.slot)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finish()


class Sandbox:
    """Runs programs under ``limits``; thread-safe (``max_workers`` at once).

    ``allow_unsandboxed``: where the kernel refuses the namespaces, run without them (see the module
    docstring) instead of raising ``SandboxUnavailable``. ``expose_packages``: show the interpreter's
    site-packages to the program (hidden by default: a package may ship the problems).
    ``hide``: host paths (files or directories) the program must not see even where they lie inside
    a tree it sees. ``python``: the interpreter programs run with (default: this one's base
    interpreter, never a virtualenv's, whose site-packages it would bring).
    """

    def __init__(self, limits: Limits = Limits(), *, allow_unsandboxed: bool = False, expose_packages: bool = False,
                 hide: tuple[str, ...] = (), base_uid: int = 61000, python: str | None = None,
                 isolation: str | None = None):
        self.limits = limits
        self.as_root = os.geteuid() == 0
        self.base_uid = base_uid
        self.python = os.path.realpath(python or getattr(sys, "_base_executable", None) or sys.executable)
        if not os.path.isfile(self.python):
            raise ValueError(f"the sandbox's interpreter {self.python} does not exist; set env.python to a python3")
        self.expose_packages = bool(expose_packages)
        self._slots: queue.Queue = queue.Queue()
        for slot in range(int(limits.max_workers)):
            self._slots.put(slot)
        self._paths = _interpreter_paths(self.python)
        self.hide = tuple(os.path.realpath(p) for p in hide) + (() if expose_packages else self._paths["site"])
        if isolation is not None and isolation not in ISOLATION_LEVELS:
            raise ValueError(f"isolation={isolation!r}; allowed: {', '.join(ISOLATION_LEVELS)}")
        self.isolation = isolation or "namespaces"
        probe = self.run("import sys; sys.stdout.write('ok')")
        if probe.status == "sandbox_error" and isolation is None:
            if not allow_unsandboxed:
                raise SandboxUnavailable(
                    f"the code sandbox cannot isolate programs on this machine ({probe.stderr.strip()}). Run as root, "
                    "or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
                    "user.max_user_namespaces > 0; on Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0), "
                    "or set config.env.allow_unsandboxed=True to run model-written programs without isolation "
                    "(they can then read and write your files, see the problems, reach the network)")
            self.isolation = "none"
            if self.as_root:  # the slot's user id runs the program on the host's own paths
                self.python = _runnable_by_all(self.python)
            probe = self.run("import sys; sys.stdout.write('ok')")
        if probe.status != "exited" or probe.stdout != "ok":
            raise SandboxUnavailable(f"the code sandbox cannot run {self.python} ({self.isolation}): {probe.status} "
                                     f"{probe.stderr.strip()[-500:]}")

    @property
    def network_isolated(self) -> bool:
        return self.isolation == "namespaces"

    def run(self, source: str, stdin: str = "", files: dict[str, str] | None = None) -> RunResult:
        """Run ``source`` as ``main.py`` (with ``files`` beside it), ``stdin`` on its standard input."""
        with self.start(source, stdin, files) as running:
            running.wait()
            return running.finish()

    def start(self, source: str, stdin: str = "", files: dict[str, str] | None = None,
              channel_fds: tuple[int, ...] = ()) -> Running:
        """Start ``source`` as ``main.py``; ``channel_fds`` (this process's fds) become the program's
        fds 3, 4, ... (the caller closes its own copies). Blocks while every slot is busy."""
        slot = self._slots.get()
        try:
            return self._start(slot, source, stdin, files or {}, tuple(channel_fds))
        except BaseException:
            self._slots.put(slot)
            raise

    def _start(self, slot: int, source: str, stdin: str, files: dict, channel_fds: tuple) -> Running:
        lim = self.limits
        uid = self.base_uid + slot if self.as_root else -1
        isolated = self.isolation == "namespaces"
        work = None
        if not isolated:
            work = Path(tempfile.mkdtemp(prefix=f"ragen-sandbox-{slot}-"))
            os.chmod(work, 0o700)
            if uid >= 0:
                os.chown(work, uid, uid)
        cap = int(lim.max_output_bytes)
        nproc = int(lim.max_processes) if self.as_root else _process_count(os.getuid()) + int(lim.max_processes)
        setup_r, setup_w = os.pipe()
        report_r, report_w = os.pipe()
        cfg = {
            "isolation": self.isolation, "user_namespace": not self.as_root, "uid": uid,
            "unshare_flags": UNSHARE_FLAGS,
            "memory_bytes": int(lim.memory_mb) << 20, "cpu_s": int(lim.timeout_s) + 1, "file_bytes": cap + 1,
            "nproc": nproc, "disk_bytes": int(lim.disk_mb) << 20, "max_files": int(lim.max_files),
            "binds": self._paths["binds"], "hide": list(self.hide), "new_root": self._paths["mount_point"],
            "work": str(work) if work else "", "setup_fd": setup_r, "report_fd": report_w,
            "channel_fds": list(channel_fds), "python": self.python,
            "argv": [self.python, "-I", "-B"] + ([] if self.expose_packages else ["-S"]) + ["main.py"],
        }
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    pass_fds=(setup_r, report_w) + channel_fds, env={}, start_new_session=True,
                                    close_fds=True)
        finally:
            os.close(setup_r)
            os.close(report_w)
        try:
            payload = json.dumps({"files": {"main.py": source, **files}, "stdin": stdin}).encode()
            with open(setup_w, "wb", closefd=True) as f:
                f.write(payload)
        except BrokenPipeError:
            pass  # the launcher failed before reading; its report says why
        program, error = None, ""
        for line in _read_lines(report_r, t0 + max(10.0, float(lim.timeout_s))):
            word, _, rest = line.partition(" ")
            if word == "pid":
                program = int(rest)
            elif word == "error":
                error = rest
        os.close(report_r)
        return Running(self, slot, proc, program, error, out, err, t0, work)

    def _kill_all(self, proc: subprocess.Popen, program: int | None, slot: int) -> None:
        """The program (its PID namespace with it) and, once the launcher has reaped it, the process
        group and (as root, without namespaces) every process of the run's user id; then reap."""
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
        if self.as_root and self.isolation == "none":
            # kill(-1) as that user signals every process it owns: escapees from the group included.
            uid = self.base_uid + slot
            subprocess.run([sys.executable, "-I", "-S", "-c",
                            f"import os, signal; os.setgid({uid}); os.setuid({uid}); os.kill(-1, signal.SIGKILL)"],
                           env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _runnable_by_all(python: str) -> str:
    """``python``, or where an unprivileged user id cannot run it (it lives under a private home)
    the system's python3."""
    def ok(path: str) -> bool:
        p = Path(path).resolve()
        return all(os.stat(d).st_mode & 0o001 for d in [*reversed(p.parents), p])
    for candidate in (python, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and ok(candidate):
            return os.path.realpath(candidate)
    raise SandboxUnavailable(f"without namespaces the sandbox runs programs as an unprivileged user, who cannot run "
                             f"{python} (a directory on its path is private) and there is no /usr/bin/python3; pass "
                             "an interpreter every user can run (env.python=/path/to/python3)")


def _read_lines(fd: int, until: float) -> list[str]:
    """Lines written to ``fd`` until it closes (or ``until`` passes)."""
    data = b""
    while time.monotonic() < until:
        ready, _, _ = select.select([fd], [], [], max(0.0, until - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", errors="replace").splitlines()


def _process_count(uid: int) -> int:
    """Processes (threads count too, as RLIMIT_NPROC counts them) of ``uid`` now."""
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}")
                if st.st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                pass
    return n


_PATHS_CACHE: dict = {}
_PATHS_LOCK = threading.Lock()


def _interpreter_paths(python: str) -> dict:
    """What the sandbox's root needs for ``python``: the directories to bind read-only, its
    site-packages (hidden unless exposed) and a mount point for the new root."""
    with _PATHS_LOCK:
        if python in _PATHS_CACHE:
            return _PATHS_CACHE[python]
        probe = subprocess.run(
            [python, "-I", "-c", "import json, site, sys; print(json.dumps([sys.prefix, sys.exec_prefix, "
             "site.getsitepackages(), [p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]]))"],
            capture_output=True, text=True, env={}, timeout=60)
        if probe.returncode != 0:
            raise ValueError(f"the sandbox's interpreter {python} does not run: {probe.stderr.strip()[-300:]}")
        prefix, exec_prefix, site_dirs, path_sites = json.loads(probe.stdout)
        binds = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
                 "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"]
        for p in (prefix, exec_prefix, os.path.dirname(python)):
            p = os.path.realpath(p)
            if not any(p == b or p.startswith(b.rstrip("/") + "/") for b in binds):
                binds.append(p)
        site = sorted({os.path.realpath(p) for p in site_dirs + path_sites + ["/usr/lib/python3/dist-packages"]
                       if os.path.isdir(p)})
        # The new root is built on a tmpfs mounted (in the run's own mount namespace) over a
        # directory nothing else needs.
        mount_point = next(d for d in ("/mnt", "/media", "/srv", "/opt", "/tmp")
                           if os.path.isdir(d) and not any(b == d or b.startswith(d + "/") for b in binds))
        _PATHS_CACHE[python] = {"binds": binds, "site": tuple(site), "mount_point": mount_point}
        return _PATHS_CACHE[python]


def remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it without raising, whatever a program left there:
    thousands of nested directories (past ``shutil.rmtree``'s recursion and past the longest path
    the kernel takes — each pass moves the grandchildren up to the top, so no path grows), modes
    of 000, names of any kind."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    moved = 0
    try:
        for _ in range(1_000_000):  # bounded: each pass removes or lifts at least one entry
            entries = list(os.scandir(top))
            if not entries:
                break
            for entry in entries:
                try:
                    if not entry.is_dir(follow_symlinks=False):
                        os.unlink(entry.name, dir_fd=top)
                        continue
                    os.chmod(entry.name, 0o700, dir_fd=top)
                    sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                    try:
                        for inner in list(os.scandir(sub)):
                            if inner.is_dir(follow_symlinks=False):
                                moved += 1
                                os.rename(inner.name, f".lifted-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                            else:
                                os.unlink(inner.name, dir_fd=sub)
                    finally:
                        os.close(sub)
                    os.rmdir(entry.name, dir_fd=top)
                except OSError:
                    pass
    except Exception:  # cleanup never aborts training; what is left stays in the temp directory
        pass
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass
