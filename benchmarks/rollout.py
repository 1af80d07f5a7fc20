"""Rollout throughput: KV-appended turns vs re-prefilling the whole conversation every turn.

    python benchmarks/rollout.py [--env sokoban] [--groups 16 --group-size 4] [--turns 5]

Both runs are the same jitted loop on the same episodes (same keys, same model); only the cache
policy differs. ``reprefill`` rebuilds the KV cache from position 0 at every turn, padded to the
static conversation length — how the original (vLLM prompts re-sent each turn) and Tunix's agentic
loop (left-padded prompt of ``max_prompt_length`` per call) pay for multi-turn context. Compilation
is excluded (one warm-up call each); the best of ``--repeats`` timed calls is reported. Prints
env-turns/s and sampled tokens/s and writes the table to ``benchmarks/results_rollout.md``.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import environments  # noqa: E402
from ragen_jax.models import Decoder, ModelConfig  # noqa: E402
from ragen_jax.config import RolloutConfig  # noqa: E402
from ragen_jax.rollout import make_rollout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(os.path.dirname(HERE), "ragen_jax", "assets", "tiny_tokenizer")


def load_tokenizer():
    return PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)


def time_rollout(ro, params, key, repeats):
    traj = ro(params, key)  # compile + warm-up
    jax.block_until_ready(traj)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        traj = ro(params, key)
        jax.block_until_ready(traj)
        best = min(best, time.perf_counter() - t0)
    return best, traj


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="sokoban")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results_rollout.md"))
    args = p.parse_args(argv)

    tok = load_tokenizer()
    env = environments.make(args.env)
    env_params = env.default_params()
    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=64,
                      tie_word_embeddings=True, max_position_embeddings=8192)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    base = RolloutConfig(num_groups=args.groups, group_size=args.group_size, max_turns=args.turns,
                         max_new_tokens=args.max_new_tokens, max_actions_per_traj=2 * args.turns,
                         max_seq_len=4096)
    # Size the conversation buffer to what the episodes need (both modes get the same one).
    probe = make_rollout(graphdef, env, env_params, tok, base)
    need = len(probe.codec.preamble_ids) + args.turns * (probe.codec.chunk_len + args.max_new_tokens) + probe.codec.end_len
    max_seq_len = int(-(-need // 128) * 128)
    key = jax.random.key(0)

    rows = []
    trajs = {}
    for mode in ("full", "reprefill"):
        rc = RolloutConfig(**{**base.__dict__, "max_seq_len": max_seq_len, "context_mode": mode,
                              "max_obs_tokens": probe.max_obs_tokens})
        ro = make_rollout(graphdef, env, env_params, tok, rc)
        seconds, traj = time_rollout(ro, params, key, args.repeats)
        turns = int(jnp.sum(traj.num_turns))
        sampled = int(jnp.sum(traj.response_length))
        rows.append((mode, seconds, turns / seconds, sampled / seconds))
        trajs[mode] = traj
        print(f"{mode:10s} {seconds:8.3f} s  {turns / seconds:10.1f} env-turns/s  {sampled / seconds:10.1f} sampled tok/s",
              flush=True)
    speedup = rows[1][1] / rows[0][1]
    same = float(np.mean(np.all(np.asarray(trajs["full"].tokens) == np.asarray(trajs["reprefill"].tokens), axis=1)))
    print(f"speed-up of KV-appended turns over per-turn re-prefill: {speedup:.2f}x "
          f"(identical transcripts: {same:.0%} of rows)")

    lines = [
        "# Rollout throughput: KV-appended turns vs per-turn re-prefill",
        "",
        f"Command: `python benchmarks/rollout.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.default_backend()}); "
        "shared with other jobs, so absolute numbers are noisy — the ratio is measured in the same run.",
        f"Setup: env `{args.env}`, {args.groups}×{args.group_size} = {args.groups * args.group_size} episodes, "
        f"{args.turns} turns, {args.max_new_tokens} new tokens per turn, decoder d{args.hidden} × {args.layers} layers "
        f"(vocab {len(tok)}), conversation buffer {max_seq_len} tokens, best of {args.repeats} after warm-up.",
        "",
        "| cache policy | seconds | env-turns/s | sampled tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for mode, s, tps, sps in rows:
        lines.append(f"| {mode} | {s:.3f} | {tps:.1f} | {sps:.1f} |")
    lines += ["", f"Speed-up (full / reprefill): **{speedup:.2f}×**; identical transcripts in {same:.0%} of rows.", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
