"""Attention over the KV cache as one CPU kernel per layer (``kernels/cache_attention.cc``, XLA FFI).

On a CPU, XLA runs cached attention as ~10 small operations per cache block and copies every block
out of the stacked cache before its two matmuls; in a SmolLM2-135M greedy decode that is a quarter of
the step. The kernel reads each (row, kv head)'s filled slots in place, once for all of its query
heads, with the softmax in between (``benchmarks/results_vs_vllm.md``).

It is C++ compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++``) against the
FFI headers jaxlib ships, cached under ``$RAGEN_JAX_KERNEL_DIR`` (default ``~/.cache/ragen_jax/kernels``)
and keyed by the source, the flags, jaxlib and the CPU. Where it cannot be built (no compiler),
``available()`` is False, ``why_unavailable()`` says why, and ``model.cache_attention="auto"`` uses
XLA's blocked attention instead. Gradients, which only scoring a continuation of a cached prompt
needs, come from that XLA form (recomputed in the backward pass).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

__all__ = ["available", "why_unavailable", "cache_attention", "kernel_applies"]

_SOURCE = Path(__file__).with_name("kernels") / "cache_attention.cc"
_TARGET = "ragen_cache_attention"
# Flags that let the compiler vectorise the dot products and sums (reassociation) without giving up
# IEEE special values; -march=native because the library is built where it runs.
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@functools.cache
def _build() -> tuple[str | None, str]:
    """(path of the built library or None, why not)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        return None, "no C++ compiler found (install g++ or clang++, or set $CXX)"
    import jaxlib

    include = jax.ffi.include_dir()
    key = hashlib.sha256("\n".join([_SOURCE.read_text(), " ".join(_FLAGS), compiler, jaxlib.__version__,
                                    _cpu_model(), platform.machine()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("RAGEN_JAX_KERNEL_DIR", Path.home() / ".cache" / "ragen_jax" / "kernels"))
    lib = root / f"cache_attention_{key}.so"
    if lib.exists():
        return str(lib), ""
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent processes (pytest workers) never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        proc = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode:
            os.unlink(tmp)
            return None, f"compiling {_SOURCE.name} failed: {proc.stderr.strip()[-2000:]}"
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {_SOURCE.name} failed: {e}"
    return str(lib), ""


@functools.cache
def _registered() -> bool:
    path, _ = _build()
    if path is None:
        return False
    import ctypes

    library = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.RagenCacheAttention), platform="cpu")
    return True


def available() -> bool:
    """Whether the kernel is built (building it on first call) and registered with XLA."""
    return _registered()


def why_unavailable() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return "" if _registered() else _build()[1]


def kernel_applies(mode: str, q: jax.Array) -> bool:
    """Whether ``model.cache_attention`` ``mode`` runs the kernel for queries ``q`` here.

    "xla": never. "kernel": always (an error where it cannot: not a CPU, not built, not float32).
    "auto": on a single-device CPU with float32 queries, when the kernel builds. Under a device mesh
    the XLA form stays, which the partitioner can shard.
    """
    if mode == "xla":
        return False
    if mode not in ("auto", "kernel"):
        raise ValueError(f"model.cache_attention must be 'auto', 'kernel' or 'xla', got {mode!r}.")
    on_cpu = jax.default_backend() == "cpu"
    if mode == "kernel":
        if not on_cpu:
            raise ValueError("model.cache_attention='kernel' is a CPU kernel; use 'auto' or 'xla' on "
                             f"{jax.default_backend()}.")
        if q.dtype != jnp.float32:
            raise ValueError(f"model.cache_attention='kernel' needs float32 compute, got {q.dtype}; use 'auto'.")
        if not available():
            raise RuntimeError(f"model.cache_attention='kernel': {why_unavailable()}; or use 'auto'.")
        return True
    return (on_cpu and q.dtype == jnp.float32 and jax.device_count() == 1
            and jax.sharding.get_abstract_mesh().empty and available())


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer, positions: jax.Array, reference) -> jax.Array:
    """Queries over layer ``layer`` of a stacked cache, by the kernel.

    q float32 [B, T, H, Hd]; k, v [L, B, K, S, Hd] float32 or uint16 (bfloat16 bits); positions int32
    [B, T] (query [b, t] sees slots ``<= positions[b, t]``) -> float32 [B, T, H, Hd]. A query with a
    negative position sees nothing and gets zeros. ``reference(q, k, v, layer, positions)`` is the XLA
    form, differentiated for the backward pass.
    """
    layer = jnp.asarray(layer, jnp.int32)
    positions = positions.astype(jnp.int32)

    def call(q, k, v):
        return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, layer, positions)

    @jax.custom_vjp
    def attend(q, k, v):
        return call(q, k, v)

    def forward(q, k, v):
        return call(q, k, v), (q, k, v)

    def backward(res, g):
        q, k, v = res
        if jnp.issubdtype(k.dtype, jnp.integer):  # a cache held as bits has no gradient
            _, vjp = jax.vjp(lambda q: reference(q, k, v, layer, positions), q)
            return vjp(g) + (None, None)
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, layer, positions), q, k, v)
        return vjp(g)

    attend.defvjp(forward, backward)
    return attend(q, k, v)
