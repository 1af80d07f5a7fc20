"""Evaluation of a policy behind an OpenAI-compatible API (``model.provider``), all traffic on 127.0.0.1
through the real ``openai`` client:

* a tiny trained checkpoint served by ``ragen_jax.serve`` and evaluated through the API at
  temperature 0 plays exactly the episodes the in-process evaluation plays (same transcripts, same
  per-episode outcomes) — the served model and the loop's own sampler are independent decoders;
* a server that answers 500, times out or drops the connection is retried, then reported per
  episode while the other episodes finish; a reply that ignores the format is a format penalty;
* the OpenAI-message JSONL validates as the ``openai`` package's own message types and renders,
  through the tokenizer's chat template, to the transcript;
* the API key is sent to the server and written nowhere.

Seeded: the validation puzzles come from ``eval.validation_seed``; the trained checkpoint from the
config's seeds.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import zlib
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")

from ragen_jax.config import ConfigError, resolve  # noqa: E402
from ragen_jax.serve import Generator, load_policy, make_app  # noqa: E402
from ragen_jax.training.evaluate import run_eval  # noqa: E402
from tests.local_server import serving  # noqa: E402
from tests.training.test_trainer import small_config_dict  # noqa: E402

VALID_REPLY = "<think>The goal is below.</think><answer>Down</answer>"


def _records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny FrozenLake policy with enough warm-up to solve some puzzles (so outcomes differ)."""
    from ragen_jax.training.trainer import train

    workdir = tmp_path_factory.mktemp("trained")
    config = small_config_dict(workdir, total_steps=1)
    config.warmup.update(dict(single_turn_steps=300, steps=200, num_states=64, batch_size=16))
    train(resolve(config))
    return workdir, config


def _eval_config(config, workdir, **model):
    c = resolve(config).config
    c.workdir = str(workdir)
    c.mode = "eval"
    c.eval.temperature = 0.0
    c.eval.num_episodes = 8
    c.trainer.progress_bar = False
    for k, v in model.items():
        c.model[k] = v
    return c


def test_served_checkpoint_through_the_api_plays_the_in_process_episodes(trained, tmp_path):
    workdir, config = trained
    local = run_eval(resolve(_eval_config(config, workdir)))
    graphdef, params, model_cfg, tokenizer = load_policy(resolve(config), str(workdir))
    generator = Generator(graphdef, params, model_cfg, tokenizer, max_seq_len=512, max_batch=16,
                          tokenization="rollout")
    with serving(make_app(generator, "tiny-frozen-lake", max_tokens_limit=64)) as base:
        remote = run_eval(resolve(_eval_config(config, tmp_path, provider="openai", base_url=base + "/v1",
                                               name="tiny-frozen-lake", continue_final_message=True)))
    ours = _records(workdir / "eval" / "transcripts_step1.jsonl")
    theirs = _records(tmp_path / "eval" / "transcripts_tiny-frozen-lake.jsonl")
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        for key in ("puzzle", "success", "return", "num_turns", "num_actions", "turn_rewards", "transcript"):
            assert a[key] == b[key], key
    assert 0 < sum(r["success"] for r in ours) < 8  # outcomes differ between puzzles: the check has teeth
    for key in ("val/success", "val/return", "val/valid_action_rate", "val/effective_action_rate"):
        assert remote[key] == local[key]
    # One request per turn played; concurrent requests decoded together (continuous batching).
    assert remote["api/requests"] == sum(r["num_turns"] for r in ours) == remote["api/http_attempts"]
    assert remote["api/failed_episodes"] == 0 and remote["api/prompt_tokens"] > 0
    assert generator.engine.stats["max_rows"] > 1
    summary = json.loads((tmp_path / "eval" / "summary_tiny-frozen-lake.json").read_text())
    assert summary["metrics"]["api/requests"] == remote["api/requests"]


def test_messages_jsonl_reads_back_as_openai_messages(trained):
    from pydantic import TypeAdapter
    from openai.types.chat import ChatCompletionMessageParam

    from ragen_jax.models.presets import load_tiny_tokenizer

    workdir, config = trained
    run_eval(resolve(_eval_config(config, workdir)))
    transcripts = _records(workdir / "eval" / "transcripts_step1.jsonl")
    exported = _records(workdir / "eval" / "messages_step1.jsonl")
    tokenizer = load_tiny_tokenizer()
    adapter = TypeAdapter(list[ChatCompletionMessageParam])
    for t, e in zip(transcripts, exported, strict=True):
        messages = adapter.validate_python(e["messages"])
        roles = [m["role"] for m in messages]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2)
        assert len(roles) == 1 + 2 * t["num_turns"]
        assert all(m["content"].startswith("<think>") for m in messages if m["role"] == "assistant")
        # The tokenizer's own chat template renders the exported messages back to the transcript.
        assert tokenizer.apply_chat_template(e["messages"], tokenize=False) == t["transcript"]
        assert {k: e[k] for k in ("puzzle", "success", "return")} == {k: t[k] for k in ("puzzle", "success", "return")}


