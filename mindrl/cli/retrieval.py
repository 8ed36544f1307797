"""`mindrl-retrieval`: a local Search-R1-style retrieval server (BM25 over a JSONL corpus, `mindrl.agent.retrieval`).
It answers `POST /retrieve` with `{"queries": [...], "topk": k, "return_scores": bool}` on loopback; point the search
tool's `retrieval_service_url` at `http://127.0.0.1:PORT/retrieve`."""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler

from mindrl.agent.retrieval import CorpusError, Retriever
from mindrl.cli import ToolServer, serve_until_interrupted

MAX_BODY = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindrl-retrieval", description=__doc__)
    p.add_argument("--corpus", required=True,
                   help="JSONL corpus: one {\"id\": ..., \"contents\": \"title\\ntext\"} object a line")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    return p


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 0) -> ToolServer:
    """The HTTP server answering `/retrieve` from `retriever` (not yet serving: call `serve_forever`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/retrieve":
                return self._send(404, {"error": f"no endpoint {self.path} (POST /retrieve)"})
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                return self._send(413, {"error": f"body over {MAX_BODY} bytes"})
            try:
                req = json.loads(self.rfile.read(size) or b"null")
            except ValueError as e:
                return self._send(400, {"error": f"the body is not JSON: {e}"})
            self._send(*retriever.handle(req))

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            sys.stderr.write(f"mindrl-retrieval: {self.address_string()} {fmt % args}\n")

    return ToolServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        retriever = Retriever.from_file(a.corpus)
    except CorpusError as e:
        print(f"mindrl-retrieval: {e}", file=sys.stderr)
        return 2
    server = make_server(retriever, a.host, a.port)
    print(f"mindrl-retrieval: {len(retriever.rows)} documents from {a.corpus}; serving "
          f"http://{a.host}:{server.server_address[1]}/retrieve", file=sys.stderr, flush=True)  # fmt: skip
    return serve_until_interrupted(server)


if __name__ == "__main__":
    sys.exit(main())
