"""Serve a policy behind an OpenAI-compatible API: ``/v1/chat/completions`` and ``/v1/models``.

    python -m ragen_jax.serve --workdir runs/frozen_lake            # the run's newest checkpoint
    python -m ragen_jax.serve --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-0.5b \\
        --config.model.path=/models/Qwen2.5-0.5B-Instruct           # a preset's own weights (HF / GGUF)

A workdir is served with the config it was trained with (``config.json``) and its newest intact
checkpoint; a LoRA run's adapters go onto the base its config names. Any OpenAI client talks to it:
``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")``.

Requests that arrive together share one decode: a batcher collects what is waiting (up to
``--max_batch`` rows, ``n`` rows per request, for at most ``--batch_window_ms``), pads the prompts to
one length and runs prefill + ``models.sampler.generate`` once for all of them, each row with its own
temperature, top-p and key. Shapes are bucketed (rows and prompt length to powers of two, the token
budget to multiples of 64), so a handful of programs serve every request.

Supported fields: ``model``, ``messages`` (``system`` / ``developer`` / ``user`` / ``assistant`` /
``tool``; content a string or an array of text parts; an assistant's ``tool_calls``; a last
``assistant`` message is continued rather than answered), ``temperature``, ``top_p``, ``max_tokens``
(<= ``--max_tokens_limit``), ``stop`` (up to 4 strings: the reply is cut before the first,
``finish_reason`` "stop"), ``n`` (<= 8), ``seed``, ``tools`` with ``tool_choice`` "auto" or "none": the
tools are listed as the model's chat template lists them (or, where it lists none, in Qwen2.5's words
in the system message), and a reply's ``<tool_call>{...}</tool_call>`` blocks come back as
``tool_calls`` with ``finish_reason`` "tool_calls" (``tools.openai_format``). Any other field
(``stream``, ``logprobs``, ...) is refused with a 400 that names it; a body over
``--max_body_bytes`` with a 413, one that has not arrived 10 s after its head with a 408 (and a
connection that has not sent a request head within 5 s is closed). The server binds 127.0.0.1 unless ``--host`` says otherwise, and
then warns: it has no authentication.

``--tokenization rollout`` (the default with ``--workdir``) tokenises a conversation as the rollout
writes it — message by message, a user message line by line — so a policy trained here is served the
token sequences it was trained on; ``template`` (the default with ``--config``) tokenises the chat
template's text whole, a pretrained model's own convention. With it, ``config.mode=eval
--config.model.provider=openai --config.model.base_url=http://127.0.0.1:PORT/v1
--config.model.continue_final_message=True`` plays the in-process evaluation's episodes exactly at
temperature 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from flax import nnx
from ml_collections import ConfigDict

from environments.text.request_body import BodyTooLarge, HeadTimeoutH11Protocol, read_body
from ragen_jax.compare import apply_overrides, parse_value
from ragen_jax.config import ConfigError, resolve
from ragen_jax.launch import load_config_file
from ragen_jax.models.decoder import pack_for_decode
from ragen_jax.models.kv_cache import init_cache
from ragen_jax.models.lora import merge_lora
from ragen_jax.models.sampler import SamplingConfig, generate, prefill
from ragen_jax.rollout.chat import chat_framing, conversation_segments, system_with_tools
from ragen_jax.starpo.train_state import policy_params
from ragen_jax.tools.openai_format import as_plain_chat, check_tools, for_template, reply_message
from ragen_jax.training.checkpoint import Checkpointer
from ragen_jax.training.evaluate import checkpointed_policy
from ragen_jax.training.run import setup

MAX_STOP = 4
# How a request's messages become tokens: "template" — the chat template's text tokenised whole (a
# pretrained model's own convention); "rollout" — piece by piece as this package's rollout writes
# a conversation (message by message, a user message line by line), the sequences a policy trained
# here saw. BPE over the whole text can merge across those seams ("\n" + "\n" -> "\n\n").
TOKENIZATIONS = ("template", "rollout")
MAX_N = 8
TOKEN_BUCKET = 64


def _bucket_pow2(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass
class ChatRequest:
    """One chat completion's rows: ``prompt`` token ids, and how each of its ``n`` rows samples."""

    prompt: list[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int
    tools: list | None = None  # OpenAI function schemas: replies' <tool_call> blocks come back as tool_calls
    future: Any = None  # asyncio.Future set by the batcher: list of (text, finish_reason, tokens)


class Generator:
    """Prefill + sampling over a padded batch of prompts, one compiled program per bucket.

    ``params`` is the policy's whole state (a LoRA run's adapters merged with their base).
    """

    def __init__(self, graphdef, params, model_cfg, tokenizer, *, max_seq_len: int, max_batch: int,
                 tokenization: str = "template"):
        if tokenization not in TOKENIZATIONS:
            raise ValueError(f"tokenization={tokenization!r}; allowed: {', '.join(TOKENIZATIONS)}")
        self.graphdef, self.model_cfg, self.tokenizer = graphdef, model_cfg, tokenizer
        # Packed once, at load, for the CPU matmul kernel (a no-op elsewhere: decoder.pack_for_decode).
        self.params = jax.jit(lambda p: pack_for_decode(graphdef, p))(params)
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.tokenization = tokenization
        framing = chat_framing(tokenizer)
        self.framing = framing
        stop = {tokenizer.convert_tokens_to_ids(framing.end_of_turn)}
        if tokenizer.eos_token_id is not None:
            stop.add(int(tokenizer.eos_token_id))
        self.stop_ids = np.asarray(sorted(i for i in stop if i is not None and i >= 0), np.int32)
        # One compiled program per (rows, prompt width) shape and token budget (static).
        self._decode = jax.jit(self._decode_batch, static_argnames="budget")
        self._lock = threading.Lock()  # one decode at a time (the batcher already serialises them)
        self.batches_run = 0

    def lists_tools(self, tools: list[dict]) -> bool:
        """Whether this model's chat template lists ``tools`` itself (``apply_chat_template(tools=)``)."""
        return system_with_tools(self.tokenizer, "-", tools) is not None

    def prompt_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template's tokens up to the assistant's reply. A last message of role
        ``assistant`` is continued, not answered: its text follows the assistant header with no end
        of turn (how a caller forces a reply's opening, e.g. ``<think>``, as the rollout does); the
        reply the server returns is what comes after it. Tool calls and results, and ``tools``, are
        written as the template writes them when it lists tools, else in ``ToolEnv``'s convention
        (``tools.openai_format``)."""
        kwargs = {}
        if tools and self.lists_tools(tools):
            messages, kwargs = for_template(messages), {"tools": tools}
        else:
            messages = as_plain_chat(messages, tools)
        cont = messages[-1]["role"] == "assistant"
        if cont:
            head = self.tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True,
                                                      **kwargs)
            text = head + messages[-1]["content"]
        else:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        if self.tokenization == "rollout" and messages[0]["role"] == "system" and not kwargs:
            # The same text, tokenised piece by piece as the rollout writes it (what a policy trained
            # here saw); a conversation the pieces do not render exactly falls back to the whole text.
            pieces = conversation_segments(self.framing, messages, continue_final=cont, user_lines=True)
            if "".join(pieces) == text:
                return [i for p in pieces for i in self.tokenizer(p, add_special_tokens=False)["input_ids"]]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode_batch(self, params, tokens, lengths, keys, temperature, top_p, *, budget: int):
        """Prefill each row's prompt (``tokens [B, W]``, ``lengths [B]``), then sample up to ``budget``
        tokens per row -> ``(tokens [B, budget], lengths [B], stopped [B])``."""
        rows, width = tokens.shape
        model = nnx.merge(self.graphdef, params)
        cache = init_cache(self.model_cfg, rows, width + budget)
        last, cache = prefill(model, cache, tokens, jnp.zeros((rows,), jnp.int32), lengths)
        sampling = SamplingConfig(temperature=temperature, top_k=jnp.zeros((rows,), jnp.int32), top_p=top_p)
        out = generate(model, cache, last, lengths, lengths > 0, keys, sampling, jnp.asarray(self.stop_ids),
                       jnp.full((0, 0), -1, jnp.int32), budget)
        return out.tokens, out.lengths, out.stopped

    def run(self, requests: list[ChatRequest]) -> list[list[tuple[str, str, int]]]:
        """Every row of ``requests`` in one decode -> per request, per row ``(text, finish_reason,
        completion tokens)``."""
        rows = [(i, j) for i, r in enumerate(requests) for j in range(r.n)]
        # Every request's prompt + max_tokens fits max_seq_len (parse_request); the cache holds the
        # bucketed width + the bucketed budget, so each row gets at least its own max_tokens.
        width = _bucket_pow2(max(len(r.prompt) for r in requests), self.max_seq_len)
        budget = -(-max(r.max_tokens for r in requests) // TOKEN_BUCKET) * TOKEN_BUCKET
        batch = _bucket_pow2(len(rows), self.max_batch)
        tokens = np.zeros((batch, width), np.int32)
        lengths = np.zeros((batch,), np.int32)
        temperature = np.zeros((batch,), np.float32)
        top_p = np.ones((batch,), np.float32)
        keys = []
        for b, (i, j) in enumerate(rows):
            r = requests[i]
            tokens[b, :len(r.prompt)] = r.prompt
            lengths[b] = len(r.prompt)
            temperature[b], top_p[b] = r.temperature, r.top_p
            keys.append(jax.random.fold_in(jax.random.key(r.seed), j))
        keys += [jax.random.key(0)] * (batch - len(rows))
        with self._lock:
            out_tokens, out_lengths, stopped = self._decode(
                self.params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.stack(keys), jnp.asarray(temperature),
                jnp.asarray(top_p), budget=budget)
            out_tokens, out_lengths, stopped = jax.device_get((out_tokens, out_lengths, stopped))
            self.batches_run += 1
        results: list[list] = [[] for _ in requests]
        for b, (i, j) in enumerate(rows):
            results[i].append(self._finish(requests[i], out_tokens[b], int(out_lengths[b]), bool(stopped[b])))
        return results

    def _finish(self, r: ChatRequest, tokens: np.ndarray, length: int, stopped: bool) -> tuple[str, str, int]:
        """The reply text (the stop token and anything past the request's budget or its first stop
        string left out) and why it ended."""
        ids = [int(t) for t in tokens[:min(length, r.max_tokens)]]
        ended = stopped and length <= r.max_tokens
        if ended:
            ids = ids[:-1]  # the end-of-turn / eos token is not part of the message
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = [text.index(s) for s in r.stop if s in text]
        if cut:
            return text[:min(cut)], "stop", len(ids)
        return text, "stop" if ended else "length", len(ids)


class Batcher:
    """Collects concurrent requests into decode batches (one decode at a time, in a worker thread)."""

    def __init__(self, generator: Generator, window_s: float):
        self.generator, self.window_s = generator, window_s
        self.queue: asyncio.Queue | None = None
        self.requests_served = 0

    async def submit(self, request: ChatRequest):
        request.future = asyncio.get_running_loop().create_future()
        await self.queue.put(request)
        return await request.future

    async def worker(self) -> None:
        while True:
            first = await self.queue.get()
            batch, rows = [first], first.n
            deadline = time.monotonic() + self.window_s
            while rows < self.generator.max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                if rows + nxt.n > self.generator.max_batch:
                    await self.queue.put(nxt)  # the next batch's (order within a window is not kept)
                    break
                batch.append(nxt)
                rows += nxt.n
            try:
                results = await asyncio.to_thread(self.generator.run, batch)
            except Exception as e:  # noqa: BLE001 - each waiting request gets the error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            self.requests_served += len(batch)
            for r, res in zip(batch, results):
                if not r.future.done():
                    r.future.set_result(res)


class BadRequest(ValueError):
    """A request the server refuses with a 400; the message names the field."""


ALLOWED_FIELDS = {"model", "messages", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "tools",
                  "tool_choice"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _bounded(body: dict, key: str, default, low, high, *, integer: bool = False):
    """``body[key]`` (``default`` when absent or null), a number in ``[low, high]``; ``integer``: an int."""
    value = body.get(key)
    if value is None:
        return default
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'} in [{low}, {high}], got {value!r}")
    return value if integer else float(value)


def parse_request(body: Any, generator: Generator, max_tokens_limit: int) -> ChatRequest:
    """A chat completion body -> ``ChatRequest`` (raises ``BadRequest`` naming the field)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(map(repr, unknown))}; this server supports "
                         f"{', '.join(sorted(ALLOWED_FIELDS))}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    messages = [_message(k, m) for k, m in enumerate(messages)]
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"'tool_choice' {choice!r} is not supported: use 'auto' (the model decides) or 'none'")
    if tools is not None:
        try:
            tools = check_tools(tools)
        except ValueError as e:
            raise BadRequest(str(e)) from None
    if choice == "none":
        tools = None
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings")
    max_tokens = _bounded(body, "max_tokens", min(256, max_tokens_limit), 1, max_tokens_limit, integer=True)
    prompt = generator.prompt_tokens(messages, tools)
    if len(prompt) + max_tokens > generator.max_seq_len:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the server's "
                         f"context of {generator.max_seq_len} tokens; shorten the messages or lower max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}")
    return ChatRequest(prompt=prompt, n=_bounded(body, "n", 1, 1, MAX_N, integer=True),
                       temperature=_bounded(body, "temperature", 1.0, 0.0, 2.0),
                       top_p=_bounded(body, "top_p", 1.0, 0.0, 1.0), max_tokens=max_tokens, stop=tuple(stop),
                       seed=secrets.randbits(31) if seed is None else seed % (1 << 31), tools=tools)


