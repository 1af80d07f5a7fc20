"""Accelerator check: rollout and StarPO update throughput of a Qwen2.5-0.5B-shaped model.

    python benchmarks/gpu_check.py                      # 0.5B shape on a GPU/TPU, tiny shape on CPU
    python benchmarks/gpu_check.py --shape 0.5b --write benchmarks/results_gpu.md

One script, a few minutes in all (the GPU budget of a check is 8): a Qwen2.5-0.5B-shaped decoder in
bfloat16 (weights and compute, random initialisation: no download) on every local device as the
trainer lays it out (``config.mesh`` default: data parallel), FrozenLake, RAGEN's rollout shape of
128 episodes (8 groups × 16) × 5 turns. Random weights reply with random tokens, so every reply runs
to ``--max_new_tokens``: the rollout is measured at its full length. Reports

  * rollout: sampled tokens/s and env turns/s (compilation excluded: the first call is not timed);
  * rollout memory-bandwidth utilisation: decode's bytes (weights + the filled KV cache, each step)
    against the bandwidth of a device copy measured in the same run;
  * update: one GRPO update on that batch (scoring pass + 2 mini-batches of forward and backward),
    tokens/s and model FLOPs utilisation against the measured bf16 matmul peak of the device;
  * peak device memory (``memory_stats``; on CPU the compiled programs' own figures).

On CPU (``--shape tiny``) it is a smoke test of the same code with a small model and batch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import frozen_lake  # noqa: E402
from ragen_jax.config import resolve# noqa: E402

SHAPES = {
    # name: (architecture, rollout groups × group size, max_new_tokens, max_seq_len)
    "0.5b": ("qwen2.5-0.5b", (8, 16), 128, 2048),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, vocab_size=4096), (2, 4), 16, 512),
}


def matmul_peak(dtype=jnp.bfloat16, n: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of one large square matmul on device 0 (best of ``repeats``)."""
    n = n if jax.devices()[0].platform != "cpu" else 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n ** 3 / best


def copy_bandwidth(megabytes: int = 2048, repeats: int = 5) -> float:
    """Bytes/s of one large device-to-device copy (read + written; best of ``repeats``)."""
    n = (megabytes if jax.devices()[0].platform != "cpu" else 64) * 2**20 // 4
    a = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # an elementwise pass: one read and one write of every byte
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n * 4 / best


def progress(message: str, start: float) -> None:
    """One line on stderr per phase, so a run stopped by a time limit still says where the time went."""
    print(f"gpu_check: {time.time() - start:6.1f} s  {message}", file=sys.stderr, flush=True)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build(shape: str, max_new_tokens: int | None):
    from ragen_jax import plan
    from ragen_jax.models import Decoder, ModelConfig
    from ragen_jax.rollout.loop import make_rollout
    from ragen_jax.starpo.update import init_train_state, make_update_step
    from ragen_jax.models.presets import load_tiny_tokenizer
    from ragen_jax.training.build import build_env
    from ragen_jax.training.run import make_placement

    arch, (groups, size), new_tokens, seq_len = SHAPES[shape]
    c = frozen_lake.get_config()
    c.rollout.update(dict(num_groups=groups, group_size=size, max_turns=5, max_new_tokens=max_new_tokens or new_tokens,
                          max_seq_len=seq_len, stop_at_answer=False))
    c.starpo.update(dict(adv_estimator="grpo", critic="none", mini_batch_size=groups * size // 2,
                         micro_batch_size=None if shape == "tiny" else 16))
    c.filter.update(dict(value=1.0, include_zero=True))
    spec = resolve(c)
    placement = make_placement(spec)
    hf = {**plan._QWEN2, **(plan.ARCHITECTURES[arch] if isinstance(arch, str) else arch)}
    cfg = ModelConfig.from_hf_config(hf, dtype="bfloat16", param_dtype="bfloat16", scan_layers=True)
    model = placement.create(lambda rngs: Decoder(cfg, rngs=rngs), seed=0)
    env, env_params = build_env(spec)
    tokenizer = load_tiny_tokenizer()
    graphdefs, state = init_train_state(model, spec.starpo, key=jax.random.key(1))
    shardings = placement.state_shardings(state)
    state = placement.put(state, shardings)
    rollout = make_rollout(graphdefs.policy, env, env_params, tokenizer, spec.rollout, placement=placement)
    update = make_update_step(graphdefs, spec.starpo, spec.filter, spec.collapse, group_size=size,
                              shared_prefix_len=len(rollout.codec.preamble_ids), placement=placement,
                              state_shardings=shardings)
    return spec, cfg, state, rollout, update


