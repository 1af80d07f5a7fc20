"""A policy behind an OpenAI-compatible chat API, inside the same rollout loop as a local model.

``config.mode=eval --config.model.provider=openai --config.model.name=...`` evaluates a hosted model
(or ``ragen_jax.serve``, vLLM, any OpenAI-compatible server) with everything else unchanged: the
environments, the system prompt and user blocks, the forced ``<think>``, the parser, the format
penalty, the action budgets and the metrics are the rollout's own (``rollout.loop``). Only the
reply crosses to the host: at each turn one ``io_callback`` hands over every row's transcript;
``RemoteReplies`` cuts it into chat messages (``chat.split_conversation``), asks the API for the
replies of all active rows at once (``ChatClient``, up to ``max_concurrency`` requests in flight),
and writes each reply's tokens (the preset's tokenizer) back into the transcript, where the device
parses it and steps the environments exactly as after a sampled reply.

Replies. ``max_tokens`` is the rollout's ``max_new_tokens``; a reply longer than that many tokens
of the local tokenizer is cut there (as a sampled one would be). With ``stop_at_answer`` the API is
asked to stop at ``</answer>``, which OpenAI-style servers leave out of the text: it is put back
when the reply stopped with an ``<answer>`` still open. Unless ``continue_final_message`` sends the
forced opening (``<think>``) for the server to continue, the reply is expected to start with it
and the copy it writes is dropped (the transcript already holds the forced one); a reply that does
not follow the format is a format penalty, as in training.

Failures. The ``openai`` client retries 408 / 409 / 429 / 5xx, timeouts and dropped connections
``max_retries`` times with exponential backoff (honouring ``Retry-After``); a request that still
fails ends that episode only (``RemoteReplies.errors`` names the error per row; the evaluator
reports it per episode and counts it in ``api/failed_episodes``). Usage (requests, HTTP attempts,
prompt and completion tokens, cut replies) is summed in ``ChatClient.usage``.

The key is read from the environment variable ``model.api_key_env`` when the client is made and
kept only inside it: it never enters the config, the logs or the transcripts.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any
from urllib.parse import urlparse

import numpy as np
from tqdm.auto import tqdm

from ragen_jax.rollout import codec as codec_lib
from ragen_jax.rollout.chat import ChatFraming, split_conversation
from ragen_jax.tools.openai_format import calls_in_answer

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One reply: its ``text`` and ``finish_reason`` (``"stop"`` / ``"length"``), or the ``error`` that
    ended the request after its retries (then ``text`` is empty)."""

    text: str = ""
    finish_reason: str = "stop"
    error: str | None = None


class ChatClient:
    """Concurrent chat completions through the official ``openai`` client.

    ``complete(conversations, sampling)`` sends one request per conversation (at most
    ``max_concurrency`` at a time) and returns a ``Completion`` per conversation, in order; a request
    that fails after its retries comes back as a ``Completion`` with ``error`` set, never as an
    exception.
    """

    def __init__(self, model_section, *, progress: bool = True, tools: list[dict] | None = None):
        import openai

        m = model_section
        # A tool environment's schemas, sent as the API's ``tools`` (``model.api_tools``).
        self.tools = list(tools) if tools and m.api_tools else None
        self.model = m.name
        self.base_url = m.api_base_url
        self.continue_final_message = bool(m.continue_final_message)
        key = os.environ.get(m.api_key_variable)
        if not key:
            if urlparse(self.base_url).hostname not in LOCAL_HOSTS:
                raise ValueError(
                    f"model.api_key_env={m.api_key_variable!r}: the environment variable is not set; export it "
                    f"with the key for {self.base_url} (keys are read from the environment only, never from "
                    "a config)")
            key = "unused"  # a server on this machine (ragen_jax.serve, vLLM) needs none
        self.usage = dict(requests=0, attempts=0, failed_requests=0, prompt_tokens=0, completion_tokens=0,
                          cut_replies=0)
        self._lock = threading.Lock()
        # Count HTTP attempts (retries included) with a request hook of the client's own transport.
        http = openai.DefaultHttpxClient(event_hooks={"request": [self._count_attempt]})
        self._client = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=int(m.max_retries),
                                     timeout=float(m.request_timeout_s), http_client=http)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(m.max_concurrency),
                                                           thread_name_prefix="chat-api")
        self._bar = None
        if progress:
            self._bar = tqdm(desc=f"{self.model} requests", unit="req", leave=False)

    def _count_attempt(self, request) -> None:
        with self._lock:
            self.usage["attempts"] += 1

    def complete(self, conversations: list[list[dict]], sampling: dict) -> list[Completion]:
        """``sampling``: ``temperature``, ``top_p``, ``max_tokens``, ``stop`` (list or None), ``seeds``
        (one int per conversation)."""
        seeds = sampling["seeds"]
        jobs = [self._pool.submit(self._one, msgs, sampling, seed) for msgs, seed in zip(conversations, seeds)]
        return [j.result() for j in jobs]

    def _one(self, messages: list[dict], sampling: dict, seed: int) -> Completion:
        import openai

        kwargs: dict[str, Any] = dict(model=self.model, messages=messages, max_tokens=sampling["max_tokens"],
                                      temperature=sampling["temperature"], seed=int(seed))
        if sampling["top_p"] < 1.0:
            kwargs["top_p"] = sampling["top_p"]
        if sampling["stop"]:
            kwargs["stop"] = sampling["stop"]
        if self.tools:
            kwargs["tools"] = self.tools
        try:
            response = self._client.chat.completions.create(**kwargs)
            choice = response.choices[0]
            text = choice.message.content or ""
            finish = choice.finish_reason or "stop"
            calls = choice.message.tool_calls or []
            if calls:  # the transcript holds them as a local model writes them; the reply ended there
                text = calls_in_answer(text, [c.model_dump() for c in calls])
                finish = "stop"
            result = Completion(text=text, finish_reason=finish)
        except (openai.OpenAIError, IndexError, AttributeError, TypeError, ValueError) as e:
            # An error status after the retries, a timeout, a dropped connection, or a body that is
            # not a chat completion: this request's episode ends; the eval goes on.
            result = Completion(error=_describe(e))
            response = None
        with self._lock:
            u = self.usage
            u["requests"] += 1
            if result.error is not None:
                u["failed_requests"] += 1
            usage = getattr(response, "usage", None)
            if usage is not None:
                u["prompt_tokens"] += int(getattr(usage, "prompt_tokens", 0) or 0)
                u["completion_tokens"] += int(getattr(usage, "completion_tokens", 0) or 0)
            if result.finish_reason == "length":
                u["cut_replies"] += 1
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix(tokens=u["prompt_tokens"] + u["completion_tokens"],
                                      failed=u["failed_requests"], refresh=False)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
        if self._bar is not None:
            self._bar.close()


