"""Which project files one training iteration of the main job passes through, counted call by call.

    python tools/iteration_files.py [--steps 4] [--config configs/frozen_lake.py]

The main job (``configs/frozen_lake.py``, cut to a short warm-up and a few StarPO steps, validating
every other step) runs with a Python profiler switched on between two ``step_callback`` calls: from
the end of step k to the end of step k + 1 it records every Python function entered whose file lies
in the package (``ragen_jax/``) or the environments (``environments/``). That span is one whole
iteration of ``trainer._run_steps``: the checkpoint of step k, then step k + 1's rollout, update,
logging and validation. Compiled programs run without Python, so a step whose programs are already
compiled shows the files that drive the iteration; ``--retrace`` empties JAX's caches at each
callback, so that every counted iteration traces (and compiles) its programs again and also shows
every file whose code is traced into them: the model, the sampler, the environment, the estimators
and losses. Every iteration is reported, with the files of each.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROJECT = (str(ROOT / "ragen_jax") + "/", str(ROOT / "environments") + "/")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/frozen_lake.py")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--retrace", action="store_true", help="trace every counted iteration's programs again")
    args = ap.parse_args()

    import jax

    from ragen_jax.config import resolve
    from ragen_jax.launch import load_config_file
    from ragen_jax.training.trainer import train

    calls: dict[int, Counter] = {}
    current: list[Counter | None] = [None]

    def profile(frame, event, _arg):
        if event == "call" and current[0] is not None:
            path = frame.f_code.co_filename
            if path.startswith(PROJECT):
                current[0][str(Path(path).relative_to(ROOT))] += 1

    def on_step(step: int, _metrics: dict) -> None:
        if step + 1 <= args.steps:  # from here to the next callback: iteration step + 1
            if args.retrace:
                jax.clear_caches()
            current[0] = calls.setdefault(step + 1, Counter())
            sys.setprofile(profile)
        else:
            sys.setprofile(None)
            current[0] = None

    with tempfile.TemporaryDirectory() as tmp:
        c = load_config_file(str(ROOT / args.config))
        c.workdir = tmp
        for key, value in {"trainer.total_steps": args.steps, "trainer.time_limit_minutes": 0,
                           "trainer.eval_every": 2, "trainer.progress_bar": False, "trainer.save_every": 1,
                           "warmup.single_turn_steps": 3, "warmup.steps": 3, "eval.num_episodes": 8,
                           "compilation_cache_dir": ""}.items():
            section, field = key.split(".") if "." in key else (None, key)
            (c[section] if section else c)[field] = value
        train(resolve(c), step_callback=on_step)
    sys.setprofile(None)

    for step, counter in sorted(calls.items()):
        files = sorted(counter)
        print(f"iteration {step} ({'validates' if step % 2 == 0 or step == args.steps else 'no validation'}): "
              f"{len(files)} project files, {sum(counter.values())} Python calls")
        for f in files:
            print(f"  {counter[f]:7d}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
