"""How long the warm-up's first-turn phase takes to read the board: held-out reading per check.

    python tools/reading_plateau.py --config configs/frozen_lake.py [--config.warmup.batch_size=8 ...]
        [--out reading.json]

Runs phase 1 of the behaviour-cloning warm-up only (first-turn demonstrations, the learning rate it
has in the whole warm-up) and prints ``make_reading_check``'s held-out reading every
``warmup.check_every`` steps, with the seconds since the phase started; the phase stops at
``warmup.reading_target`` or at ``warmup.single_turn_steps``. Nothing is written but ``--out`` (the
same figures as JSON). The plateau before reading is learned depends on the initialisation
(``--config.model.tiny.init_seed``) and on this machine's floating-point path, so a recipe's claim
is a row per seed on the machine in question (``docs/experiments.md``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # the launcher's opt-in restart with huge pages (ragen_jax.malloc_tuning)
    from ragen_jax.malloc_tuning import reexec_with_huge_pages

    reexec_with_huge_pages()


def main(argv=None) -> None:
    from absl import flags

    from ragen_jax import launch

    out = flags.DEFINE_string("out", None, "Also write the readings to this JSON file.")

    def run(_):
        from ragen_jax.config import ConfigError, resolve
        from ragen_jax.training.run import setup
        from ragen_jax.training.warmup import run_warmup

        cfg = launch._CONFIG.value
        with launch.user_errors():  # each problem: one "Configuration error: ..." line, exit status 2
            if cfg is None:
                raise ConfigError("--config is required, e.g. --config configs/frozen_lake.py")
            launch.start(cfg)
            spec = resolve(cfg)
            w = spec.warmup
            if not (w.single_turn_steps and w.reading_target > 0):
                raise ConfigError("the config has no first-turn phase with a reading target: set "
                                  "--config.warmup.single_turn_steps and --config.warmup.reading_target")
        built = setup(spec)
        readings, t0 = [], time.time()

        def log(step, scalars):
            if "warmup/reading_accuracy" in scalars:
                readings.append({"step": step, "reading": scalars["warmup/reading_accuracy"],
                                 "seconds": round(time.time() - t0, 1)})
                print(f"step {step:5d}  held-out reading {readings[-1]['reading']:.3f}  "
                      f"{readings[-1]['seconds']:7.1f} s", flush=True)

        _, summary = run_warmup(built.rollout, built.train_state.params, w, log_fn=log, progress=False,
                                first_phase_only=True)
        steps = int(summary["warmup/single_turn_steps"])
        reached = bool(readings) and readings[-1]["reading"] >= w.reading_target
        print(f"{'reached' if reached else 'did not reach'} {w.reading_target} after {steps} steps "
              f"(batch {w.batch_size}, init seed {cfg.model.tiny.init_seed})")
        if out.value:
            Path(out.value).write_text(json.dumps({"reached": reached, "steps": steps, "batch_size": w.batch_size,
                                                   "readings": readings}, indent=1))

    launch.run(argv, main=run)


if __name__ == "__main__":
    main()