def _describe(error: Exception) -> str:
    """One line naming a failed request's error (status code and the server's message where there is one)."""
    status = getattr(error, "status_code", None)
    text = str(error).splitlines()[0] if str(error) else ""
    head = type(error).__name__ + (f" (HTTP {status})" if status is not None else "")
    return f"{head}: {text[:300]}" if text else head


class RemoteReplies:
    """The host side of a rollout whose replies come from a ``ChatClient``: transcript tokens →
    messages → API → reply tokens. Called by ``Rollout`` once per turn through ``io_callback``.

    ``errors`` maps a batch row to the error that ended its episode in the current rollout (it is
    cleared when a rollout starts, at turn 0).
    """

    def __init__(self, client: ChatClient, tokenizer, framing: ChatFraming, *, preamble_len: int,
                 max_new_tokens: int, forced_prefix: str, stop_at_answer: bool, temperature: float, top_p: float,
                 continue_final_message: bool, pad_id: int, seed: int = 0):
        self.client = client
        self.tokenizer = tokenizer
        self.framing = framing
        self.preamble_len = preamble_len
        self.max_new_tokens = max_new_tokens
        self.forced_prefix = forced_prefix
        self.stop_at_answer = stop_at_answer
        self.continue_final_message = continue_final_message
        self.pad_id = pad_id
        self.sampling = dict(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_new_tokens),
                             stop=["</answer>"] if stop_at_answer else None)
        self.seed = seed
        self.rollouts = 0
        self.errors: dict[int, str] = {}

    def conversation(self, tokens: np.ndarray, context_start: int, prompt_end: int) -> list[dict]:
        """The messages one row's turn sees: the preamble (system prompt) and its visible history
        ``tokens[context_start:prompt_end]``, which ends with the forced opening of the reply."""
        text = (codec_lib.decode(self.tokenizer, tokens[:self.preamble_len])
                + codec_lib.decode(self.tokenizer, tokens[context_start:prompt_end]))
        messages, opening = split_conversation(self.framing, text)
        if self.continue_final_message and opening:
            messages.append({"role": "assistant", "content": opening})
        return messages

    def reply_tokens(self, completion: Completion, opening_sent: bool) -> tuple[list[int], bool]:
        """``(token ids, stopped)`` of a reply as it goes into the transcript after the forced opening."""
        text = completion.text
        if not opening_sent:
            stripped = text.lstrip()
            if self.forced_prefix and stripped.startswith(self.forced_prefix):
                text = stripped[len(self.forced_prefix):]
        if self.stop_at_answer and completion.finish_reason == "stop":
            full = self.forced_prefix + text
            if full.count("<answer>") > full.count("</answer>"):
                text += "</answer>"  # the stop string the server left out
        ids = codec_lib.encode(self.tokenizer, text)
        stopped = completion.finish_reason != "length" and len(ids) <= self.max_new_tokens
        return ids[:self.max_new_tokens], stopped

    def __call__(self, buf, context_start, prompt_end, active, turn):
        """``buf [B, L]``, ``context_start / prompt_end [B]``, ``active [B]``, ``turn []`` (numpy) ->
        ``(tokens [B, N], lengths [B], stopped [B], failed [B])``."""
        buf, active = np.asarray(buf), np.asarray(active)
        B, N = active.shape[0], self.max_new_tokens
        if int(turn) == 0:
            self.errors = {}
            self.rollouts += 1
        tokens = np.full((B, N), self.pad_id, np.int32)
        lengths = np.zeros((B,), np.int32)
        stopped = np.zeros((B,), bool)
        failed = np.zeros((B,), bool)
        rows = [b for b in range(B) if active[b] and b not in self.errors]
        conversations = [self.conversation(buf[b], int(context_start[b]), int(prompt_end[b])) for b in rows]
        # A seed per (rollout, row, turn): a sampled evaluation repeats where the server honours seeds.
        seeds = [(self.seed * 1_000_003 + self.rollouts * 10_007 + b * 101 + int(turn)) % (1 << 31) for b in rows]
        completions = self.client.complete(conversations, dict(self.sampling, seeds=seeds)) if rows else []
        sent = self.continue_final_message and bool(self.forced_prefix)
        for b, completion in zip(rows, completions):
            if completion.error is not None:
                self.errors[b] = completion.error
                failed[b] = True
                continue
            ids, stopped[b] = self.reply_tokens(completion, opening_sent=sent)
            tokens[b, :len(ids)] = ids
            lengths[b] = len(ids)
        return tokens, lengths, stopped, failed
