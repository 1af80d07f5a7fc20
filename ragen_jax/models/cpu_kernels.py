"""Two CPU kernels of the decode loop (XLA FFI, ``kernels/*.cc``), chosen by ``model.cpu_kernels``.

- ``cache_attention``: attention of new tokens over one layer of the KV cache. XLA runs it as ~10
  small operations per cache block and copies every block out of the stacked cache before its two
  matmuls (a quarter of a SmolLM2-135M greedy decode step); the kernel reads each (row, kv head)'s
  filled slots in place, once for all of its query heads, with the softmax in between.
- ``packed_dense``: ``x @ W`` for the few rows of a decode step, with the weights repacked once per
  ``generate`` call (``pack_panels``) into panels that stream contiguously; float32 weights, or
  bfloat16 ones (``matmul_dtype="bfloat16"``: half the bytes per step). XLA's CPU matmul repacks a
  weight on every call, which on these shapes halves its speed.

``benchmarks/results_vs_vllm.md`` has the profile behind both. They are C++ compiled on first use with
the machine's C++ compiler (``$CXX``, else ``c++``) against the FFI headers jaxlib ships, into one
library cached under ``$RAGEN_JAX_KERNEL_DIR`` (default ``~/.cache/ragen_jax/kernels``) and keyed by
the sources, the flags, jaxlib and the CPU. Where it cannot be built (no compiler), ``available()`` is
False, ``why_unavailable()`` says why, and ``model.cpu_kernels="auto"`` keeps XLA's forms. Gradients,
which only scoring a continuation of a cached prompt needs, come from XLA's attention (recomputed in
the backward pass); ``generate`` alone packs weights, and it is never differentiated.
"""
from __future__ import annotations

import ctypes
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
import jaxlib

__all__ = ["available", "why_unavailable", "kernels_apply", "cache_attention", "packed_dense", "pack_panels",
           "PANEL"]

_KERNELS = Path(__file__).with_name("kernels")
_SOURCES = [_KERNELS / name for name in ("cache_attention.cc", "packed_dense.cc")]
_HEADERS = [_KERNELS / "parallel.h"]
_TARGETS = {"ragen_cache_attention": "RagenCacheAttention", "ragen_packed_dense": "RagenPackedDense",
            "ragen_packed_dense_bf16": "RagenPackedDenseBf16"}