# ---- a scripted OpenAI-compatible server: failures, timeouts, format, keys -----------------------
class Scripted:
    """``/v1/chat/completions`` whose behaviour the ``model`` field picks; it honours ``stop`` the
    OpenAI way (the text cut before the stop string) and records every attempt."""

    def __init__(self):
        self.attempts: dict[str, int] = {}
        self.authorization: set[str] = set()
        app = fastapi.FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: fastapi.Request):
            body = await request.json()
            self.authorization.add(request.headers.get("authorization", ""))
            first_user = next(m["content"] for m in body["messages"] if m["role"] == "user")
            key = f"{body['model']}|{len(body['messages'])}|{first_user}"
            self.attempts[key] = self.attempts.get(key, 0) + 1
            kind = body["model"]
            if kind == "mixed":  # per puzzle: always 500 / fine / 503 on the first attempt only
                kind = ("broken", "valid", "flaky")[zlib.crc32(first_user.encode()) % 3]
            if kind == "broken":
                return fastapi.responses.JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
            if kind == "flaky" and self.attempts[key] == 1:
                return fastapi.responses.JSONResponse({"error": {"message": "try again"}}, status_code=503)
            if kind == "slow":
                await asyncio.sleep(3.0)
            text = "Sure! I would move down, then right." if kind == "chatty" else VALID_REPLY
            finish = "stop"
            for stop in body.get("stop") or []:
                if stop in text:
                    text = text[:text.index(stop)]
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

        self.app = app


@pytest.fixture(scope="module")
def scripted():
    server = Scripted()
    with serving(server.app) as base:
        yield base + "/v1", server


def _api_eval(tmp_path, url, name, **model):
    config = small_config_dict(tmp_path, total_steps=1)
    c = _eval_config(config, tmp_path, provider="openai", base_url=url, name=name, **model)
    c.eval.num_episodes = 12
    # The whole conversation in every request (the served-checkpoint test covers the limited window),
    # so the scripted server can tell the puzzle from the first user message at every turn.
    c.rollout.context_mode = "full"
    return run_eval(resolve(c)), _records(tmp_path / "eval" / f"transcripts_{name}.jsonl")


def test_failing_requests_are_retried_then_reported_per_episode(scripted, tmp_path):
    url, server = scripted
    metrics, records = _api_eval(tmp_path, url, "mixed", max_retries=2)
    kinds = []
    for r in records:
        first_user = r["transcript"].split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        kinds.append(("broken", "valid", "flaky")[zlib.crc32(first_user.encode()) % 3])
    assert {"broken", "valid"} <= set(kinds)  # both kinds of puzzle among the 12
    for kind, r in zip(kinds, records):
        if kind == "broken":
            assert "InternalServerError (HTTP 500)" in r["api_error"] and "overloaded" in r["api_error"]
            assert r["num_turns"] == 1 and r["turn_rewards"] == [0.0] and not r["success"]
        else:  # a 503 on the first attempt is retried and never reaches the episode
            assert "api_error" not in r
            assert "<answer>Down</answer>" in r["transcript"]  # the stop string the server cut is put back
            assert all(x >= 0.0 for x in r["turn_rewards"])  # a well-formed reply: no format penalty
    broken = kinds.count("broken")
    assert metrics["api/failed_episodes"] == metrics["api/failed_requests"] == broken
    # Every attempt that reached the server is counted; each broken request was tried 1 + max_retries
    # times, and each flaky one retried once.
    seen = {k: n for k, n in server.attempts.items() if k.startswith("mixed|")}
    assert metrics["api/http_attempts"] == sum(seen.values()) > metrics["api/requests"]
    for key, n in seen.items():
        first_user = key.split("|", 2)[2]
        kind = ("broken", "valid", "flaky")[zlib.crc32(first_user.encode()) % 3]
        assert n % 3 == 0 if kind == "broken" else True


def test_timeouts_and_dropped_connections_are_reported_per_episode(scripted, tmp_path):
    url, _ = scripted
    t0 = time.time()
    metrics, records = _api_eval(tmp_path / "slow", url, "slow", request_timeout_s=0.5, max_retries=1)
    assert time.time() - t0 < 60
    assert all("APITimeoutError" in r["api_error"] for r in records)
    assert metrics["api/failed_episodes"] == 12 and metrics["api/http_attempts"] == 24

    # A server that accepts and closes every connection without answering.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()

    def drop():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=drop, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        metrics, records = _api_eval(tmp_path / "drop", f"http://127.0.0.1:{port}/v1", "drop", max_retries=1)
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert all("APIConnectionError" in r["api_error"] for r in records)
    assert metrics["api/failed_episodes"] == 12


