"""What the device mesh costs on one device: the main job's StarPO step with and without it.

    python benchmarks/mesh_overhead.py              # best of 5
    python benchmarks/mesh_overhead.py --repeats 10

Builds the main job (``configs/frozen_lake.py``) twice in this process: as the trainer runs it (a
``Placement`` over a one-device mesh: rollout and update jitted through it, with explicit state
shardings and sharding constraints) and as plain ``jax.jit`` functions (no placement). Times one
rollout + one update (the trainer's step) of each, alternating, best of N, with the main job's SNR
filter (which empties the initial policy's batch) and with every group kept (the mini-batches run);
checks that both produce the same trajectory and the same parameters. Prints milliseconds and ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import frozen_lake  # noqa: E402
from ragen_jax.rollout.loop import make_rollout# noqa: E402
from ragen_jax.starpo.update import make_update_step  # noqa: E402
from ragen_jax.training import run as run_lib  # noqa: E402
from ragen_jax.config import resolve# noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    spec = resolve(frozen_lake.get_config())
    run = run_lib.setup(spec)  # the trainer's build: the one-device mesh
    plain_rollout = make_rollout(run.graphdefs.policy, run.env, run.env_params, run.tokenizer, spec.rollout)
    def updates(filt):
        kw = dict(group_size=spec.rollout.group_size, shared_prefix_len=len(plain_rollout.codec.preamble_ids),
                  per_turn_rows=plain_rollout.per_turn_rows)
        return (make_update_step(run.graphdefs, spec.starpo, filt, spec.collapse, placement=run.placement,
                                 state_shardings=run.state_shardings, **kw),
                make_update_step(run.graphdefs, spec.starpo, filt, spec.collapse, **kw))
    copy = jax.jit(lambda s: jax.tree.map(lambda x: x.copy(), s))
    state0 = run.train_state
    key = jax.random.key(0)

    def step(rollout, update):
        state = copy(state0)  # the update donates its input
        jax.block_until_ready(state)
        t = time.perf_counter()
        traj = rollout(state.params, key)
        new_state, metrics = update(state, traj)
        jax.block_until_ready((new_state, metrics))
        return time.perf_counter() - t, traj, new_state

    print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; main job, one rollout ({spec.rollout.batch_size} "
          f"episodes) + one update, best of {args.repeats}")
    print("| StarPO step | update | plain jax.jit, ms | one-device mesh (the trainer), ms | ratio | same numbers |")
    print("|---|---|---|---|---|---|")
    keep_all = dataclasses.replace(spec.filter, value=1.0, include_zero=True)
    for label, filt in (("main job's filter (empties this batch: no mini-batch runs)", spec.filter),
                        ("every group kept (2 mini-batches run)", keep_all)):
        mesh_update, plain_update = updates(filt)
        _, traj_a, state_a = step(run.rollout, mesh_update)
        _, traj_b, state_b = step(plain_rollout, plain_update)
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree.leaves((traj_a, state_a.params)), jax.tree.leaves((traj_b, state_b.params))))
        best = {"mesh": float("inf"), "plain": float("inf")}
        for _ in range(args.repeats):
            best["mesh"] = min(best["mesh"], step(run.rollout, mesh_update)[0])
            best["plain"] = min(best["plain"], step(plain_rollout, plain_update)[0])
        print(f"| rollout + update | {label} | {best['plain'] * 1e3:.0f} | {best['mesh'] * 1e3:.0f} | "
              f"{best['mesh'] / best['plain']:.3f}x | {same} |")


if __name__ == "__main__":
    main()
