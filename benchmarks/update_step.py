"""StarPO update step: where its time goes, and what blocked attention and the shared prompt save.

    python benchmarks/update_step.py                # the main job's model, one rollout batch
    python benchmarks/update_step.py --repeats 10

Builds the main job (``configs/frozen_lake.py``), rolls out one batch (32 rows of ``max_seq_len``
tokens) with its initial policy, and times the jitted update on that batch in this process, four
ways, with the same parameters:

  * ``one [T, T] softmax, whole rows``: causal attention as one masked softmax over every position
    (``attention_block_size=0``) and every row running the system prompt (``shared_prefix_len=0``);
  * ``blocked attention``: query blocks of 64 that skip the score blocks above the diagonal;
  * ``blocked + prompt once``: also the system prompt run once per batch (the trainer's setting);
  * ``filter empties the batch``: the trainer's setting on a batch whose groups all have equal
    rewards, which the main job's SNR filter drops (the mini-batches then do not run).

The first three keep every group (``top_p 1.0``, ``include_zero``) so both mini-batches run; before
timing, the script checks that they produce the same parameters. Prints best-of-N milliseconds and
speed-ups against the first.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from configs import frozen_lake  # noqa: E402
from ragen_jax.config import FilterConfig# noqa: E402
from ragen_jax.starpo.update import make_update_step  # noqa: E402
from ragen_jax.training import run as run_lib  # noqa: E402
from ragen_jax.config import resolve# noqa: E402


def best_of(fn, repeats: int) -> tuple[float, object]:
    out = fn()
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    spec = resolve(frozen_lake.get_config())
    run = run_lib.setup(spec)
    state = run.train_state
    traj = run.rollout(state.params, jax.random.key(0))
    prompt = len(run.rollout.codec.preamble_ids)
    policy = nnx.merge(run.graphdefs.policy, state.params, state.rest[0])
    keep_all = FilterConfig()

    def build(block: int, prefix: int, filt: FilterConfig):
        policy.cfg = policy.cfg.replace(attention_block_size=block)
        for layer in policy.layers:
            layer.self_attn.cfg = policy.cfg
        graphdefs = run.graphdefs._replace(policy=nnx.split(policy, nnx.Param, ...)[0])
        return make_update_step(graphdefs, spec.starpo, filt, spec.collapse, group_size=spec.rollout.group_size,
                                donate=False, shared_prefix_len=prefix)

    print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; main-job model, batch {traj.tokens.shape[0]} x "
          f"{traj.tokens.shape[1]} tokens (longest row {int(jnp.max(traj.lengths))}), system prompt {prompt} "
          f"tokens, mini-batch {spec.starpo.mini_batch_size}")
    print("| update | ms | speed-up |")
    print("|---|---|---|")
    base, params = None, None
    for name, block, prefix in (("one [T, T] softmax, whole rows", 0, 0), ("blocked attention", 64, 0),
                                ("blocked + prompt once", 64, prompt)):
        update = build(block, prefix, keep_all)
        seconds, (new_state, _) = best_of(lambda: update(state, traj), args.repeats)
        if params is None:
            params = new_state.params
        else:
            diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params),
                                                                       jax.tree.leaves(new_state.params)))
            assert diff < 1e-4, f"{name}: parameters differ from the plain update by {diff}"
        base = base or seconds
        print(f"| {name} | {seconds * 1e3:.0f} | {base / seconds:.2f}x |")
    update = build(64, prompt, spec.filter)
    flat = traj.replace(token_rewards=jnp.zeros_like(traj.token_rewards))
    seconds, (_, metrics) = best_of(lambda: update(state, flat), args.repeats)
    assert float(metrics["train/kept_rows"]) == 0.0
    print(f"| filter empties the batch | {seconds * 1e3:.0f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
