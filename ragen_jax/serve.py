"""Serve a policy behind an OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models`` and ``/v1/models/{id}``.

    python -m ragen_jax.serve --workdir runs/frozen_lake            # the run's newest checkpoint
    python -m ragen_jax.serve --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-0.5b \\
        --config.model.path=/models/Qwen2.5-0.5B-Instruct           # a preset's own weights (HF / GGUF)

A workdir is served with the config it was trained with (``config.json``) and its newest intact
checkpoint; a LoRA run's adapters go onto the base its config names. Any OpenAI client talks to it:
``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")``.

Continuous batching (``serve_engine.Engine``): every request's rows join a running decode between
chunks of steps and leave it at their own stop or length, so many clients share the model and a
short reply never waits for a long one; a request whose client goes away frees its rows at once.
At most ``--max_queue`` requests wait for a row; past that a request is answered 429 with
``Retry-After``.

Chat fields: ``model`` (the served id; another is a 404), ``messages`` (``system`` / ``developer`` /
``user`` / ``assistant`` / ``tool``; content a string or an array of text parts; an assistant's
``tool_calls``; a last ``assistant`` message is continued rather than answered), ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens`` (<= ``--max_tokens_limit``), ``stop`` (up to 4
strings: the reply is cut before the first, ``finish_reason`` "stop"), ``n`` (<= 8), ``seed``,
``presence_penalty`` / ``frequency_penalty``, ``logprobs`` with ``top_logprobs`` (<= 20; the model's
log-probs at temperature 1), ``stream`` with ``stream_options.include_usage`` (server-sent events),
``response_format`` ``{"type": "text"}``, ``user``, ``tools`` with ``tool_choice`` "auto" or "none":
the tools are listed as the model's chat template lists them (or, where it lists none, in Qwen2.5's
words in the system message), and a reply's ``<tool_call>{...}</tool_call>`` blocks come back as
``tool_calls`` with ``finish_reason`` "tool_calls" (``tools.openai_format``). ``/v1/completions``
takes ``prompt`` (a string or a list of strings), the same sampling fields, ``logprobs`` (<= 5) and
``stream``. Any other field is refused with a 400 that names it. Every error is OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``): a body over ``--max_body_bytes`` is a 413, one
that has not arrived 10 s after its head a 408 (and a connection that has not sent a request head
within 5 s is closed), JSON nested over 64 levels or a string with a lone surrogate a 400. The
server binds 127.0.0.1 unless ``--host`` says otherwise, and then warns: it has no authentication.

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
import dataclasses
import json
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from flax import nnx
from ml_collections import ConfigDict

from environments.text.request_body import BodyTooLarge, HeadTimeoutH11Protocol, read_body
from ragen_jax.compare import apply_overrides, parse_value
from ragen_jax.config import ConfigError, resolve
from ragen_jax.launch import load_config_file
from ragen_jax.models.lora import merge_lora
from ragen_jax.rollout.chat import chat_framing, conversation_segments, system_with_tools
from ragen_jax.serve_engine import TOP_LOGPROBS, Engine, Job, QueueFull
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
MAX_DEPTH = 64  # JSON nesting a request may have (a chat body needs 6)
DISCONNECT_POLL_S = 0.25


class BadRequest(ValueError):
    """A request the server refuses with a 400 (or ``status``); the message names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclasses.dataclass
