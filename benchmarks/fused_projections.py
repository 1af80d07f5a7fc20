"""Does fusing a decode step's projections pay on this machine? One layer's q / k / v and gate / up
matmuls for one new token per row, as separate matmuls against one fused [D, q+k+v] and one fused
[D, 2F] matmul (what ``fused QKV`` would change in the decoder), SmolLM2-135M's shapes by default.

    python benchmarks/fused_projections.py [--hidden 576 --q 576 --kv 192 --ffn 1536 --batches 16,64]

Prints microseconds per layer for each and the ratio separate / fused (best of 5 × 200 calls, jitted,
compilation excluded). Take figures from a run alone on the cores.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def _best(fn, *args, calls: int = 200) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--q", type=int, default=576)
    ap.add_argument("--kv", type=int, default=192)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--batches", default="16,64")
    a = ap.parse_args()
    D, F = a.hidden, a.ffn
    keys = jax.random.split(jax.random.key(0), 6)
    wq, wk, wv = (jax.random.normal(k, (D, n)) for k, n in zip(keys[:3], (a.q, a.kv, a.kv)))
    wg, wu = (jax.random.normal(k, (D, F)) for k in keys[3:5])
    wqkv, wgu = jnp.concatenate([wq, wk, wv], 1), jnp.concatenate([wg, wu], 1)

    @jax.jit
    def separate(x, wq, wk, wv, wg, wu):
        return (x @ wq).sum() + (x @ wk).sum() + (x @ wv).sum() + (jax.nn.silu(x @ wg) * (x @ wu)).sum()

    @jax.jit
    def fused(x, wqkv, wgu):
        gu = x @ wgu
        return (x @ wqkv).sum() + (jax.nn.silu(gu[..., :F]) * gu[..., F:]).sum()

    for batch in (int(b) for b in a.batches.split(",")):
        x = jax.random.normal(keys[5], (batch, 1, D))
        s, f = _best(separate, x, wq, wk, wv, wg, wu), _best(fused, x, wqkv, wgu)
        print(f"batch {batch:3d}: separate {s * 1e6:7.0f} us/layer  fused {f * 1e6:7.0f} us/layer  "
              f"separate / fused {s / f:.2f}x")


if __name__ == "__main__":
    main()