def _message(k: int, m) -> dict:
    """``messages[k]`` checked and normalised: content as one string (an array of text parts joined),
    ``developer`` as ``system``; an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` kept."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise BadRequest(f"messages[{k}] must be {{'role': one of {ROLES}, 'content': ...}}")
    if set(m) - MESSAGE_FIELDS:
        raise BadRequest(f"messages[{k}] has unsupported field(s) {sorted(set(m) - MESSAGE_FIELDS)}")
    role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{k}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        content = "".join(p["text"] for p in content)
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls):
            raise BadRequest(f"messages[{k}].tool_calls must be an assistant's list of {{'function': {{'name', "
                             "'arguments'}}}} objects")
    if not isinstance(content, str) and not (content is None and calls):
        raise BadRequest(f"messages[{k}].content must be a string or a list of text parts")
    out = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    return out


def make_app(generator: Generator, model_name: str, *, max_tokens_limit: int = 1024, max_body_bytes: int = 1 << 20,
             batch_window_ms: float = 10.0, body_timeout_s: float = 10.0):
    """The FastAPI application (``app.state.batcher`` counts requests and decode batches). A body
    that has not arrived ``body_timeout_s`` after the request head gets a 408."""
    batcher = Batcher(generator, batch_window_ms / 1000.0)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.queue = asyncio.Queue()  # on the server's own event loop
        worker = asyncio.create_task(batcher.worker())
        yield
        worker.cancel()

    app = FastAPI(title="ragen_jax policy server", lifespan=lifespan)
    app.state.batcher = batcher

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ragen_jax"}]}

    @app.get("/stats")
    async def stats():
        return {"requests": batcher.requests_served, "decode_batches": generator.batches_run}

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        try:
            body = json.loads(await asyncio.wait_for(read_body(http, max_body_bytes), body_timeout_s))
            request = parse_request(body, generator, max_tokens_limit)
        except asyncio.TimeoutError:
            return JSONResponse({"error": {"message": f"the body did not arrive within {body_timeout_s:g} s",
                                           "type": "invalid_request_error"}}, status_code=408,
                                headers={"Connection": "close"})
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body is not JSON")
        except BodyTooLarge as e:
            return error(e.status, str(e))
        except BadRequest as e:
            return error(400, str(e))
        rows = await batcher.submit(request)
        choices = []
        for k, (text, reason, _) in enumerate(rows):
            message, called = reply_message(text, request.tools)
            choices.append({"index": k, "message": message, "finish_reason": "tool_calls" if called else reason,
                            "logprobs": None})
        completion = sum(n for _, _, n in rows)
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or model_name, "choices": choices,
                "usage": {"prompt_tokens": len(request.prompt), "completion_tokens": completion,
                          "total_tokens": len(request.prompt) + completion}}

    return app


def load_policy(spec, workdir: str | None):
    """``(graphdef, params, model_cfg, tokenizer)``: the newest intact checkpoint of ``workdir``'s run
    (a LoRA run's adapters on their base), or the preset's own weights without a workdir."""

    run = setup(spec)
    params = policy_params(run.train_state)
    if workdir is not None:
        ckpt = Checkpointer(Path(workdir) / "checkpoints", keep=spec.trainer.keep_checkpoints)
        try:
            params, step = checkpointed_policy(spec.config, run, ckpt)
        finally:
            ckpt.close()
        print(f"serving checkpoint step {step} of {workdir}")
    model = merge_lora(nnx.merge(run.graphdefs.policy, jax.device_get(params)))
    graphdef, merged = nnx.split(model)
    return graphdef, merged, model.cfg, run.tokenizer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="a run's directory: its config.json and newest checkpoint")
    ap.add_argument("--config", help="a config file (with --config.key=value overrides), without a workdir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model_name", default=None, help="the id /v1/models lists (default: the workdir's name or preset)")
    ap.add_argument("--max_batch", type=int, default=32, help="rows per decode batch")
    ap.add_argument("--max_seq_len", type=int, default=None, help="prompt + reply tokens (default: rollout.max_seq_len)")
    ap.add_argument("--max_tokens_limit", type=int, default=1024)
    ap.add_argument("--max_body_bytes", type=int, default=1 << 20)
    ap.add_argument("--batch_window_ms", type=float, default=10.0)
    ap.add_argument("--tokenization", choices=TOKENIZATIONS, default=None,
                    help="'rollout' (default with --workdir: the token sequences the policy was trained on) or "
                         "'template' (default with --config: the chat template's text tokenised whole)")
    args, overrides = ap.parse_known_args(argv)

    try:
        if (args.workdir is None) == (args.config is None):
            raise ConfigError("pass exactly one of --workdir (a trained run) or --config (a preset's own weights)")
        if args.workdir is not None:
            path = Path(args.workdir) / "config.json"
            if not path.is_file():
                raise ConfigError(f"{path} does not exist: --workdir must be a run's directory (it holds config.json)")
            config = ConfigDict(json.loads(path.read_text()))
        else:
            config = load_config_file(args.config)
            pairs = []
            for o in overrides:
                if not (o.startswith("--config.") and "=" in o):
                    raise ConfigError(f"unknown argument {o!r}; overrides are --config.key=value")
                key, value = o[len("--config."):].split("=", 1)
                pairs.append((key, parse_value(value)))
            apply_overrides(config, pairs)
        spec = resolve(config)
        graphdef, params, model_cfg, tokenizer = load_policy(spec, args.workdir)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        sys.exit(2)
    tokenization = args.tokenization or ("rollout" if args.workdir else "template")
    generator = Generator(graphdef, params, model_cfg, tokenizer, max_seq_len=args.max_seq_len or spec.rollout.max_seq_len,
                          max_batch=args.max_batch, tokenization=tokenization)
    name = args.model_name or (Path(args.workdir).name if args.workdir else spec.model.preset)
    app = make_app(generator, name, max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
                   batch_window_ms=args.batch_window_ms)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}:{args.port}, reachable from other machines; the server has no "
              "authentication", file=sys.stderr)

    # A connection must send its request head within the keep-alive time (uvicorn alone waits forever).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=5,
                http=HeadTimeoutH11Protocol)


if __name__ == "__main__":
    main()