class ChatRequest:
    """One request's rows: ``prompt`` token ids, and how each of its ``n`` rows samples and ends."""

    prompt: list[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int
    tools: list | None = None  # OpenAI function schemas: replies' <tool_call> blocks come back as tool_calls
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


class Row:
    """One row of a request as it decodes: the tokens so far, the text a client has been sent, and
    how it ended. ``feed`` takes the engine's events (on the event loop) and returns the new text
    delta with its tokens' log-probs; a stop string ends the row (its job is cancelled) and is never
    sent, nor is text that may still become one, nor a half-decoded character."""

    def __init__(self, generator: "Generator", request: ChatRequest, index: int):
        self.generator, self.request, self.index = generator, request, index
        self.ids: list[int] = []
        self.logprobs: list[dict] = []
        self.sent = 0  # characters of the text already returned
        self.sent_tokens = 0  # tokens whose log-probs were returned
        self.finish: str | None = None
        self.job = None

    def text(self) -> str:
        return self.generator.tokenizer.decode(self.ids, skip_special_tokens=True)

    def feed(self, kind: str, payload) -> tuple[str, list[dict]]:
        if self.finish is not None:
            return "", []
        if kind == "end":
            self.finish = "length" if payload == "length" else "stop"
            if str(payload).startswith("error"):
                self.finish = "error"
            return self._delta(final=True)
        ids, lps, (top_ids, top_lps) = payload
        for k, (t, lp) in enumerate(zip(ids, lps)):
            self.ids.append(int(t))
            if self.request.logprobs:
                self.logprobs.append(self.generator.logprob_entry(int(t), lp, top_ids[k], top_lps[k],
                                                                  self.request.top_logprobs))
        cut = self._stop_cut(self.text())
        if cut is not None:
            self.finish = "stop"
            self.job.cancelled = True
            return self._delta(final=True, end=cut)
        return self._delta(final=False)

    def _stop_cut(self, text: str) -> int | None:
        """Where the first of the request's stop strings begins in ``text`` (None: none there)."""
        cut = [text.index(s) for s in self.request.stop if s in text]
        return min(cut) if cut else None

    def text_out(self) -> str:
        """The reply as returned: up to the first stop string."""
        text = self.text()
        cut = self._stop_cut(text)
        return text if cut is None else text[:cut]

    def _delta(self, final: bool, end: int | None = None) -> tuple[str, list[dict]]:
        text = self.text()
        if end is None:
            end = len(text)
            if not final:
                while end > self.sent and text[end - 1] == "\ufffd":  # a character still being decoded
                    end -= 1
                hold = max((k for s in self.request.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])),
                           default=0)
                end -= hold  # text that may still turn into a stop string
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        # The log-probs of the tokens whose text is now out (all of them once the row ended, up to
        # the stop string's cut).
        done = len(self.ids) if final and end == len(text) else self._tokens_within(end)
        entries = self.logprobs[self.sent_tokens:done]
        self.sent_tokens = max(self.sent_tokens, done)
        return delta, entries

    def _tokens_within(self, chars: int) -> int:
        k = len(self.ids)
        while k > self.sent_tokens and len(self.generator.tokenizer.decode(self.ids[:k], skip_special_tokens=True)) > chars:
            k -= 1
        return k

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)


