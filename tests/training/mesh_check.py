"""One small StarPO run on a device mesh, in its own process (driven by tests/training/test_mesh.py).

    python tests/training/mesh_check.py --devices 8 --mesh 2,2,2 --workdir W --steps 2 --out W.json
    # one of several processes on 127.0.0.1 (each with its own --devices):
    python tests/training/mesh_check.py --devices 4 --mesh 2,2,2 --coordinator 127.0.0.1:PORT \
        --num_processes 2 --process_id 0 --workdir W --steps 2 --out W.json

The CPU device count is fixed when jax is imported, hence a process per layout. The run is the tiny
preset on FrozenLake with GAE, a separate critic and a KL reference (so every kind of parameter and
optimizer state is sharded), no SNR filtering (every row trains), validation every 2 steps. Seeds are
fixed: any two layouts compute the same numbers up to the order of their float reductions.
``--out`` receives every logged scalar (process 0) and, with ``--dump_restored``, the checkpoint the
run resumed from as this layout restored it (an .npz of every array).
"""
import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=1)
ap.add_argument("--mesh", default="1,1,1")
ap.add_argument("--workdir", required=True)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--out", default=None)
ap.add_argument("--coordinator", default=None)
ap.add_argument("--num_processes", type=int, default=1)
ap.add_argument("--process_id", type=int, default=0)
ap.add_argument("--dump_restored", default=None)
ap.add_argument("--warmup", type=int, default=0, help="behaviour-cloning steps before RL (first-turn and whole)")
args = ap.parse_args()

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

if args.coordinator:
    from ragen_jax.launch import initialize_distributed

    initialize_distributed(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402
import numpy as np  # noqa: E402


def config(workdir: str, steps: int, mesh: tuple[int, int, int]):
    from configs import frozen_lake
    from ragen_jax.config import resolve

    c = frozen_lake.get_config()
    c.workdir = workdir
    c.compilation_cache_dir = ""
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8))
    c.rollout.update(dict(num_groups=4, group_size=2, max_turns=2, max_actions_per_traj=4, max_new_tokens=56,
                          max_seq_len=432))
    c.starpo.update(dict(adv_estimator="gae", critic="separate", use_kl_loss=True, mini_batch_size=4))
    # Half the groups replay unsolved starts (from step 2 on: the untrained policy solves none), so the
    # layouts and the resumes below also check the replay queue's host state.
    c.filter.update(dict(value=1.0, include_zero=True, start_replay_fraction=0.5))
    c.collapse.update(dict(compute_freq=1, num_samples=4, micro_batch_size=8))
    c.warmup.update(dict(single_turn_steps=args.warmup, steps=args.warmup, batch_size=4, num_states=4,
                         heldout_states=8))
    c.eval.num_episodes = 4
    c.trainer.update(dict(total_steps=steps, eval_every=2, save_every=1, transcript_every=1, progress_bar=False))
    c.mesh.update(dict(data=mesh[0], fsdp=mesh[1], tensor=mesh[2]))
    return resolve(c)


def dump_restored(spec, path: str) -> None:
    """The latest checkpoint of the workdir, restored into this process's layout, as NumPy."""
    from pathlib import Path

    from ragen_jax.training.checkpoint import Checkpointer
    from ragen_jax.training.run import setup

    run = setup(spec)
    ckpt = Checkpointer(Path(spec.config.workdir) / "checkpoints")
    state, _, step = ckpt.restore(run.train_state)
    ckpt.close()
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = {jax.tree_util.keystr(p): run.placement.fetch(x) for p, x in leaves
              if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)}
    if run.placement.is_main:
        np.savez(path, __step__=step, **arrays)


def main() -> None:
    from tests.training.test_trainer import _logged
    from ragen_jax.training.trainer import train

    mesh = tuple(int(x) for x in args.mesh.split(","))
    spec = config(args.workdir, args.steps, mesh)
    if args.dump_restored:
        dump_restored(spec, args.dump_restored)
    out = train(spec)
    if jax.process_index() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"logged": {k: [[int(s), float(v)] for s, v in series]
                                  for k, series in _logged(args.workdir).items()},
                       "summary": out["summary"], "devices": jax.device_count(),
                       "processes": jax.process_count()}, f)
    print(f"ok process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices")


if __name__ == "__main__":
    main()
