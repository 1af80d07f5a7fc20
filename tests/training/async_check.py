"""One small asynchronous StarPO run, in its own process (driven by tests/training/test_async.py).

    python tests/training/async_check.py --devices 2 --rollout_devices 1 --staleness 1 --workdir W --out W.json
    # the rollout on a process of its own: process 0 trains, process 1 samples
    python tests/training/async_check.py --devices 1 --rollout_devices 1 --staleness 1 --workdir W \
        --coordinator 127.0.0.1:PORT --num_processes 2 --process_id 0 --out W.json   # and --process_id 1

The CPU device count is fixed when jax is imported, hence a process per layout. The run is
``test_trainer.small_config_dict`` (tiny preset, FrozenLake, GRPO, seeds fixed) with
``trainer.max_staleness`` and ``mesh.rollout_devices`` as given; ``--out`` receives every logged scalar.
"""
import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=1)
ap.add_argument("--rollout_devices", type=int, default=0)
ap.add_argument("--staleness", type=int, default=0)
ap.add_argument("--policy_loss", default="ppo")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--stop_at", type=int, default=0, help="interrupt after this step (StopTraining); run again to resume")
ap.add_argument("--workdir", required=True)
ap.add_argument("--out", default=None)
ap.add_argument("--coordinator", default=None, help="host:port of process 0: one of several processes")
ap.add_argument("--num_processes", type=int, default=1)
ap.add_argument("--process_id", type=int, default=0)
ap.add_argument("--eval_every", type=int, default=0, help="validation every this many steps (0: none)")
args = ap.parse_args()

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

if args.coordinator:
    from ragen_jax.launch import initialize_distributed

    initialize_distributed(args.coordinator, args.num_processes, args.process_id)

from ragen_jax.config import resolve  # noqa: E402
from ragen_jax.training.event_log import read_scalars  # noqa: E402
from ragen_jax.training.trainer import StopTraining, train  # noqa: E402
from tests.training.test_trainer import small_config_dict  # noqa: E402

c = small_config_dict(args.workdir, args.steps, **{"trainer.max_staleness": args.staleness,
                                                  "mesh.rollout_devices": args.rollout_devices,
                                                  "starpo.policy_loss": args.policy_loss})
# The tests' persistent XLA cache (tests/conftest.py): the runs of test_async.py share programs.
c.compilation_cache_dir = os.environ.get("RAGEN_JAX_TEST_CACHE") or os.path.expanduser("~/.cache/ragen_jax/xla-tests")
c.starpo.actor_lr = 1e-2  # the policy moves visibly in one step: stale and fresh batches differ
c.filter.update(dict(value=1.0, include_zero=True))  # every group trains (most have no reward spread yet)
c.warmup.update(dict(steps=0, single_turn_steps=0))  # the pipeline starts from whatever policy there is
c.trainer.eval_every = args.eval_every
c.trainer.eval_before_train = False
c.eval.num_episodes = 8


def stop(step, metrics):
    if step == args.stop_at:
        raise StopTraining


train(resolve(c), step_callback=stop if args.stop_at else None)
if not args.out:  # a process other than 0 writes nothing
    sys.exit(0)
scalars = read_scalars(os.path.join(args.workdir, "tensorboard"))
with open(args.out, "w") as f:
    json.dump({k: {str(s): v for s, v in series} for k, series in scalars.items()}, f)
