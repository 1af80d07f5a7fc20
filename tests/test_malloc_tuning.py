"""The restart with glibc's huge-page tunable (ragen_jax.malloc_tuning)."""
import os
import subprocess
import sys
import textwrap

import pytest

from ragen_jax import malloc_tuning as mt


def test_tuned_environment_adds_the_tunable_only_when_opted_in_and_supported():
    env = {"PATH": "/bin", "RAGEN_JAX_HUGE_PAGES": "1"}
    assert mt.tuned_environment(env, (2, 36), True) == {**env, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # Other tunables are kept, in front.
    out = mt.tuned_environment({**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 36), True)
    assert out["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # Nothing to do: not opted in (the default), opted in with anything but "1", already set (any
    # value), old or no glibc, huge pages off.
    assert mt.tuned_environment({"PATH": "/bin"}, (2, 36), True) is None
    assert mt.tuned_environment({"RAGEN_JAX_HUGE_PAGES": "0"}, (2, 36), True) is None
    assert mt.tuned_environment({**env, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), True) is None
    assert mt.tuned_environment(env, (2, 34), True) is None
    assert mt.tuned_environment(env, None, True) is None
    assert mt.tuned_environment(env, (2, 36), False) is None


# Allocates and touches a 64 MB block 10 times (above glibc's mmap threshold, as XLA's step
# temporaries are) and reports the minor page faults that took, after the restart if any.
PROBE = textwrap.dedent("""
    import os, resource, sys
    sys.path.insert(0, %r)
    from ragen_jax.malloc_tuning import reexec_with_huge_pages
    reexec_with_huge_pages()
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):  # plain malloc (numpy would advise huge pages itself)
        block = libc.malloc(64 << 20)
        ctypes.memset(block, 1, 64 << 20)
        libc.free(block)
    print(os.environ.get("GLIBC_TUNABLES"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(sys.platform != "linux" or mt._glibc_version() is None or mt._glibc_version() < (2, 35)
                    or not mt._huge_pages_allowed(), reason="needs glibc >= 2.35 and transparent huge pages")
def test_opted_in_restart_takes_the_tunable_and_cuts_page_faults(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE % os.path.dirname(os.path.dirname(os.path.abspath(mt.__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", mt.OPT_IN)}

    def run(extra):
        out = subprocess.run([sys.executable, str(script)], env={**env, **extra}, capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0], int(out[1])

    tunables, faults = run({mt.OPT_IN: "1"})
    plain_tunables, plain_faults = run({})  # the default: the process as started
    assert tunables == "glibc.malloc.hugetlb=1" and plain_tunables == "None"
    # 10 x 64 MB touched page by page: ~16,000 faults each with 4 KB pages, a few dozen with 2 MB ones.
    assert plain_faults > 100_000
    assert faults < plain_faults / 10
