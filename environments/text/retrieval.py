"""Document retrieval for Search QA: BM25 over a local JSONL corpus (``bm25s``), in process or over
HTTP, and the original's mock mode.

Corpus rows: ``{"id": ..., "contents": ...}`` (``text`` or ``content`` also accepted). Results are
formatted as the original's client does: ``[Document i] (ID: id, Score: s)`` then the text, each
document cut at 800 characters and the whole at ``max_total_chars``.

HTTP (the original's protocol: ``GET /health``, ``POST /retrieve {"query", "top_k"}`` ->
``{"results": [{"id", "content", "score"}]}``), served by ``retrieval_server``::

    python -m environments.text.retrieval_server --corpus environments/data/search_corpus.jsonl --port 8000

then ``--config.env.retrieval_url=http://127.0.0.1:8000``.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from environments.text import data_file

DEFAULT_CORPUS = "search_corpus.jsonl"


def read_corpus(path: Path) -> list[dict]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg} at column {e.colno}); each line of "
                                 "a corpus is one {\"id\": ..., \"contents\": ...} object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: a corpus row must be a JSON object with 'contents', got "
                                 f"{type(row).__name__}")
            text = row.get("contents", row.get("text", row.get("content")))
            if text is None:
                raise ValueError(f"{path}:{line_no}: a corpus row needs 'contents' (or 'text'), got keys {sorted(row)}")
            docs.append({"id": str(row.get("id", line_no - 1)), "content": str(text)})
    if not docs:
        raise ValueError(f"{path}: the corpus is empty (no rows); give a JSONL file with one "
                         "{\"id\": ..., \"contents\": ...} object per line")
    return docs


class BM25Retriever:
    """BM25 (Lucene's variant, ``bm25s``) over the corpus; English stop words removed."""

    def __init__(self, corpus_path: str | None = None):
        import bm25s

        self.path = data_file(corpus_path, DEFAULT_CORPUS, "corpus_path")
        self.docs = read_corpus(self.path)
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([d["content"] for d in self.docs], stopwords="en", show_progress=False),
                         show_progress=False)

    def search(self, query: str, top_k: int = 5) -> list[dict]:
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # nothing left of the query (only stop words or punctuation)
            return []
        k = min(top_k, len(self.docs))
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [{**self.docs[int(i)], "score": float(s)} for i, s in zip(ids[0], scores[0]) if s > 0]


class HTTPRetriever:
    """Client of a retrieval server (this module's, or the original's)."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def search(self, query: str, top_k: int = 5) -> list[dict]:
        req = urllib.request.Request(self.url + "/retrieve", data=json.dumps({"query": query, "top_k": top_k}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())["results"]
        except urllib.error.HTTPError as e:  # the server answered: it refused this request
            try:
                reason = json.loads(e.read()).get("error", e.reason)
            except (ValueError, AttributeError):
                reason = e.reason
            raise ValueError(f"retrieval server {self.url} refused the query (HTTP {e.code}): {reason}") from None
        except OSError as e:
            raise ConnectionError(f"retrieval server {self.url} did not answer ({e}); start it with "
                                  "`python -m environments.text.retrieval_server --corpus FILE --port PORT` or unset "
                                  "config.env.retrieval_url to search in process") from e


class MockRetriever:
    """Placeholder documents that only echo the query (the original's mock mode, for plumbing tests)."""

    def search(self, query: str, top_k: int = 5) -> list[dict]:
        return [{"id": "mock_1", "content": f"Placeholder document for the query '{query}'.", "score": 0.9},
                {"id": "mock_2", "content": f"A second placeholder document about '{query}'.", "score": 0.75}][:top_k]


def format_results(results: list[dict], max_results: int = 5, max_total_chars: int = 4000) -> str:
    if not results:
        return "No relevant documents found for the query."
    parts = []
    for i, r in enumerate(results[:max_results], 1):
        content = r.get("content", "")
        if len(content) > 800:
            content = content[:800] + "..."
        parts.append(f"[Document {i}] (ID: {r.get('id', f'doc_{i}')}, Score: {float(r.get('score', 0.0)):.3f})\n{content}")
    out = "\n\n".join(parts)
    return out[:max_total_chars] + "..." if len(out) > max_total_chars else out
