"""Rollout tests compile large graphs (env generators, the whole multi-turn loop); a persistent
compilation cache makes repeated runs on a developer machine fast. It changes no numbers."""
import os
import tempfile

import jax

jax.config.update(
    "jax_compilation_cache_dir", os.environ.get("RAGEN_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "ragen_jax_rollout_xla"))
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