class Generator:
    """The served model: its tokenizer and chat framing, and the continuous-batching ``Engine``.

    ``params`` is the policy's whole state (a LoRA run's adapters merged with their base);
    ``max_batch`` rows decode at once.
    """

    def __init__(self, graphdef, params, model_cfg, tokenizer, *, max_seq_len: int, max_batch: int,
                 tokenization: str = "template", chunk: int = 8, max_queue: int = 256):
        if tokenization not in TOKENIZATIONS:
            raise ValueError(f"tokenization={tokenization!r}; allowed: {', '.join(TOKENIZATIONS)}")
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.tokenization = tokenization
        self.framing = chat_framing(tokenizer)
        stop = {tokenizer.convert_tokens_to_ids(self.framing.end_of_turn)}
        if tokenizer.eos_token_id is not None:
            stop.add(int(tokenizer.eos_token_id))
        self.stop_ids = np.asarray(sorted(i for i in stop if i is not None and i >= 0), np.int32)
        self.engine = Engine(graphdef, params, model_cfg, self.stop_ids, slots=max_batch, max_seq_len=max_seq_len,
                             chunk=chunk, max_queue=max_queue)
        self._piece = {}  # token id -> its text (log-prob entries)

    @property
    def batches_run(self) -> int:
        """Decode chunks run so far (every live row takes part in each)."""
        return self.engine.stats["decode_chunks"]

    def close(self) -> None:
        self.engine.close()

    def lists_tools(self, tools: list[dict]) -> bool:
        """Whether this model's chat template lists ``tools`` itself (``apply_chat_template(tools=)``)."""
        return system_with_tools(self.tokenizer, "-", tools, self.framing) is not None

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

    def logprob_entry(self, token: int, logprob: float, top_ids, top_lps, top: int) -> dict:
        """One token's log-prob in OpenAI's chat form (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
        def piece(i: int) -> dict:
            text = self._piece.get(i)
            if text is None:
                text = self._piece[i] = self.tokenizer.decode([i])
            return {"token": text, "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return {**piece(token), "logprob": float(logprob),
                "top_logprobs": [{**piece(int(i)), "logprob": float(lp)} for i, lp in zip(top_ids[:top], top_lps[:top])]}

    def start(self, request: ChatRequest, on_event: Callable[[Row, str, Any], None]) -> list[Row]:
        """Submit ``request``'s rows to the engine; ``on_event(row, kind, payload)`` is called from the
        engine's thread. Raises ``QueueFull`` when the engine's queue is full (no row was queued)."""
        if self.engine.waiting.qsize() + request.n > self.engine.max_queue:
            raise QueueFull(f"{self.engine.waiting.qsize()} requests are waiting (the queue holds "
                            f"{self.engine.max_queue})")
        rows = [Row(self, request, k) for k in range(request.n)]
        for row in rows:
            row.job = Job(prompt=request.prompt, max_tokens=request.max_tokens, temperature=request.temperature,
                          top_p=request.top_p, seed=request.seed, row=row.index,
                          presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                          top_logprobs=request.top_logprobs if request.logprobs else 0,
                          emit=lambda kind, payload, row=row: on_event(row, kind, payload))
            self.engine.submit(row.job)
        return rows

    def run(self, requests: list[ChatRequest]) -> list[list[tuple[str, str, int]]]:
        """Every row of ``requests`` decoded in process (no HTTP), sharing the engine's batch -> per
        request, per row ``(text, finish_reason, completion tokens)``."""
        done = threading.Semaphore(0)
        all_rows = []

        def on_event(row: Row, kind: str, payload) -> None:
            row.feed(kind, payload)
            if kind == "end":
                done.release()

        for r in requests:
            all_rows.append(self.start(r, on_event))
        for _ in range(sum(r.n for r in requests)):
            done.acquire()
        return [[(row.text_out(), row.finish, row.completion_tokens) for row in rows] for rows in all_rows]


def _bounded(body: dict, key: str, default, low, high, *, integer: bool = False):
    """``body[key]`` (``default`` when absent or null), a number in ``[low, high]``; ``integer``: an int."""
    value = body.get(key)
    if value is None:
        return default
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'} in [{low}, {high}], got {value!r}",
                         param=key)
    return value if integer else float(value)


CHAT_FIELDS = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n",
               "seed", "tools", "tool_choice", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
               "stream", "stream_options", "response_format", "user"}
COMPLETION_FIELDS = {"model", "prompt", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "presence_penalty",
                     "frequency_penalty", "logprobs", "stream", "stream_options", "user", "echo"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def _check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported field(s): {', '.join(map(repr, unknown))}; this endpoint supports "
                         f"{', '.join(sorted(allowed))}", param=unknown[0])


def _sampling(body: dict, generator: Generator, max_tokens_limit: int, prompt: list[int], default_tokens: int) -> dict:
    """The fields every endpoint shares, checked -> ``ChatRequest`` keyword arguments."""
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", param="stop")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _bounded(body, key, min(default_tokens, max_tokens_limit), 1, max_tokens_limit, integer=True)
    if len(prompt) + max_tokens > generator.max_seq_len:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) and {key} ({max_tokens}) exceed the server's "
                         f"context of {generator.max_seq_len} tokens; shorten the prompt or lower {key}", param=key,
                         code="context_length_exceeded")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", param="seed")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise BadRequest("'stream_options' must be {'include_usage': true or false}", param="stream_options")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    return dict(prompt=prompt, n=_bounded(body, "n", 1, 1, MAX_N, integer=True),
                temperature=_bounded(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_bounded(body, "top_p", 1.0, 0.0, 1.0), max_tokens=max_tokens, stop=tuple(stop),
                seed=secrets.randbits(31) if seed is None else seed % (1 << 31),
                presence_penalty=_bounded(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_bounded(body, "frequency_penalty", 0.0, -2.0, 2.0),
                stream=stream, include_usage=bool((options or {}).get("include_usage", False)))


def parse_request(body: Any, generator: Generator, max_tokens_limit: int) -> ChatRequest:
    """A chat completion body -> ``ChatRequest`` (raises ``BadRequest`` naming the field)."""
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    messages = [_message(k, m) for k, m in enumerate(messages)]
    if not any(m["role"] in ("user", "system", "tool") for m in messages):
        raise BadRequest("'messages' needs a system, user or tool message; an assistant message alone has nothing "
                         "to answer", param="messages")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"'tool_choice' {choice!r} is not supported: use 'auto' (the model decides) or 'none'",
                         param="tool_choice")
    if tools is not None:
        try:
            tools = check_tools(tools)
        except ValueError as e:
            raise BadRequest(str(e), param="tools") from None
    if choice == "none":
        tools = None
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest(f"'response_format' {fmt!r} is not supported (the reply is not constrained to JSON); "
                         "only {'type': 'text'}", param="response_format")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be true or false", param="logprobs")
    top = _bounded(body, "top_logprobs", 0, 0, TOP_LOGPROBS, integer=True)
    if top and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    try:
        prompt = generator.prompt_tokens(messages, tools)
    except Exception as e:  # noqa: BLE001 - a conversation the chat template cannot render
        raise BadRequest(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                         param="messages") from None
    return ChatRequest(**_sampling(body, generator, max_tokens_limit, prompt, 256), tools=tools, logprobs=logprobs,
                       top_logprobs=top)


def parse_completion(body: Any, generator: Generator, max_tokens_limit: int) -> list[ChatRequest]:
    """A legacy ``/v1/completions`` body -> one ``ChatRequest`` per prompt (raw text, no template)."""
    _check_fields(body, COMPLETION_FIELDS)
    if body.get("echo"):
        raise BadRequest("'echo' is not supported", param="echo")
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("'prompt' must be a non-empty string or a list of non-empty strings", param="prompt")
    top = body.get("logprobs")
    top = 0 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 5:
        raise BadRequest("'logprobs' must be an integer in [0, 5] (top log-probs per token)", param="logprobs")
    out = []
    for p in prompts:
        ids = list(generator.tokenizer(p, add_special_tokens=False)["input_ids"])
        out.append(ChatRequest(**_sampling(body, generator, max_tokens_limit, ids, 16), logprobs="logprobs" in body
                               and body["logprobs"] is not None, top_logprobs=top))
    return out


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


def _depth_ok(raw: bytes) -> bool:
    """The JSON text nests at most ``MAX_DEPTH`` levels (counted outside strings, before parsing: a
    5,000-deep body never reaches the parser's recursion)."""
    depth, in_string, escaped = 0, False, False
    for ch in raw.decode("utf-8", "replace"):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _no_lone_surrogates(value) -> bool:
    """Every string in ``value`` encodes to UTF-8 (JSON may carry a lone ``\\ud800``; a tokenizer cannot)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_no_lone_surrogates(k) and _no_lone_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_no_lone_surrogates(v) for v in value)
    return True


def _parse_body(raw: bytes):
    """The request's JSON (run off the event loop: a large body must not stall other requests)."""
    if not _depth_ok(raw):
        raise BadRequest(f"the JSON body nests deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise BadRequest("the body is not JSON") from None
    if not _no_lone_surrogates(body):
        raise BadRequest("the body holds a string with a lone surrogate (invalid UTF-16 in a \\u escape)")
    return body


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class OpenAIServer:
    """What the endpoints do, one named stage each: ``read`` a body into requests, ``launch`` their
    rows on the engine, wait for them (``until_done``) or ``stream`` them, and shape the reply
    (``chat_choice`` / ``completion_choice``, ``usage``). A body that has not arrived
    ``body_timeout_s`` after the request head gets a 408."""

    def __init__(self, generator: Generator, model_name: str, *, max_tokens_limit: int, max_body_bytes: int,
                 body_timeout_s: float):
        self.generator, self.model_name = generator, model_name
        self.max_tokens_limit, self.max_body_bytes, self.body_timeout_s = max_tokens_limit, max_body_bytes, body_timeout_s
        self.served = {"id": model_name, "object": "model", "created": 0, "owned_by": "ragen_jax"}

    def unknown_model(self, name: str) -> BadRequest:
        return BadRequest(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                          param="model", status=404, code="model_not_found")

    def stats(self) -> dict:
        engine = self.generator.engine
        return {**engine.stats, "requests_done": engine.stats["requests"], "decode_batches": self.generator.batches_run,
                "busy_rows": engine.busy_slots, "waiting": engine.waiting.qsize()}

    async def read(self, http: Request, parse):
        """The body parsed by ``parse`` -> ``(request(s), None)``, or ``(None, the error response)``."""
        try:
            raw = await asyncio.wait_for(read_body(http, self.max_body_bytes), self.body_timeout_s)
            body = await asyncio.to_thread(_parse_body, raw)
            name = body.get("model") if isinstance(body, dict) else None
            if name is not None and name != self.model_name:
                raise self.unknown_model(name)
            return await asyncio.to_thread(parse, body, self.generator, self.max_tokens_limit), None
        except asyncio.TimeoutError:
            return None, _error(408, f"the body did not arrive within {self.body_timeout_s:g} s",
                                headers={"Connection": "close"})
        except BodyTooLarge as e:
            return None, _error(e.status, str(e))
        except BadRequest as e:
            return None, _error(e.status, str(e), param=e.param, code=e.code)

    def launch(self, requests: list[ChatRequest]):
        """Start every row of ``requests`` -> ``(rows, queue of (row, kind, payload))``; raises
        ``QueueFull`` with none of them left running."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(row, kind, payload):
            loop.call_soon_threadsafe(events.put_nowait, (row, kind, payload))

        rows: list[Row] = []
        try:
            for r in requests:
                rows += self.generator.start(r, on_event)
        except QueueFull:
            _cancel(rows)
            raise
        return rows, events

    async def until_done(self, http: Request, rows: list[Row], events, on_delta=None) -> bool:
        """Feed the rows their events until all ended; False when the client went away first (its
        rows are then cancelled: their slots free at the engine's next chunk)."""
        pending, checked = len(rows), time.monotonic()
        while pending:
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # between events too: they may never pause
                checked = time.monotonic()
                if await http.is_disconnected():
                    _cancel(rows)
                    return False
            try:
                row, kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if row.finish is not None and kind != "end":
                continue
            was_open = row.finish is None
            delta, entries = row.feed(kind, payload)
            if on_delta is not None and (delta or entries or (was_open and row.finish is not None)):
                await on_delta(row, delta, entries)
            if kind == "end":
                pending -= 1
        return True

    @staticmethod
    def usage(requests: list[ChatRequest], rows: list[Row]) -> dict:
        prompt = sum(len(r.prompt) for r in requests)
        completion = sum(row.completion_tokens for row in rows)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def chat_choice(row: Row) -> dict:
        message, called = reply_message(row.text_out(), row.request.tools)
        logprobs = {"content": row.logprobs[:row.sent_tokens]} if row.request.logprobs else None
        return {"index": row.index, "message": message, "finish_reason": "tool_calls" if called else row.finish,
                "logprobs": logprobs}

    @staticmethod
    def completion_choice(row: Row, index: int) -> dict:
        return {"index": index, "text": row.text_out(), "finish_reason": row.finish,
                "logprobs": _legacy_logprobs(row.logprobs[:row.sent_tokens]) if row.request.logprobs else None}

    async def respond(self, http: Request, requests: list[ChatRequest], kind: str):
        """The whole reply of a ``kind`` ("chat" / "completion") request, or its event stream."""
        try:
            rows, events = self.launch(requests)
        except QueueFull as e:
            return _error(429, f"the server is busy: {e}; retry shortly", kind="rate_limit_error",
                          headers={"Retry-After": "1"})
        head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}",
                "created": int(time.time()), "model": self.model_name}
        if requests[0].stream:
            return StreamingResponse(self.stream(http, requests, rows, events, head, kind),
                                     media_type="text/event-stream")
        if not await self.until_done(http, rows, events):
            return _error(499, "the client closed the request")
        if any(row.finish == "error" for row in rows):
            return _error(500, "the decode failed; see the server's log", kind="server_error")
        if kind == "chat":
            choices = [self.chat_choice(row) for row in rows]
        else:
            choices = [self.completion_choice(row, i) for i, row in enumerate(rows)]
        return {**head, "object": "chat.completion" if kind == "chat" else "text_completion", "choices": choices,
                "usage": self.usage(requests, rows)}

    @staticmethod
    def stream_choice(row: Row, delta: str, entries: list[dict], kind: str) -> dict:
        """One streamed choice: a text delta with its log-probs, or (a chat reply that called tools,
        at its end) the calls parsed from the whole reply."""
        if kind != "chat":
            return {"index": row.index, "text": delta, "finish_reason": row.finish,
                    "logprobs": _legacy_logprobs(entries) if row.request.logprobs else None}
        if row.request.tools and row.finish is not None:
            message, called = reply_message(row.text_out(), row.request.tools)
            if called:
                return {"index": row.index, "logprobs": None, "finish_reason": "tool_calls",
                        "delta": {"tool_calls": [dict(c, index=k) for k, c in enumerate(message["tool_calls"])]}}
        return {"index": row.index, "delta": {"content": delta} if delta else {},
                "logprobs": {"content": entries} if row.request.logprobs else None, "finish_reason": row.finish}

    async def stream(self, http: Request, requests: list[ChatRequest], rows: list[Row], events, head: dict, kind: str):
        """Server-sent events: one chunk per text delta, the finish reason, usage if asked, ``[DONE]``."""
        out: asyncio.Queue = asyncio.Queue()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices, **extra):
            return {**head, "object": obj, "choices": choices, **extra}

        async def on_delta(row, delta, entries):
            await out.put(chunk([self.stream_choice(row, delta, entries, kind)]))

        if kind == "chat":  # the role first, as OpenAI's stream opens
            for row in rows:
                yield _sse(chunk([{"index": row.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]))
        task = asyncio.create_task(self.until_done(http, rows, events, on_delta))
        try:
            while not (task.done() and out.empty()):
                try:
                    item = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                yield _sse(item)
            if requests[0].include_usage:
                yield _sse(chunk([], usage=self.usage(requests, rows)))
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): free every row still decoding
            _cancel(rows)
            task.cancel()


