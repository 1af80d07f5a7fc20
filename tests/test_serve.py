"""The OpenAI-compatible server (``ragen_jax.serve``) on a tiny trained checkpoint, through the real
``openai`` client on 127.0.0.1: greedy replies equal a plain greedy decode of the same checkpoint
(full forward passes and argmax, no KV cache, no batching), concurrent requests share decode
batches, and bad requests get a 4xx that names the problem. Seeded runs (``seed=0``)."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from ragen_jax.config import resolve  # noqa: E402
from ragen_jax.serve import Generator, load_policy, make_app  # noqa: E402
from tests.local_server import serving  # noqa: E402
from tests.training.test_trainer import small_config_dict  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "Turn 1: the board is P_G. Decide your next action."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ragen_jax.training.trainer import train

    workdir = tmp_path_factory.mktemp("served")
    spec = resolve(small_config_dict(workdir, total_steps=1))
    train(spec)
    graphdef, params, model_cfg, tokenizer = load_policy(spec, str(workdir))
    generator = Generator(graphdef, params, model_cfg, tokenizer, max_seq_len=512, max_batch=16)
    app = make_app(generator, "tiny-frozen-lake", max_tokens_limit=64, max_body_bytes=4096,
                   body_timeout_s=1.0)
    with serving(app) as base:
        yield {"url": base, "generator": generator, "app": app, "reference": (graphdef, params, tokenizer)}


def _client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(reference, messages) -> str:
    return reference[2].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _greedy_reference(reference, text: str, max_tokens: int, stop_ids) -> str:
    """Greedy decoding of ``text`` by full forward passes over the growing sequence (no cache, one row)."""
    from flax import nnx

    graphdef, params, tokenizer = reference
    model = nnx.merge(graphdef, params)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    out = []
    for _ in range(max_tokens):
        tokens = np.asarray([ids + out], np.int32)
        logits, _ = model(tokens, np.arange(tokens.shape[1], dtype=np.int32)[None])
        nxt = int(np.argmax(np.asarray(logits[0, -1])))
        if nxt in stop_ids:
            break
        out.append(nxt)
    return tokenizer.decode(out, skip_special_tokens=True)


def test_models_and_a_greedy_reply_equal_a_plain_greedy_decode(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny-frozen-lake"]
    reply = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0, max_tokens=24)
    expected = _greedy_reference(server["reference"], _chat_text(server["reference"], MESSAGES), 24,
                                 set(server["generator"].stop_ids.tolist()))
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # n rows of one request and a stop string: the rows are the same greedy reply, cut before the stop.
    cut = expected[len(expected) // 2:][:3]
    if cut.strip():
        two = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0, max_tokens=24, n=2, stop=[cut])
        assert [c.message.content for c in two.choices] == [expected[:expected.index(cut)]] * 2
        assert {c.finish_reason for c in two.choices} == {"stop"}


def test_concurrent_requests_share_decode_batches(server):
    client = _client(server)
    before = json.load(urllib.request.urlopen(server["url"] + "/stats"))
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda k: client.chat.completions.create(
            model="tiny-frozen-lake", messages=MESSAGES, temperature=1.0, seed=k, max_tokens=8), range(32)))
    after = json.load(urllib.request.urlopen(server["url"] + "/stats"))
    assert len(replies) == 32 and after["requests"] - before["requests"] == 32
    batches = after["decode_batches"] - before["decode_batches"]
    assert 2 <= batches < 32, batches  # 16 rows per batch at most: at least two, far fewer than 32
    # The same seed gives the same sampled reply (alone or batched with others).
    again = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=8)
    assert again.choices[0].message.content == replies[3].choices[0].message.content


def _post(server, body: bytes):
    req = urllib.request.Request(server["url"] + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize("body, status, fragment", [
    ({"messages": MESSAGES, "functions": []}, 400, "unsupported field(s): 'functions'"),
    ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "the model 'gpt-4o' does not exist"),
    ({"messages": [{"role": "assistant", "content": "Hello"}]}, 400, "an assistant message alone"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, 400, "'response_format'"),
    ({"messages": MESSAGES, "top_logprobs": 3}, 400, "'top_logprobs' needs 'logprobs': true"),
    ({"messages": MESSAGES, "presence_penalty": 3}, 400, "'presence_penalty' must be a number in [-2.0, 2.0]"),
    ({"messages": MESSAGES, "tools": []}, 400, "'tools'"),
    ({"messages": MESSAGES, "max_tokens": 65}, 400, "'max_tokens' must be an integer in [1, 64]"),
    ({"messages": MESSAGES, "temperature": -1}, 400, "'temperature'"),
    ({"messages": MESSAGES, "n": 9}, 400, "'n' must be an integer in [1, 8]"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "'stop'"),
    ({"messages": []}, 400, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "only text parts"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "search"}}], "tool_choice": "required"},
     400, "'tool_choice' 'required' is not supported"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "over the server's limit of 4096 bytes"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(server, body, status, fragment):
    code, answer = _post(server, json.dumps(body).encode())
    assert code == status and fragment in answer["error"]["message"], (code, answer)


def test_a_body_that_is_not_json_is_a_400(server):
    code, answer = _post(server, b"{not json")
    assert code == 400 and "not JSON" in answer["error"]["message"]


@pytest.mark.parametrize("args, fragment", [
    (["--workdir", "/nonexistent"], "/nonexistent/config.json does not exist"),
    ([], "pass exactly one of --workdir"),
    (["--config", "configs/frozen_lake.py", "--config.rollout.bogus=1"], "unknown config key 'rollout.bogus'"),
])
def test_start_up_problems_end_in_one_line(args, fragment):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "ragen_jax.serve", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and fragment in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_last_assistant_message_is_continued(server):
    """The forced opening the rollout uses (``<think>``), sent as a last assistant message: the reply
    is the greedy continuation after it, as a plain greedy decode of the same text gives."""
    expected = _greedy_reference(server["reference"], _chat_text(server["reference"], MESSAGES) + "<think>", 16,
                                 set(server["generator"].stop_ids.tolist()))
    reply = _client(server).chat.completions.create(
        model="tiny-frozen-lake", messages=MESSAGES + [{"role": "assistant", "content": "<think>"}], temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == expected


def test_a_prompt_past_half_the_context_still_gets_its_max_tokens(server):
    """A prompt whose bucketed width is the whole context (512): the reply still gets its own
    budget (the cache is sized width + budget), equal to the plain greedy decode."""
    long = [{"role": "user", "content": "Turn 1: the board is P_G. " * 28 + "Decide your next action."}]
    text = _chat_text(server["reference"], long)
    assert 256 < len(server["reference"][2](text, add_special_tokens=False)["input_ids"]) <= 512 - 16
    expected = _greedy_reference(server["reference"], text, 16, set(server["generator"].stop_ids.tolist()))
    reply = _client(server).chat.completions.create(model="tiny-frozen-lake", messages=long, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == expected


def test_a_body_that_stalls_gets_a_408(server):
    """A client that sends its head and part of a body, then nothing: answered 408 after the body
    timeout (1 s here), the connection closed; the server keeps serving."""
    host, port = server["url"].removeprefix("http://").split(":")
    t0 = time.time()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"messages\": ")
        answer = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
    assert time.time() - t0 < 8
    reply = _client(server).chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}


def test_tools_and_tool_results_reach_the_model_as_toolenv_writes_them(server):
    """The tiny model's template lists no tools: the server writes the listing into the system message
    and the call and its result as ToolEnv's episodes do (hand-written below); the greedy reply is
    the plain greedy decode of that text. Text parts and the developer role are read as plain text."""
    from ragen_jax.tools.openai_format import tools_listing

    conversation = [{"role": "developer", "content": [{"type": "text", "text": "You are a helpful "},
                                                      {"type": "text", "text": "agent."}]},
                    MESSAGES[1],
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "G"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "G is the goal."}]
    written = [{"role": "system", "content": "You are a helpful agent.\n\n" + tools_listing([SEARCH])},
               MESSAGES[1],
               {"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": {"query": "G"}}\n</tool_call>'},
               {"role": "user", "content": "<tool_response>\nG is the goal.\n</tool_response>"}]
    reply = _client(server).chat.completions.create(model="tiny-frozen-lake", messages=conversation, tools=[SEARCH], temperature=0,
                                                    max_tokens=16)
    expected = _greedy_reference(server["reference"], _chat_text(server["reference"], written), 16,
                                 set(server["generator"].stop_ids.tolist()))
    assert reply.choices[0].message.content == expected and reply.choices[0].message.tool_calls is None
    # tool_choice="none": the tools are not listed at all.
    plain = _client(server).chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, tools=[SEARCH], tool_choice="none",
                                                    temperature=0, max_tokens=16)
    assert plain.choices[0].message.content == _greedy_reference(
        server["reference"], _chat_text(server["reference"], MESSAGES), 16, set(server["generator"].stop_ids.tolist()))


def test_a_reply_that_calls_a_tool_comes_back_as_tool_calls(server, monkeypatch):
    """What the model wrote is replaced by a canned reply (the tiny model does not call tools): the
    client reads its <tool_call> block as OpenAI's tool_calls, finish_reason "tool_calls", whole or
    streamed."""
    from ragen_jax import serve

    canned = 'I will search.<tool_call>{"name": "search", "arguments": {"query": "Ann"}}</tool_call>'
    monkeypatch.setattr(serve.Row, "text_out", lambda self: canned)
    client = _client(server)
    reply = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, tools=[SEARCH], max_tokens=16)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will search."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "search"
    assert json.loads(call.function.arguments) == {"query": "Ann"}
    chunks = list(client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, tools=[SEARCH],
                                                 max_tokens=16, stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].function.name == "search"
    # Without tools in the request the same text is plain content.
    reply = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, max_tokens=16)
    assert reply.choices[0].message.content == canned and reply.choices[0].finish_reason in ("stop", "length")


def _reference_steps(reference, ids: list[int], steps: int, stop_ids, presence: float = 0.0, frequency: float = 0.0):
    """Greedy decoding by full forward passes (no cache), with OpenAI's penalties on the logits
    (``logit - presence * [count > 0] - frequency * count``) -> ``(tokens, log-probs of the raw
    distribution, top-3 ids)``, stopping before a stop token."""
    from flax import nnx

    graphdef, params, _ = reference
    model = nnx.merge(graphdef, params)
    out, lps, tops = [], [], []
    for _ in range(steps):
        tokens = np.asarray([ids + out], np.int32)
        logits, _ = model(tokens, np.arange(tokens.shape[1], dtype=np.int32)[None])
        raw = np.asarray(logits[0, -1], np.float64)
        counts = np.bincount(np.asarray(out, np.int64), minlength=raw.size)[:raw.size] if out else np.zeros(raw.size)
        nxt = int(np.argmax(raw - presence * (counts > 0) - frequency * counts))
        if nxt in stop_ids:
            break
        logp = raw - np.logaddexp.reduce(raw)
        out.append(nxt)
        lps.append(float(logp[nxt]))
        tops.append(list(np.argsort(-logp)[:3]))
    return out, lps, tops


def _prompt_ids(server, messages):
    tok = server["reference"][2]
    return list(tok(_chat_text(server["reference"], messages), add_special_tokens=False)["input_ids"])


def test_streaming_sends_the_same_reply_in_pieces_and_the_usage(server):
    client = _client(server)
    whole = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0,
                                                 max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # it did come in pieces


def test_logprobs_and_usage_match_a_full_forward_reference(server):
    """Each returned token's log-prob is the model's log-softmax at that step (full forward passes,
    float64 reference), the greedy token tops its top_logprobs, and completion_tokens counts the
    tokens generated (one log-prob each), not the budget."""
    client = _client(server)
    stops = set(server["generator"].stop_ids.tolist())
    reply = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0,
                                           max_completion_tokens=12, logprobs=True, top_logprobs=3)
    tokens, lps, tops = _reference_steps(server["reference"], _prompt_ids(server, MESSAGES), 12, stops)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(tokens) == reply.usage.completion_tokens <= 12
    tok = server["reference"][2]
    for entry, t, lp, top in zip(content, tokens, lps, tops):
        assert entry.token == tok.decode([t]) and abs(entry.logprob - lp) < 2e-3
        assert [x.token for x in entry.top_logprobs] == [tok.decode([int(i)]) for i in top]
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_penalties_change_the_greedy_reply_as_the_reference_does(server):
    client = _client(server)
    stops = set(server["generator"].stop_ids.tolist())
    tok = server["reference"][2]
    for presence, frequency in ((0.0, 1.5), (1.0, 0.0)):
        reply = client.chat.completions.create(model="tiny-frozen-lake", messages=MESSAGES, temperature=0, max_tokens=16,
                                               presence_penalty=presence, frequency_penalty=frequency)
        tokens, _, _ = _reference_steps(server["reference"], _prompt_ids(server, MESSAGES), 16, stops, presence, frequency)
        assert reply.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)


def test_legacy_completions_and_model_lookup(server):
    client = _client(server)
    stops = set(server["generator"].stop_ids.tolist())
    tok = server["reference"][2]
    prompts = ["Turn 1: the board is", "The goal is"]
    out = client.completions.create(model="tiny-frozen-lake", prompt=prompts, temperature=0, max_tokens=8, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, prompts):
        tokens, lps, _ = _reference_steps(server["reference"], list(tok(prompt, add_special_tokens=False)["input_ids"]),
                                          8, stops)
        assert choice.text == tok.decode(tokens, skip_special_tokens=True)
        assert len(choice.logprobs.token_logprobs) == len(tokens)
        assert all(abs(a - b) < 2e-3 for a, b in zip(choice.logprobs.token_logprobs, lps))
        assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    streamed = list(client.completions.create(model="tiny-frozen-lake", prompt=prompts[0], temperature=0, max_tokens=8,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert client.models.retrieve("tiny-frozen-lake").id == "tiny-frozen-lake"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("raw, fragment", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper than 64 levels"),
])
def test_hostile_bodies_are_400s_not_500s(raw, fragment):
    """Without the test server's small body limit: a lone surrogate and 5,000-deep JSON."""
    from ragen_jax.serve import BadRequest, _parse_body

    with pytest.raises(BadRequest, match=fragment):
        _parse_body(raw)


