"""Shared test settings: float32 matmuls at full precision so comparisons against references are
exact, and one persistent XLA compilation cache for the whole session.

Many tests build the same programs (the tiny trainer's steps, the rollout loop) from fresh closures,
which jit's in-memory cache cannot match; the persistent cache is keyed by the compiled program
itself, so each is compiled once per session. It changes no numbers. Subprocess tests (meshes,
several processes, notebooks, the CLI) inherit it through ``JAX_COMPILATION_CACHE_DIR``. The
directory is new for every session, so no result or timing depends on an earlier run; set
``RAGEN_JAX_TEST_CACHE=/some/dir`` to keep it across sessions on a development machine.
"""
import atexit
import os
import shutil
import tempfile

import jax

jax.config.update("jax_default_matmul_precision", "highest")

_CACHE = os.environ.get("RAGEN_JAX_TEST_CACHE")
if not _CACHE:
    _CACHE = tempfile.mkdtemp(prefix="ragen_jax_test_xla_")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