def _cancel(rows: list[Row]) -> None:
    for row in rows:
        if row.job is not None:
            row.job.cancelled = True


def make_app(generator: Generator, model_name: str, *, max_tokens_limit: int = 1024, max_body_bytes: int = 1 << 20,
             body_timeout_s: float = 10.0):
    """The FastAPI application: ``OpenAIServer``'s stages behind the OpenAI routes."""
    server = OpenAIServer(generator, model_name, max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes,
                          body_timeout_s=body_timeout_s)
    app = FastAPI(title="ragen_jax policy server")
    app.state.generator = generator

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.served]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            e = server.unknown_model(model_id)
            return _error(e.status, str(e), param=e.param, code=e.code)
        return server.served

    @app.get("/stats")
    async def stats():
        return server.stats()

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        request, error = await server.read(http, parse_request)
        return error if error is not None else await server.respond(http, [request], "chat")

    @app.post("/v1/completions")
    async def completions(http: Request):
        requests, error = await server.read(http, parse_completion)
        return error if error is not None else await server.respond(http, requests, "completion")

    return app


def _sse(item: dict) -> str:
    return f"data: {json.dumps(item, ensure_ascii=False)}\n\n"


def _legacy_logprobs(entries: list[dict]) -> dict:
    """Chat log-prob entries in ``/v1/completions``' form."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


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
    ap.add_argument("--max_batch", type=int, default=32, help="rows decoding at once (the KV cache's rows)")
    ap.add_argument("--max_seq_len", type=int, default=None, help="prompt + reply tokens (default: rollout.max_seq_len)")
    ap.add_argument("--max_tokens_limit", type=int, default=1024)
    ap.add_argument("--max_body_bytes", type=int, default=1 << 20)
    ap.add_argument("--chunk", type=int, default=8, help="decode steps between joins and leaves")
    ap.add_argument("--max_queue", type=int, default=256, help="requests waiting for a row before a 429")
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
                          max_batch=args.max_batch, tokenization=tokenization, chunk=args.chunk,
                          max_queue=args.max_queue)
    name = args.model_name or (Path(args.workdir).name if args.workdir else spec.model.preset)
    app = make_app(generator, name, max_tokens_limit=args.max_tokens_limit, max_body_bytes=args.max_body_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host}:{args.port}, reachable from other machines; the server has no "
              "authentication", file=sys.stderr)

    # A connection must send its request head within the keep-alive time (uvicorn alone waits forever).
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=5,
                http=HeadTimeoutH11Protocol)


if __name__ == "__main__":
    main()
