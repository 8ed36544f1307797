"""`mindrl-sandbox`: mindrl's local code sandbox (`mindrl.agent.sandbox`) behind SandboxFusion's API. With no flag it
reads one `/run_code` request body (JSON) on stdin and prints the response JSON (debugging a tool); with `--serve`
it answers `POST /run_code` over HTTP on loopback, for the code tool's `sandbox_fusion_url`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler

from mindrl.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from mindrl.cli import ToolServer, serve_until_interrupted

MAX_BODY = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    d = SandboxLimits()
    p = argparse.ArgumentParser(prog="mindrl-sandbox", description=__doc__)
    p.add_argument("--serve", action="store_true", help="serve POST /run_code over HTTP instead of one stdin request")
    p.add_argument("--host", default="127.0.0.1", help="address to bind with --serve (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port with --serve; 0 picks a free one (default 8080)")
    p.add_argument("--wall-s", type=float, default=d.wall_s, help=f"wall seconds per run at most ({d.wall_s:g})")
    p.add_argument("--cpu-s", type=int, default=d.cpu_s, help=f"CPU seconds per process at most ({d.cpu_s})")
    p.add_argument("--memory-mb", type=int, default=d.memory_mb, help=f"address space per process ({d.memory_mb})")
    p.add_argument("--processes", type=int, default=d.processes, help=f"processes at once ({d.processes})")
    p.add_argument("--output-bytes", type=int, default=d.output_bytes, help=f"stdout / stderr each ({d.output_bytes})")
    p.add_argument("--python", default="/usr/bin/python3", help="the interpreter inside (under /usr)")
    p.add_argument("--allow-unsafe", action="store_true", default=os.environ.get("MINDRL_SANDBOX_UNSAFE") == "1",
                   help="run without isolation where namespaces are unavailable (the code can read your files and "
                   "reach your network); also MINDRL_SANDBOX_UNSAFE=1")  # fmt: skip
    return p


def _handler(sandbox: Sandbox) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/run_code":
                return self._send(
                    404, {"status": "SandboxError", "message": f"no endpoint {self.path} (POST /run_code)"}
                )
            size = int(self.headers.get("Content-Length") or 0)
            if size > MAX_BODY:
                return self._send(413, {"status": "SandboxError", "message": f"body over {MAX_BODY} bytes"})
            try:
                req = json.loads(self.rfile.read(size) or b"null")
            except ValueError as e:
                return self._send(400, {"status": "SandboxError", "message": f"the body is not JSON: {e}"})
            self._send(200, sandbox.handle(req))

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:  # one line per request on stderr, as http.server does
            sys.stderr.write(f"mindrl-sandbox: {self.address_string()} {fmt % args}\n")

    return Handler


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    limits = SandboxLimits(wall_s=a.wall_s, cpu_s=a.cpu_s, memory_mb=a.memory_mb, processes=a.processes,
                           output_bytes=a.output_bytes)  # fmt: skip
    try:
        sandbox = Sandbox(limits, a.python, a.allow_unsafe)
    except SandboxUnavailable as e:
        print(f"mindrl-sandbox: {e}", file=sys.stderr)
        return 2
    if not sandbox.isolated:
        print("mindrl-sandbox: WARNING: running WITHOUT isolation (--allow-unsafe)", file=sys.stderr)
    if not a.serve:
        try:
            req = json.load(sys.stdin)
        except ValueError as e:
            print(f"mindrl-sandbox: stdin is not one JSON request body: {e}", file=sys.stderr)
            return 2
        out = sandbox.handle(req)
        print(json.dumps(out))
        return 0 if out["status"] != "SandboxError" else 1
    server = ToolServer((a.host, a.port), _handler(sandbox))
    print(f"mindrl-sandbox: serving http://{a.host}:{server.server_address[1]}/run_code", file=sys.stderr, flush=True)
    return serve_until_interrupted(server)


if __name__ == "__main__":
    sys.exit(main())
