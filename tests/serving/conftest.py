"""Serving fixtures: a real `mindrl-rollout-server` subprocess on loopback (`start_server`, reusable by any
test module) and two same-architecture tiny checkpoints (weights A, served at start, and B, pushed later)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY = re.compile(r"mindrl-rollout-server: serving .* on (http://\S+) \(version \d+\)")
# Small engine limits: tests need little KV cache, and the machine has 2 cores.
DEFAULT_ARGS = ("--max-model-len", "256", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20))


@dataclass
class ServerHandle:
    """A running server subprocess: its base URL, process and (merged stdout/stderr) log lines so far."""

    url: str
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)
    token_file: str | None = None

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (graceful: the engine shuts down), SIGKILL after `timeout_s`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.token_file:
            os.unlink(self.token_file)
            self.token_file = None
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.log)

    def wait_output(self, text: str, timeout_s: float = 30) -> str:
        """The log once it holds `text` (the server may log after it answered the request that caused it)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.output()


def server_command(model_dir: str, port: int | None = None, token_file: str | None = None, extra_args=()) -> list[str]:
    cmd = [sys.executable, "-m", "mindrl.cli.rollout_server", "--model", model_dir, "--port", str(port or 0)]
    if token_file:
        cmd += ["--token-file", token_file]
    return cmd + [*DEFAULT_ARGS, *extra_args]


def start_server(
    model_dir: str,
    port: int | None = None,
    token: str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 240,
) -> ServerHandle:
    """Start `python -m mindrl.cli.rollout_server` on 127.0.0.1 (port None: a free one) and wait for its ready
    line; raises with the server's output if it exits or does not get ready in time. Call `stop()` after."""
    token_file = None
    if token is not None:
        fd, token_file = tempfile.mkstemp(prefix="mindrl-token-")
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        server_command(model_dir, port, token_file, extra_args),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a Ctrl-C in the test terminal reaches only pytest, which then stops us
    )
    handle = ServerHandle("", proc, token_file=token_file)
    ready = threading.Event()

    def pump() -> None:  # keep draining the pipe for the server's whole life (a full pipe would block it)
        for line in proc.stdout:
            handle.log.append(line)
            m = READY.search(line)
            if m and not ready.is_set():
                handle.url = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            break
    if not handle.url:
        handle.stop()
        raise RuntimeError(
            f"rollout server did not get ready (exit code {proc.returncode}):\n{handle.output()[-4000:]}"
        )
    return handle


@pytest.fixture(scope="session")
def serving_models(tmp_path_factory) -> dict[str, str]:
    """'a' and 'b': untied tiny Qwen2 dirs (same architecture, different random weights)."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("serving_models")
    return {k: make_tiny_model(str(root / k), num_layers=2, seed=seed) for k, seed in (("a", 21), ("b", 22))}
