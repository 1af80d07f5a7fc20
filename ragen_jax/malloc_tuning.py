"""Transparent huge pages for the large buffers XLA's CPU runtime allocates at every step (opt-in).

On a CPU, every jitted step allocates its large temporaries afresh. glibc serves blocks above its
mmap threshold with ``mmap``, and the kernel faults each page in on first touch. glibc's
``glibc.malloc.hugetlb=1`` tunable (glibc >= 2.35) asks for transparent huge pages on those blocks:
far fewer faults, but every fault zeroes a whole 2 MB page. Which costs more depends on the program
and the machine. Measured on a 2-core Intel Xeon VM (transparent huge pages ``madvise``), the same
programs with and without the tunable, identical numbers step for step:

- an earlier main-job run (FrozenLake warm-up, 400 first-turn steps): 169 million faults without, 1
  million with, 18% less CPU time with it;
- later on the same VM: FrozenLake's warm-up (300 first-turn + 100 conversation steps) 283 vs 276
  CPU seconds (even); its StarPO update 1.24 s vs 1.37 s a step (10% slower with); Sokoban's StarPO
  update **2.8 s vs 4.8–5.1 s** a step, two thirds of all CPU time spent in the kernel
  zeroing huge pages (``clear_page_erms`` under ``perf``).
- the whole main job (``configs/frozen_lake.py``, 2,400 first-turn + 300 conversation warm-up steps),
  run both ways back to back on another such VM: warm-up 790 s without, 734 s with (7% less wall
  time; system time 362 vs 349 s for the whole run).

So processes run as started by default. ``RAGEN_JAX_HUGE_PAGES=1`` opts in: an entry point
(``ragen_jax.launch``, ``ragen_jax.compare``) calls ``reexec_with_huge_pages()`` before it imports JAX
(glibc reads its tunables once, at start), and where the tunable is missing and the machine
supports it, the process replaces itself with the same command line plus the tunable (or set
``GLIBC_TUNABLES`` yourself). Time your own command both ways (wall and CPU seconds) before keeping it.
"""
from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_IN = "RAGEN_JAX_HUGE_PAGES"


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, OSError, ValueError):
        return None  # not glibc (musl, macOS, Windows)


def _huge_pages_allowed() -> bool:
    """Transparent huge pages are not switched off (``always`` or ``madvise``, which the tunable uses)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def tuned_environment(env: dict[str, str], glibc: tuple[int, int] | None, thp: bool) -> dict[str, str] | None:
    """The environment to restart with, or None to keep the process as it is: not opted in
    (``RAGEN_JAX_HUGE_PAGES=1``), not glibc >= 2.35, huge pages off, or ``GLIBC_TUNABLES`` already
    naming the tunable."""
    if env.get(OPT_IN, "0") != "1" or glibc is None or glibc < (2, 35) or not thp:
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if TUNABLE in current:
        return None
    return {**env, "GLIBC_TUNABLES": f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"}


def reexec_with_huge_pages() -> None:
    """Restart this process with ``glibc.malloc.hugetlb=1`` when opted in and supported (see the
    module docstring); returns only when nothing is to be done."""
    if sys.platform != "linux" or not getattr(sys, "orig_argv", None):
        return
    env = tuned_environment(dict(os.environ), _glibc_version(), _huge_pages_allowed())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