def model_flops_per_token(cfg, context: float) -> float:
    """Forward FLOPs per token: 2 × matmul parameters (the embedding lookup is free) + attention over
    ``context`` keys (QK^T and PV: 4 × layers × heads × head_dim × context)."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkvo = D * cfg.num_heads * cfg.head_dim * 2 + D * cfg.num_kv_heads * cfg.head_dim * 2
    per_layer = qkvo + 3 * D * F
    return 2 * (L * per_layer + D * cfg.vocab_size) + 4 * L * cfg.num_heads * cfg.head_dim * context


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_cpu = jax.devices()[0].platform == "cpu"
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny" if on_cpu else "0.5b")
    ap.add_argument("--max_new_tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", default=None, help="append the results (markdown) to this file")
    args = ap.parse_args()

    t_start = time.time()
    spec, cfg, state, rollout, update = build(args.shape, args.max_new_tokens)
    progress("model, state and programs built", t_start)
    key = jax.random.key(0)
    traj = rollout(state.params, key)  # compiles
    jax.block_until_ready(traj)
    progress("rollout compiled and run once", t_start)
    t_roll = min(_timed(lambda: jax.block_until_ready(rollout(state.params, key))) for _ in range(args.repeats))
    progress(f"rollout timed: {t_roll:.2f} s", t_start)
    sampled = float(jnp.sum(traj.loss_mask))
    turns = float(jnp.sum(traj.num_turns))
    tokens = float(jnp.sum(traj.valid_mask))
    copy = jax.jit(lambda s: jax.tree.map(lambda x: x.copy(), s))
    fresh = copy(state)
    new_state, metrics = update(fresh, traj)  # compiles
    jax.block_until_ready(new_state)
    progress("update compiled and run once", t_start)
    times = []
    for _ in range(args.repeats):
        fresh = copy(state)
        jax.block_until_ready(fresh)
        times.append(_timed(lambda: jax.block_until_ready(update(fresh, traj))))
    t_upd = min(times)
    progress(f"update timed: {t_upd:.2f} s", t_start)

    peak = matmul_peak()
    bandwidth = copy_bandwidth()
    mean_len = tokens / traj.tokens.shape[0]
    # Decode's bytes: every step reads all weights and the KV cache up to the current position (the
    # sampler reads only the filled blocks), on average half the final length; every row decodes all
    # ``max_new_tokens`` of every turn (random weights never stop early). Prefill and the environment
    # are in the rollout time too, so this is a lower bound on decode's own bandwidth use.
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    kv_item = jnp.dtype(cfg.kv_cache_dtype or cfg.dtype).itemsize
    kv_bytes = 2 * cfg.num_layers * traj.tokens.shape[0] * cfg.num_kv_heads * cfg.head_dim * kv_item * mean_len / 2
    decode_steps = spec.rollout.max_turns * spec.rollout.max_new_tokens
    decode_bytes = decode_steps * (param_bytes + kv_bytes)
    # Update: one scoring forward of every token + forward and backward (2x) of every trained token.
    upd_flops = 4 * tokens * model_flops_per_token(cfg, mean_len / 2)
    roll_flops = sampled * model_flops_per_token(cfg, mean_len / 2)
    stats = jax.devices()[0].memory_stats() or {}
    mem = stats.get("peak_bytes_in_use")
    device = jax.devices()[0]
    lines = [
        f"## {args.shape} shape on {jax.device_count()} × {device.device_kind} ({device.platform}), jax {jax.__version__}",
        "",
        f"`python benchmarks/gpu_check.py --shape {args.shape}` — {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, bf16 weights and compute; {traj.tokens.shape[0]} episodes × {spec.rollout.max_turns} "
        f"turns, replies up to {spec.rollout.max_new_tokens} tokens; best of {args.repeats}, compilation excluded.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| rollout time | {t_roll:.2f} s |",
        f"| rollout sampled tokens/s | {sampled / t_roll:,.0f} |",
        f"| rollout env turns/s | {turns / t_roll:,.0f} |",
        f"| rollout model FLOPs utilisation | {roll_flops / t_roll / peak:.1%} |",
        f"| rollout memory-bandwidth utilisation (decode reads: weights + filled KV cache, lower bound) "
        f"| {decode_bytes / t_roll / bandwidth:.1%} |",
        f"| update time (GRPO, 2 mini-batches) | {t_upd:.2f} s |",
        f"| update tokens/s | {tokens / t_upd:,.0f} |",
        f"| update model FLOPs utilisation | {upd_flops / t_upd / peak:.1%} |",
        f"| measured bf16 matmul peak | {peak / 1e12:.1f} TFLOP/s |",
        f"| measured memory bandwidth (device copy, bytes read + written) | {bandwidth / 1e9:,.0f} GB/s |",
        f"| peak device memory | {f'{mem / 2**30:.1f} GiB' if mem else 'n/a (CPU)'} |",
        f"| wall time of this check | {time.time() - t_start:.0f} s |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "a", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