def test_a_reply_that_ignores_the_format_is_a_format_penalty(scripted, tmp_path):
    url, _ = scripted
    metrics, records = _api_eval(tmp_path, url, "chatty")
    max_turns = small_config_dict(tmp_path, total_steps=1).rollout.max_turns
    for r in records:
        assert "api_error" not in r
        assert r["num_turns"] == max_turns and r["turn_rewards"] == pytest.approx([-0.1] * max_turns)
        assert "No valid action provided previously" in r["transcript"]  # the loop's own warning
    assert metrics["val/valid_action_rate"] == 0.0 and metrics["val/success"] == 0.0


def test_the_key_is_sent_and_written_nowhere(scripted, tmp_path, monkeypatch):
    url, server = scripted
    secret = "sk-planted-" + "7" * 24
    monkeypatch.setenv("PLANTED_KEY", secret)
    _api_eval(tmp_path, url, "valid", api_key_env="PLANTED_KEY")
    assert f"Bearer {secret}" in server.authorization
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not any(secret.encode() in p.read_bytes() for p in files)


def test_remote_settings_fail_early_with_the_fix(tmp_path, monkeypatch):
    config = small_config_dict(tmp_path, total_steps=1)
    c = resolve(config).config
    c.model.provider, c.model.name = "openai", "gpt-4o-mini"
    with pytest.raises(ConfigError, match="can be evaluated .*--config.mode=eval"):
        resolve(c)  # mode=train
    c.mode = "eval"
    c.model.name = None
    with pytest.raises(ConfigError, match="model.name=None: a remote policy"):
        resolve(c)
    c.model.name = "gpt-4o-mini"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="model.api_key_env='OPENAI_API_KEY': the environment variable is not set"):
        run_eval(resolve(c))
    c.model.provider = "mistral"
    with pytest.raises(ConfigError, match="model.provider='mistral' is not valid; allowed: local, openai, anthropic"):
        resolve(c)


# ---- a hosted model that calls tools through the API's ``tools`` parameter ---------------------------
class ToolCaller:
    """A scripted tool-calling model: with no tool result yet it calls ``search`` with the question
    (OpenAI ``tool_calls``, no text); once the last user message holds a result, it answers with the
    result's first capitalised word after "in". It records the ``tools`` each request carried."""

    def __init__(self):
        self.tools: list = []
        app = fastapi.FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: fastapi.Request):
            body = await request.json()
            self.tools.append(body.get("tools"))
            users = [m["content"] for m in body["messages"] if m["role"] == "user"]
            question = users[0].split("Question: ", 1)[1].split("\n", 1)[0]
            if "<tool_response>" not in users[-1]:
                message = {"role": "assistant", "content": "<think>I should search.</think>", "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "search", "arguments": json.dumps({"query": question})}}]}
                finish = "tool_calls"
            else:
                words = users[-1].split(" in ", 1)[-1].split()
                message = {"role": "assistant", "content": f"<think>Found it.</think><answer>finish[{words[0].strip('.,')}]"}
                finish = "stop"
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

        self.app = app


def test_a_hosted_model_calls_our_tools_through_the_api(tmp_path):
    """The tool task through a hosted model's own tool calling: every request carries the
    environment's tool schema as ``tools``; the returned ``tool_calls`` reach the environment as a
    local model's <tool_call> text would (the tool runs, its result comes back as <tool_response>),
    the final answer is scored. ``model.api_tools=False`` sends no ``tools``."""
    pytest.importorskip("bm25s")
    from configs import search_tools

    caller = ToolCaller()
    with serving(caller.app) as base:
        c = search_tools.get_config()
        c.workdir = str(tmp_path)
        c.mode = "eval"
        c.eval.num_episodes = 4
        c.eval.temperature = 0.0
        c.trainer.progress_bar = False
        c.rollout.context_mode = "full"
        c.model.update(dict(provider="openai", base_url=base + "/v1", name="tool-caller"))
        metrics = run_eval(resolve(c))
        records = _records(tmp_path / "eval" / "transcripts_tool-caller.jsonl")
        sent = caller.tools
        assert sent and all(t is not None and [x["function"]["name"] for x in t] == ["search"] for t in sent)
        for r in records:
            assert "api_error" not in r and r["num_turns"] == 2
            assert '<answer><tool_call>\n{"name": "search", "arguments": {"query": ' in r["transcript"]
            assert "<tool_response>" in r["transcript"]
        assert metrics["val/valid_action_rate"] == 1.0
        c.model.api_tools = False
        caller.tools.clear()
        run_eval(resolve(c))
        assert caller.tools and all(t is None for t in caller.tools)
