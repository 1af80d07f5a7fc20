"""Asynchronous rollout against the synchronous loop: steps per second, same configs, same seeds.

    python benchmarks/async_overlap.py                       # both cases, 12 steps each
    python benchmarks/async_overlap.py --cases sokoban --steps 20 --out /tmp/async.md

Per case, two runs of the trainer, each in its own process (the CPU device count is fixed when jax
is imported):

  * ``synchronous``: one device (XLA's CPU device uses both cores inside each program); rollout, then
    update, every step (``trainer.max_staleness=0``);
  * ``async η=1``: two devices, the rollout on one (``mesh.rollout_devices=1``), the update on the
    other, the next step's rollout sampled while this step's update runs (``trainer.max_staleness=1``,
    AReaL's decoupled objective).

Cases: ``sokoban`` (``configs/sokoban.py``, tiny preset, on-device env) and ``search_latency``
(``configs/search_tools.py``, tiny preset, replies of at most 64 tokens in a 2,048-token transcript, a
host environment whose every step waits 50 ms, as a retrieval server would). No warm-up and no validation (their cost is the same in both loops); every
group trains (the filter keeps all). Steps per second are over the steps after the first
``--skip`` (which compile). The ratio is async / synchronous, from one invocation; timings are only
meaningful alone on the cores. Results: ``benchmarks/results_async_overlap.md``.

On a GPU or TPU node (``--accelerator``): the devices are the machine's own. The synchronous loop runs
both phases on all n devices (data parallel), the asynchronous one gives the rollout the last n / 2
(``mesh.rollout_devices``) and the update the rest; it needs n >= 2 and a batch the halves divide.
``--set key=value`` (repeatable) overrides the case's config, e.g. a real model:

    python benchmarks/async_overlap.py --accelerator --cases sokoban --steps 20 \
        --set model.preset=qwen2.5-0.5b --set model.path=/models/Qwen2.5-0.5B-Instruct \
        --set rollout.num_groups=16 --set rollout.group_size=8 --out benchmarks/results_async_overlap_gpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("sokoban", "search_latency")
LOOPS = {"synchronous": dict(devices=1, rollout_devices=0, staleness=0, policy_loss="ppo"),
         "async η=1": dict(devices=2, rollout_devices=1, staleness=1, policy_loss="decoupled_ppo")}
STEP_LATENCY_S = 0.05


def _config(case: str, workdir: str, steps: int, loop: dict, overrides=()):
    from ragen_jax.compare import apply_overrides, parse_value
    from ragen_jax.config import resolve

    if case == "sokoban":
        from configs import sokoban as module
    else:
        import environments
        from ragen_jax.tools.env import ToolSearchQA

        class SlowSearch(ToolSearchQA):
            """The tool task with a step that waits (a retrieval server's latency)."""

            def step(self, action):
                time.sleep(STEP_LATENCY_S)
                return super().step(action)

        environments.register("tool_search_slow", SlowSearch, host=True)
        from configs import search_tools as module
    c = module.get_config()
    if case != "sokoban":
        c.env.name = "tool_search_slow"
        # The untrained tiny model writes to its budget every turn: a shorter budget and transcript keep
        # the run within a 2-core machine's memory (the full config's update peaked above 15 GB).
        c.rollout.update(dict(max_new_tokens=64, max_seq_len=2048))
    c.workdir = workdir
    c.warmup.update(dict(steps=0, single_turn_steps=0))
    c.filter.update(dict(value=1.0, include_zero=True, dynamic_sampling_rounds=0, start_replay_fraction=0.0))
    c.trainer.update(dict(total_steps=steps, eval_every=0, eval_before_train=False, save_every=steps,
                          progress_bar=False, time_limit_minutes=0.0, max_staleness=loop["staleness"]))
    c.mesh.rollout_devices = loop["rollout_devices"]
    c.starpo.policy_loss = loop["policy_loss"]
    c.compilation_cache_dir = ""
    apply_overrides(c, [(key, parse_value(value)) for key, _, value in (o.partition("=") for o in overrides)])
    return resolve(c)


def worker(case: str, loop_name: str, steps: int, skip: int, out: str, accelerator: bool = False,
           overrides=()) -> None:
    loop = dict(LOOPS[loop_name])
    if not accelerator:  # two CPU devices, one per core
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={loop['devices']}"
    sys.path.insert(0, ROOT)
    import jax

    from ragen_jax.training.trainer import train
    if accelerator and loop["rollout_devices"]:
        n = jax.device_count()
        if n < 2:
            with open(out, "w") as f:
                json.dump({"skipped": f"{n} {jax.devices()[0].platform} device: the rollout needs devices of its own"}, f)
            return
        loop["rollout_devices"] = n // 2

    stamps, waits = [], []

    def on_step(step, metrics):
        stamps.append(time.time())
        waits.append(metrics.get("async/trainer_wait_s", metrics.get("timing_s/rollout", 0.0)))

    with tempfile.TemporaryDirectory() as workdir:
        train(_config(case, workdir, steps, loop, overrides), step_callback=on_step)
    timed = stamps[skip:]
    per_step = (timed[-1] - timed[0]) / (len(timed) - 1)
    with open(out, "w") as f:
        json.dump({"steps_per_s": 1.0 / per_step, "s_per_step": per_step,
                   "wait_s": sum(waits[skip + 1:]) / max(len(waits) - skip - 1, 1)}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the timing (they compile)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results_async_overlap.md"))
    ap.add_argument("--accelerator", action="store_true", help="the machine's GPUs/TPUs: half of them sample")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    ap.add_argument("--worker", nargs=4, metavar=("CASE", "LOOP", "OUT", "_"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        case, loop_name, out, _ = args.worker
        return worker(case, loop_name, args.steps, args.skip, out, args.accelerator, args.set)
    rows = []
    for case in args.cases.split(","):
        results = {}
        for loop_name in LOOPS:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                extra = (["--accelerator"] if args.accelerator else []) + [f"--set={o}" for o in args.set]
                subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--skip", str(args.skip),
                                *extra, "--worker", case, loop_name, tmp.name, "-"], check=True)
                with open(tmp.name) as f:
                    results[loop_name] = json.load(f)
            print(case, loop_name, results[loop_name], flush=True)
        base = results["synchronous"]["steps_per_s"]
        for loop_name, r in results.items():
            if "skipped" in r:
                rows.append(f"| {case} | {loop_name} | skipped: {r['skipped']} | | | |")
                continue
            rows.append(f"| {case} | {loop_name} | {r['s_per_step']:.2f} | {r['steps_per_s']:.3f} | "
                        f"{r['wait_s']:.2f} | {r['steps_per_s'] / base:.2f}× |")
    table = "\n".join(["| case | loop | s / step | steps / s | update waited for its batch, s / step | vs synchronous |",
                       "|---|---|---|---|---|---|", *rows])
    text = (f"# Asynchronous rollout vs the synchronous loop\n\n    python benchmarks/async_overlap.py --steps {args.steps}"
            f" --skip {args.skip}\n\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{time.strftime('%Y-%m-%d')}. Steps {args.skip + 1}-{args.steps} timed (the first compile).\n\n{table}\n")
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
