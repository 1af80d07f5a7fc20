"""The retrieval server: the original's HTTP protocol over ``retrieval.BM25Retriever``, served by
FastAPI on uvicorn.

    python -m environments.text.retrieval_server --corpus environments/data/search_corpus.jsonl --port 8000

``GET /health`` -> ``{"status": "ok", "documents": N}``; ``POST /retrieve {"query": str, "top_k": int}``
-> ``{"results": [{"id", "content", "score"}]}``. A server shared by many training processes meets
clients that stall, send garbage or send far too much, so every request is bounded:

- the body must arrive within ``body_timeout_s`` (408 otherwise; a stalled client costs a coroutine,
  never a thread) and be at most ``max_body_bytes`` (413, refused from ``Content-Length`` before
  reading, or counted while streaming when the client sends chunks);
- every bad field is a 400 naming it: not JSON, ``NaN`` / ``Infinity``, unknown keys, a query that
  is not a non-empty string of at most ``max_query_chars``, a ``top_k`` that is not an integer in
  ``[1, max_top_k]``; malformed HTTP (``Content-Length: -1``) is refused by the HTTP parser with a 400;
- a connection that sends no complete request head within ``keep_alive_s`` (5 s) is closed;
- the listen backlog is ``backlog`` (2048) and at most ``limit_concurrency`` connections are served
  at once (503 beyond), so a burst queues instead of being reset.

BM25 scoring runs in a worker thread under one lock (``bm25s`` keeps per-call state); the event
loop only parses and answers.

Start-up problems (a missing, empty or malformed corpus, a port in use) end the command with one
line naming the file and line or the port, exit status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from environments.text.request_body import BodyTooLarge, HeadTimeoutH11Protocol, read_body
from environments.text.retrieval import DEFAULT_CORPUS, BM25Retriever


class ServerStartError(RuntimeError):
    """The server cannot start (address in use, cannot bind); the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server."""
    max_body_bytes: int = 64 * 1024
    body_timeout_s: float = 10.0
    max_query_chars: int = 4096
    max_top_k: int = 100
    backlog: int = 2048
    limit_concurrency: int = 1024
    keep_alive_s: float = 5.0


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_retrieve_request(body: bytes, limits: Limits) -> tuple[str, int]:
    """``(query, top_k)`` from a ``/retrieve`` body, or ``_BadRequest`` naming the bad field."""

    def reject_constant(name):  # json accepts NaN / Infinity, which are not JSON
        raise _BadRequest(400, f"body is not valid JSON: {name} is not a JSON number")

    try:
        payload = json.loads(body, parse_constant=reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _BadRequest(400, f"body is not valid JSON ({e})") from None
    if not isinstance(payload, dict):
        raise _BadRequest(400, f"body must be a JSON object with 'query' and 'top_k', got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"query", "top_k"})
    if unknown:
        raise _BadRequest(400, f"unknown field(s) {unknown}; /retrieve takes 'query' and 'top_k'")
    query = payload.get("query")
    if not isinstance(query, str) or not query.strip():
        raise _BadRequest(400, f"'query' must be a non-empty string, got {query!r:.80}")
    if len(query) > limits.max_query_chars:
        raise _BadRequest(400, f"'query' has {len(query)} characters; the limit is {limits.max_query_chars}")
    top_k = payload.get("top_k", 5)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= limits.max_top_k:
        raise _BadRequest(400, f"'top_k' must be an integer in [1, {limits.max_top_k}], got {top_k!r:.80}")
    return query, top_k


def create_app(retriever: BM25Retriever, limits: Limits = Limits()):
    """The FastAPI application serving ``retriever``."""
    app = FastAPI(title="ragen_jax retrieval", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()

    def search(query: str, top_k: int) -> list[dict]:
        with lock:
            return retriever.search(query, top_k)

    @app.get("/health")
    def health():
        return {"status": "ok", "documents": len(retriever.docs)}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            body = await asyncio.wait_for(read_body(request, limits.max_body_bytes), limits.body_timeout_s)
            query, top_k = parse_retrieve_request(body, limits)
        except asyncio.TimeoutError:
            return JSONResponse({"error": f"the body did not arrive within {limits.body_timeout_s:g} s"},
                                status_code=408, headers={"Connection": "close"})
        except (_BadRequest, BodyTooLarge) as e:
            headers = {"Connection": "close"} if e.status == 413 else None
            return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)
        results = await run_in_threadpool(search, query, top_k)
        for r in results:  # a JSON answer never carries NaN / Infinity
            if not math.isfinite(r["score"]):
                r["score"] = 0.0
        return {"results": results}

    return app


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: any free port), or one-line ``ServerStartError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServerStartError(f"port {port} on {host} is in use; stop the process holding it or pick another "
                                   "with --port") from None
        raise ServerStartError(f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port") from None
    sock.listen(backlog)
    return sock


class RetrievalServer:
    """A running server (in a background thread when started by ``start``)."""

    def __init__(self, retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 8000,
                 limits: Limits = Limits()):
        self.socket = bind(host, port, limits.backlog)
        self.server_address = self.socket.getsockname()[:2]
        self.url = f"http://{host}:{self.server_address[1]}"
        config = uvicorn.Config(create_app(retriever, limits), log_level="warning", access_log=False,
                                timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.limit_concurrency,
                                backlog=limits.backlog, lifespan="off", http=HeadTimeoutH11Protocol)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self):
        """Serve in this thread until interrupted (uvicorn handles SIGINT / SIGTERM)."""
        self._server.run(sockets=[self.socket])

    def start(self, timeout: float = 30.0) -> "RetrievalServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="retrieval-server", daemon=True)
        self._thread.start()
        for _ in range(int(timeout / 0.01)):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.01)
        if not self._server.started:
            raise ServerStartError(f"the retrieval server on {self.url} did not start within {timeout:g} s")
        return self

    def shutdown(self, timeout: float = 10.0):
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.socket.close()


def serve(retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 8000,
          limits: Limits = Limits()) -> RetrievalServer:
    """Start the retrieval server in a background thread; ``.shutdown()`` stops it."""
    return RetrievalServer(retriever, host, port, limits).start()


def main(argv=None):
    ap = argparse.ArgumentParser(description="BM25 retrieval server for Search QA (the original's protocol)")
    ap.add_argument("--corpus", default=None, help="JSONL corpus, one {'id', 'contents'} object per line "
                    "(default: the shipped one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    ap.add_argument("--max-top-k", type=int, default=Limits.max_top_k)
    ap.add_argument("--body-timeout-s", type=float, default=Limits.body_timeout_s)
    args = ap.parse_args(argv)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_top_k=args.max_top_k, body_timeout_s=args.body_timeout_s)
    try:
        server = RetrievalServer(BM25Retriever(args.corpus), args.host, args.port, limits)
    except (OSError, ValueError, ServerStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"retrieval server on {server.url} ({args.corpus or DEFAULT_CORPUS})", flush=True)
    server.run()


if __name__ == "__main__":
    main()