PANEL = 32  # columns per weight panel (kernels/packed_dense.cc)
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

    include = jax.ffi.include_dir()
    key = hashlib.sha256("\n".join([*(s.read_text() for s in _SOURCES + _HEADERS), " ".join(_FLAGS), compiler,
                                    jaxlib.__version__, _cpu_model(), platform.machine()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("RAGEN_JAX_KERNEL_DIR", Path.home() / ".cache" / "ragen_jax" / "kernels"))
    lib = root / f"ragen_cpu_kernels_{key}.so"
    if lib.exists():
        return str(lib), ""
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: concurrent processes (pytest workers) never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        proc = subprocess.run([compiler, *_FLAGS, f"-I{include}", *map(str, _SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode:
            os.unlink(tmp)
            return None, f"compiling the CPU kernels failed: {proc.stderr.strip()[-2000:]}"
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building the CPU kernels failed: {e}"
    return str(lib), ""


@functools.cache
def _registered() -> bool:
    path, _ = _build()
    if path is None:
        return False

    library = ctypes.cdll.LoadLibrary(path)
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


def available() -> bool:
    """Whether the kernels are built (building them on first call) and registered with XLA."""
    return _registered()


def why_unavailable() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    return "" if _registered() else _build()[1]


def kernels_apply(mode: str, dtype) -> bool:
    """Whether ``model.cpu_kernels`` ``mode`` runs the kernels for computation in ``dtype`` here.

    "off": never. "on": always (an error where they cannot: not a CPU, not built, not float32).
    "auto": on a single-device CPU with float32 computation, when they build. Under a device mesh
    XLA's forms stay, which the partitioner can shard.
    """
    if mode == "off":
        return False
    if mode not in ("auto", "on"):
        raise ValueError(f"model.cpu_kernels must be 'auto', 'on' or 'off', got {mode!r}.")
    on_cpu = jax.default_backend() == "cpu"
    if mode == "on":
        if not on_cpu:
            raise ValueError(f"model.cpu_kernels='on' needs a CPU backend; use 'auto' or 'off' on "
                             f"{jax.default_backend()}.")
        if jnp.dtype(dtype) != jnp.float32:
            raise ValueError(f"model.cpu_kernels='on' needs float32 computation, got {jnp.dtype(dtype)}; use 'auto'.")
        if not available():
            raise RuntimeError(f"model.cpu_kernels='on': {why_unavailable()}; or use 'auto'.")
        return True
    return (on_cpu and jnp.dtype(dtype) == jnp.float32 and jax.device_count() == 1
            and jax.sharding.get_abstract_mesh().empty and available())


def pack_panels(w: jax.Array, transposed: bool = False) -> jax.Array:
    """A weight as ``packed_dense`` reads it: [K, N] -> [N / PANEL, K, PANEL] (``transposed``: [N, K],
    e.g. a tied embedding used as the logits' weight, -> the same panels of its transpose)."""
    if transposed:
        n, k = w.shape
        return jnp.transpose(w.reshape(n // PANEL, PANEL, k), (0, 2, 1))
    k, n = w.shape
    return jnp.transpose(w.reshape(k, n // PANEL, PANEL), (1, 0, 2))


def packed_dense(x: jax.Array, panels: jax.Array) -> jax.Array:
    """x float32 [..., K] @ W, W given as ``pack_panels(W)`` [N / PANEL, K, PANEL] -> float32 [..., N].

    Panels of a bfloat16 W: a bfloat16 matmul accumulated in float32 (x rounded to bfloat16 first, as
    ``dot(x.astype(bf16), W, preferred_element_type=f32)`` rounds it), reading half the bytes."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    n = panels.shape[0] * PANEL
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    if panels.dtype == jnp.bfloat16:
        rows = rows.astype(jnp.bfloat16).astype(jnp.float32)
        y = jax.ffi.ffi_call("ragen_packed_dense_bf16", out)(rows, jax.lax.bitcast_convert_type(panels, jnp.uint16))
    else:
        y = jax.ffi.ffi_call("ragen_packed_dense", out)(rows, panels)
    return y.reshape(*lead, n)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, layer, positions: jax.Array, reference) -> jax.Array:
    """Queries over layer ``layer`` of a stacked cache, by the kernel (float32 queries).

    q float32 [B, T, H, Hd]; k, v [L, B, K, S, Hd] float32 or uint16 (bfloat16 bits); positions int32
    [B, T] (query [b, t] sees slots ``<= positions[b, t]``) -> float32 [B, T, H, Hd]. A query with a
    negative position sees nothing and gets zeros. ``reference(q, k, v, layer, positions)`` is the XLA
    form, differentiated for the backward pass.
    """
    layer = jnp.asarray(layer, jnp.int32)
    positions = positions.astype(jnp.int32)

    def call(q, k, v, layer, positions):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return jax.ffi.ffi_call("ragen_cache_attention", out)(q, k, v, layer, positions)

    # layer and positions are arguments, not closed over: a backward rule that closes over values
    # traced by an enclosing scan or remat (the layer index of a scanned model) leaks them.
    @jax.custom_vjp
    def attend(q, k, v, layer, positions):
        return call(q, k, v, layer, positions)

    def forward(q, k, v, layer, positions):
        return call(q, k, v, layer, positions), (q, k, v, layer, positions)

    def backward(res, g):
        q, k, v, layer, positions = res
        if jnp.issubdtype(k.dtype, jnp.integer):  # a cache held as bits has no gradient
            _, vjp = jax.vjp(lambda q: reference(q, k, v, layer, positions), q)
            return vjp(g) + (None, None, None, None)
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, layer, positions), q, k, v)
        return vjp(g) + (None, None)

    attend.defvjp(forward, backward)
    return attend(q, k, v, layer, positions)
