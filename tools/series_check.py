"""Same seeds, same numbers: record every logged scalar of two fixed-seed 5-step runs, or compare
two recordings bit for bit (a refactor must not change a single value).

    python tools/series_check.py record before.json
    python tools/series_check.py record after.json
    python tools/series_check.py compare before.json after.json [--rename old=new ...] [--merged old=kept ...]

The runs: the tests' small FrozenLake config (``tests/training/test_trainer.small_config_dict``),
and the same with GAE, a separate critic, a KL penalty against the reference and LoRA adapters;
then the shipped configs cut to a few steps: the main job (``configs/frozen_lake.py``, with a short
warm-up of both phases and a validation), Sokoban (``configs/sokoban.py``), Sokoban with GiGPO, and
Sokoban with PPO (GAE and a critic).
Wall-clock timings are left out; values are stored as ``float.hex`` so the comparison is exact.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Every group kept (filter.value=1.0, include_zero): the tests' small runs score every episode alike,
# so with the SNR filter on they would never reach the loss, the gradients or the optimizer.
_TRAIN = {"filter.value": 1.0, "filter.include_zero": True}
RUNS = {
    "frozen_lake_small": {**_TRAIN},
    "gae_critic_kl_lora": {**_TRAIN, "starpo.adv_estimator": "gae", "starpo.critic": "separate",
                           "starpo.use_kl_loss": True, "starpo.kl_coef": 0.01, "model.lora_rank": 4},
}

# A shipped config cut to a few cheap steps: a short warm-up (both phases), a small validation.
_SHORT = {"trainer.total_steps": 3, "trainer.time_limit_minutes": 0, "trainer.eval_every": 2,
          "trainer.progress_bar": False, "warmup.single_turn_steps": 3, "warmup.steps": 3,
          "eval.num_episodes": 8, "rollout.num_groups": 2, "compilation_cache_dir": ""}
CONFIG_RUNS = {
    "main_job": ("configs/frozen_lake.py", {**_SHORT, **_TRAIN}),
    "sokoban": ("configs/sokoban.py", {**_SHORT, **_TRAIN}),
    "sokoban_gigpo": ("configs/sokoban.py", {**_SHORT, **_TRAIN, "starpo.adv_estimator": "gigpo"}),
    "sokoban_ppo": ("configs/sokoban.py", {**_SHORT, **_TRAIN, "starpo.adv_estimator": "gae",
                                           "starpo.critic": "separate"}),
}


def _series(workdir) -> dict:
    from ragen_jax.training.event_log import read_scalars

    scalars = read_scalars(Path(workdir) / "tensorboard")
    return {tag: [[step, float(v).hex()] for step, v in series]
            for tag, series in sorted(scalars.items())
            if not tag.startswith("timing_s/") and tag != "warmup/seconds"}


def _config_run(path: str, over: dict, workdir: str) -> None:
    from ragen_jax.config import resolve
    from ragen_jax.launch import load_config_file
    from ragen_jax.training.trainer import train

    c = load_config_file(str(ROOT / path))
    c.workdir = workdir
    for key, value in over.items():
        node = c
        *sections, field = key.split(".")
        for section in sections:
            node = node[section]
        node[field] = value
    train(resolve(c))


def record(path: str, only: list[str] = ()) -> None:
    from tests.training.test_trainer import small_config_dict
    from ragen_jax.config import resolve
    from ragen_jax.training.trainer import train

    out = {}
    for name, over in RUNS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            c = small_config_dict(tmp, total_steps=5)
            for key, value in over.items():
                section, field = key.split(".")
                c[section][field] = value
            train(resolve(c))
            out[name] = _series(tmp)
        print(f"{name}: {len(out[name])} series", flush=True)
    for name, (config, over) in CONFIG_RUNS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            _config_run(config, over, tmp)
            out[name] = _series(tmp)
        print(f"{name}: {len(out[name])} series", flush=True)
    Path(path).write_text(json.dumps(out, indent=1))


def compare(before: str, after: str, renames: list[str], merged: list[str] = ()) -> int:
    """``renames``: OLD=NEW, a series that changed its name. ``merged``: OLD=KEPT, a series dropped
    because it duplicated KEPT; it must equal KEPT bit for bit in ``before``."""
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    mapping = dict(r.split("=", 1) for r in renames)
    duplicates = dict(r.split("=", 1) for r in merged)
    problems = 0
    for run in a:
        for tag, kept in duplicates.items():
            if tag in a[run] and a[run][tag] != a[run].get(kept):
                print(f"{run}: {tag} was not a duplicate of {kept}")
                problems += 1
        old = {mapping.get(tag, tag): series for tag, series in a[run].items() if tag not in duplicates}
        if run not in b:
            print(f"{run}: not recorded in {after}")
            problems += 1
            continue
        new = b[run]
        for tag in sorted(set(old) | set(new)):
            if tag not in new:
                print(f"{run}: {tag} is gone")
            elif tag not in old:
                print(f"{run}: {tag} is new")
            elif old[tag] != new[tag]:
                diff = [s for (s, v), w in zip(old[tag], new[tag]) if [s, v] != w] or ["(length)"]
                print(f"{run}: {tag} differs at steps {diff[:5]}")
            else:
                continue
            problems += 1
        print(f"{run}: {len(old)} series before, {len(new)} after")
    print("bit-identical" if not problems else f"{problems} difference(s)")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("path")
    r.add_argument("--only", action="append", default=[], help="record only this run (repeatable)")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--rename", action="append", default=[], help="OLD=NEW metric name")
    c.add_argument("--merged", action="append", default=[], help="OLD=KEPT: OLD duplicated KEPT and is gone")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.path, args.only)
        return 0
    return compare(args.before, args.after, args.rename, args.merged)


if __name__ == "__main__":
    sys.exit(main())
