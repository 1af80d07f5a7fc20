"""Shared test settings: float32 matmuls at full precision so comparisons against references are
exact, and one persistent XLA compilation cache for every test and subprocess.

Many tests build the same programs (the tiny trainer's steps, the rollout loop) from fresh closures,
which jit's in-memory cache cannot match; the persistent cache is keyed by the compiled program
itself (and the jax version and flags), so each is compiled once. It changes no numbers. Subprocess
tests (meshes, several processes, notebooks, the CLI) use it through ``JAX_COMPILATION_CACHE_DIR``.
It lives in ``~/.cache/ragen_jax/xla-tests``, so a second run on the same machine compiles little;
``RAGEN_JAX_TEST_CACHE=DIR`` puts it elsewhere (a new empty directory times a cold run).
"""
import os

import jax

jax.config.update("jax_default_matmul_precision", "highest")

_CACHE = os.environ.get("RAGEN_JAX_TEST_CACHE") or os.path.expanduser("~/.cache/ragen_jax/xla-tests")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
