"""Behaviour-cloning step: the shared-system-prompt pass against the plain full-sequence pass.

    python benchmarks/bc_step.py                   # the main job's model and demonstrations
    python benchmarks/bc_step.py --repeats 50 --batch 8 16

Builds the main job (``configs/frozen_lake.py``), produces first-turn and whole-conversation expert
demonstrations exactly as the warm-up does, and times one jitted BC step (forward, backward, AdamW)
both ways on the same batches, in this process: ``prefix_len=0`` (every row runs the whole
sequence) and ``prefix_len=shared_prefix_length(...)`` (the system prompt once per batch, its
keys/values broadcast to the rows). Before timing it checks that both give the same loss. Prints
milliseconds per step and the speed-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import frozen_lake  # noqa: E402
from ragen_jax.training import run as run_lib, warmup  # noqa: E402
from ragen_jax.config import resolve# noqa: E402


def time_step(step, params, opt_state, batch, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of one step (compiled first); also returns the loss."""
    out = step(params, opt_state, *batch)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(params, opt_state, *batch))
        best = min(best, time.perf_counter() - t)
    return best, float(out[2]["loss"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--states", type=int, default=64, help="demonstrations per phase")
    args = ap.parse_args()

    spec = resolve(frozen_lake.get_config())
    run = run_lib.setup(spec)
    params = run.train_state.params
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.0))
    opt_state = tx.init(params)
    print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; main-job model "
          f"({sum(x.size for x in jax.tree.leaves(params)):,} parameters)")
    print("| demonstrations | batch | width | shared prefix | full pass ms | shared-prefix ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, rollout in (("first turn", warmup.first_turn_rollout(run.rollout)), ("whole conversation", run.rollout)):
        (tokens, loss_mask, valid_mask), _, _ = warmup.bc_data(warmup.demonstrations(rollout, params, args.states, 0))
        prefix = warmup.shared_prefix_length(np.asarray(tokens), np.asarray(loss_mask & valid_mask))
        for b in args.batch:
            batch = (tokens[:b], loss_mask[:b], valid_mask[:b])
            full, loss_full = time_step(warmup.make_bc_step(run.graphdefs.policy, tx), params, opt_state, batch,
                                        args.repeats)
            shared, loss_shared = time_step(warmup.make_bc_step(run.graphdefs.policy, tx, prefix), params,
                                            opt_state, batch, args.repeats)
            if not np.isclose(loss_full, loss_shared, rtol=1e-5):
                raise SystemExit(f"losses differ: full {loss_full} vs shared prefix {loss_shared}")
            print(f"| {name} | {b} | {tokens.shape[1]} | {prefix} | {1e3 * full:.0f} | {1e3 * shared:.0f} | "
                  f"{full / shared:.2f}x |")


if __name__ == "__main__":
    main()
