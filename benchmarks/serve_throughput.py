"""The OpenAI-compatible server's throughput against the same decode called in-process.

    python benchmarks/serve_throughput.py [--config configs/frozen_lake.py] [--requests 64] [--concurrency 32]
        [--max_tokens 64] [--out benchmarks/results_serve.md]

Both sides run the same model (the config's preset, its initial weights: the timing does not depend
on what the weights say) on the same prompts at temperature 1 with ``max_tokens`` each:

* server: ``ragen_jax.serve`` on 127.0.0.1 (uvicorn in this process), ``--requests`` chat completions
  sent by ``--concurrency`` threads through the ``openai`` client;
* in-process: the server's own ``Generator.run`` on batches of ``--concurrency`` requests, no HTTP.

It prints requests/s and generated tokens/s of each and the ratio (server / in-process): what HTTP,
JSON and the batcher cost.

Then the evaluation itself, ``--episodes`` validation puzzles of the config's environment played
both ways with the same weights: in process (``Evaluator``: the rollout's own sampler) and through
the API (``model.provider=openai`` against this server: ``rollout.remote``, the transcript decoded
into messages and the replies tokenised back every turn), in episodes/s and turns/s.

Everything is measured after a warm-up round (compilation excluded). Take figures from a run alone
on the cores.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESSAGES = [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "Turn 1: the board is P_G. Decide your next action."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/frozen_lake.py")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results_serve.md")
    args = ap.parse_args()

    import openai
    import uvicorn

    from ragen_jax.config import resolve
    from ragen_jax.launch import load_config_file
    from ragen_jax.serve import ChatRequest, Generator, load_policy, make_app

    spec = resolve(load_config_file(args.config))
    graphdef, params, model_cfg, tokenizer = load_policy(spec, None)
    generator = Generator(graphdef, params, model_cfg, tokenizer, max_seq_len=1024, max_batch=args.concurrency,
                          tokenization="rollout")
    prompt = generator.prompt_tokens(MESSAGES)

    def request(seed: int) -> ChatRequest:
        return ChatRequest(prompt=prompt, n=1, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, stop=(), seed=seed)

    # In-process: the same decode, batches of `concurrency` requests.
    # Compile every (rows, prompt width) bucket the server's batches can take: requests arrive in
    # batches of any size, and an evaluation's later turns have longer prompts.
    width = 64
    while width <= 512:
        rows = 1
        while rows < 2 * args.concurrency:
            generator.run([ChatRequest(prompt=[0] * (width - 1), n=1, temperature=1.0, top_p=1.0,
                                       max_tokens=args.max_tokens, stop=(), seed=k)
                           for k in range(min(rows, args.concurrency))])
            rows *= 2
        width *= 2
    t0, tokens = time.perf_counter(), 0
    for start in range(0, args.requests, args.concurrency):
        batch = [request(k) for k in range(start, min(start + args.concurrency, args.requests))]
        tokens += sum(n for rows in generator.run(batch) for _, _, n in rows)
    local_s = time.perf_counter() - t0

    # Server: uvicorn in this process, the openai client in `concurrency` threads.
    app = make_app(generator, "bench", max_tokens_limit=args.max_tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(seed: int) -> int:
        reply = client.chat.completions.create(model="bench", messages=MESSAGES, temperature=1.0, seed=seed,
                                               max_tokens=args.max_tokens)
        return reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(ask, range(args.concurrency)))  # warm-up (the server's own first batches)
        batches_before = generator.batches_run
        t0 = time.perf_counter()
        served_tokens = sum(pool.map(ask, range(args.requests)))
        server_s = time.perf_counter() - t0
    batches = generator.batches_run - batches_before
    local_eval, remote_eval = _eval_both_ways(spec, graphdef, params, tokenizer, port, args)
    server.should_exit = True

    rows = [("in-process (Generator.run)", args.requests / local_s, tokens / local_s, -(-args.requests // args.concurrency)),
            ("server (HTTP, openai client)", args.requests / server_s, served_tokens / server_s, batches)]
    lines = [f"# Server throughput: {spec.model.preset} ({args.config}), {args.requests} requests, "
             f"{args.concurrency} concurrent, max_tokens {args.max_tokens}, temperature 1", "",
             "| path | requests/s | generated tokens/s | decode batches |", "|---|---|---|---|"]
    lines += [f"| {name} | {r:.2f} | {t:.0f} | {b} |" for name, r, t, b in rows]
    lines += ["", f"server / in-process: **{rows[1][2] / rows[0][2]:.2f}×** generated tokens/s", "",
              f"## Evaluation: {args.episodes} {spec.env_name} puzzles, temperature {spec.eval.temperature}, "
              f"{spec.rollout.batch_size} episodes at a time", "",
              "| path | episodes/s | turns/s | requests |", "|---|---|---|---|"]
    for name, (seconds, turns, requests) in (("in-process (Evaluator, the rollout's sampler)", local_eval),
                                              ("through the API (model.provider=openai, this server)", remote_eval)):
        lines.append(f"| {name} | {args.episodes / seconds:.2f} | {turns / seconds:.1f} | {requests} |")
    lines += ["", f"API / in-process: **{local_eval[0] / remote_eval[0]:.2f}×** episodes/s"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


def _eval_both_ways(spec, graphdef, params, tokenizer, port, args):
    """``(seconds, turns played, requests)`` of one evaluation in process and one through the API."""
    import dataclasses

    from ragen_jax.rollout.remote import ChatClient
    from ragen_jax.training.build import build_env
    from ragen_jax.training.evaluate import Evaluator

    env, env_params = build_env(spec, tokenizer)
    eval_cfg = dataclasses.replace(spec.eval, num_episodes=args.episodes)
    remote_model = dataclasses.replace(spec.model, provider="openai", base_url=f"http://127.0.0.1:{port}/v1",
                                       name="bench", continue_final_message=True,
                                       max_concurrency=spec.rollout.batch_size, max_retries=0, request_timeout_s=600.0)
    client = ChatClient(remote_model, progress=False)
    out = []
    for g, p, remote in ((graphdef, params, None), (None, None, client)):
        ev = Evaluator(g, env, env_params, tokenizer, spec.rollout, eval_cfg, spec.rollout.batch_size, remote=remote)
        ev(p, 0)  # compile (and, through the API, the server's programs)
        requests = client.usage["requests"]
        t0 = time.perf_counter()
        metrics = ev(p, 0)
        seconds = time.perf_counter() - t0
        out.append((seconds, metrics["val/num_turns"] * args.episodes, client.usage["requests"] - requests))
    client.close()
    return out


if __name__ == "__main__":
    main()