def test_a_client_that_goes_away_frees_its_rows(server, monkeypatch):
    """A streamed request abandoned after its first chunk stops decoding: its row is cancelled and free
    again long before its budget would run out. Each decode chunk is slowed to 0.5 s and the stop
    tokens are taken away, so the row could only end by its length after ~4 s, or by the cancel."""
    import http.client

    engine = server["generator"].engine
    slow = engine._decode

    def slowed(*args, **kwargs):
        time.sleep(0.5)
        return slow(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode", slowed)
    monkeypatch.setattr(engine, "stop_ids", np.zeros((0,), np.int32))
    before = dict(engine.stats)
    host, port = server["url"].split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "tiny-frozen-lake", "messages": MESSAGES, "max_tokens": 64, "temperature": 1.0,
                       "seed": 1, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: the request is decoding
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    gone = time.time()
    while time.time() < gone + 10 and engine.stats["cancelled"] == before["cancelled"]:
        time.sleep(0.05)
    assert engine.stats["cancelled"] == before["cancelled"] + 1 and engine.busy_slots == 0
    assert time.time() - gone < 3.0
    assert engine.stats["tokens"] - before["tokens"] < 64  # it never ran to its budget


def test_a_full_queue_answers_429_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(server["generator"].engine, "max_queue", 0)
    code, answer = _post(server, json.dumps({"model": "tiny-frozen-lake", "messages": MESSAGES}).encode())
    assert code == 429 and answer["error"]["type"] == "rate_limit_error"
    req = urllib.request.Request(server["url"] + "/v1/chat/completions",
                                 data=json.dumps({"messages": MESSAGES}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
