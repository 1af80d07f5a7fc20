"""The retrieval server under bad input and load: every malformed request gets its 4xx naming the
problem, stalled clients are cut off by the server's own timeouts, 2,000 requests from 32 threads
are all answered with exactly what the in-process BM25 returns, and start-up problems are one line.

The reference for correct answers is ``BM25Retriever.search`` called in process; the refusals are
hand-written cases from the fault probe (``Content-Length: -1``, a short body, 50 MB, ``Infinity``).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from environments.text import retrieval, retrieval_server
from environments.text.search_qa import generate_corpus

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def retriever():
    return retrieval.BM25Retriever()


@pytest.fixture(scope="module")
def server(retriever):
    srv = retrieval_server.serve(retriever, port=0, limits=retrieval_server.Limits(body_timeout_s=1.0, keep_alive_s=1.0))
    yield srv
    srv.shutdown()


def post(url, body: bytes, timeout=10):
    req = urllib.request.Request(url + "/retrieve", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw_exchange(address, data: bytes, wait=10.0):
    """Send ``data`` on a fresh connection and return (seconds until the server answered or closed, reply)."""
    with socket.create_connection(address) as s:
        s.settimeout(wait)
        s.sendall(data)
        start = time.monotonic()
        try:
            reply = s.recv(65536)
        except socket.timeout:
            reply = None
        return time.monotonic() - start, reply


@pytest.mark.parametrize("body, field", [
    (b'{"query": "x", "top_k": Infinity}', "Infinity"),
    (b'{"query": "x", "top_k": NaN}', "NaN"),
    (b'{"query": "x", "top_k": 1e400}', "top_k"),
    (b'{"query": "x", "top_k": 0}', "top_k"),
    (b'{"query": "x", "top_k": 101}', "top_k"),
    (b'{"query": "x", "top_k": 2.5}', "top_k"),
    (b'{"query": "x", "top_k": true}', "top_k"),
    (b'{"query": "x", "top_k": "5"}', "top_k"),
    (b'{"query": 5}', "query"),
    (b'{"query": ""}', "query"),
    (b'{"top_k": 3}', "query"),
    (b'{"query": "x", "k": 3}', "unknown field"),
    (b'[1, 2]', "JSON object"),
    (b'not json', "not valid JSON"),
    (b'\xff\xfe', "not valid JSON"),
])
def test_every_bad_field_is_a_400_naming_it(server, body, field):
    status, payload = post(server.url, body)
    assert status == 400 and field in payload["error"], payload


def test_an_oversized_body_is_refused_before_it_is_read(server):
    status, payload = post(server.url, json.dumps({"query": "a" * 70_000}).encode())
    assert status == 413 and "65536" in payload["error"]
    # 50 MB announced: refused from the header at once, nothing of it read.
    seconds, reply = raw_exchange(server.server_address,
                                  b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n{")
    assert reply.startswith(b"HTTP/1.1 413") and seconds < 2
    # Chunked, no length announced: counted while streaming.
    chunk = b"8000\r\n" + b"a" * 0x8000 + b"\r\n"
    seconds, reply = raw_exchange(server.server_address,
                                  b"POST /retrieve HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3)
    assert reply.startswith(b"HTTP/1.1 413")


def test_stalled_and_malformed_clients_are_cut_off_by_the_server(server):
    # Content-Length: -1 is malformed HTTP: a 400 at once.
    seconds, reply = raw_exchange(server.server_address,
                                  b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400") and seconds < 2
    # A body shorter than announced: 408 after the body timeout (1 s here), the connection closed.
    seconds, reply = raw_exchange(server.server_address,
                                  b'POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"query":')
    assert reply.startswith(b"HTTP/1.1 408") and 0.9 < seconds < 5
    # A silent client, and one that never finishes its headers: closed after the head timeout (1 s).
    for data in (b"", b"POST /retrieve HTTP/1.1\r\nHo"):
        seconds, reply = raw_exchange(server.server_address, data)
        assert reply == b"" and 0.9 < seconds < 5, (data, seconds, reply)
    # None of that disturbed the server.
    status, payload = post(server.url, b'{"query": "born in Velsk", "top_k": 2}')
    assert status == 200 and len(payload["results"]) == 2


def test_two_thousand_requests_from_32_threads_all_answered_correctly(server, retriever):
    docs, questions = generate_corpus()
    queries = [(q["question"], 1 + i % 7) for i, q in enumerate(questions)]
    queries = [queries[i % len(queries)] for i in range(2000)]
    expected = {(q, k): retriever.search(q, k) for q, k in set(queries)}

    def ask(item):
        q, k = item
        return item, post(server.url, json.dumps({"query": q, "top_k": k}).encode(), timeout=60)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, queries))
    assert len(answers) == 2000
    for (q, k), (status, payload) in answers:
        assert status == 200
        got, want = payload["results"], expected[(q, k)]
        assert [d["id"] for d in got] == [d["id"] for d in want]
        assert [d["score"] for d in got] == pytest.approx([d["score"] for d in want], rel=1e-6)


def test_the_client_reports_the_servers_refusal(server):
    with pytest.raises(ValueError, match=r"HTTP 400.*top_k"):
        retrieval.HTTPRetriever(server.url).search("x", top_k=0)


def _start(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "environments.text.retrieval_server", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"),
    ("", "the corpus is empty"),
    ('{"id": 1, "contents": "a"}\n{"id": 2, "contents": "b"\n', ":2: not a JSON object"),
    ('{"id": 1, "contents": "a"}\n["b"]\n', ":2: a corpus row must be a JSON object"),
    ('{"id": 1, "title": "a"}\n', ":1: a corpus row needs 'contents'"),
])
def test_corpus_problems_at_start_up_are_one_line_naming_file_and_line(tmp_path, content, expected):
    corpus = tmp_path / "corpus.jsonl"
    if content is not None:
        corpus.write_text(content)
    result = _start(["--corpus", str(corpus), "--port", "0"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(corpus) in lines[0] and expected in lines[0], result.stderr


def test_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _start(["--port", str(port)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port}" in lines[0] and "in use" in lines[0], result.stderr
