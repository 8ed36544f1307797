"""The local code sandbox as a security boundary, attacked: reading host files, writing outside its scratch dir,
reaching a loopback port the test opens, a fork bomb, a memory hog, an endless loop, a flood of output and a process
left behind; then its SandboxFusion API through `mindrl-sandbox` (stdin and HTTP) and the code tool that calls it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from mindrl.agent import sandbox as sb
from mindrl.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from mindrl.agent.tools import CodeTool, ToolError

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=4096, scratch_mb=8)
CODE_SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "Runs Python.",
               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:  # the refusal itself is tested below
        pytest.skip(str(e))


def sandboxed_processes(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (the sandbox's `main.py` or a child the attack named)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def run(box: Sandbox, code: str) -> sb.Run:
    out = box.run_code(code)
    assert not sandboxed_processes("/scratch/main.py"), "a sandboxed process outlived its call"
    return out


def test_plain_code_runs_and_sees_only_its_own_files(box):
    r = run(box, "import os, sys\nprint(sorted(os.listdir('/')), os.getcwd(), sys.stdin.read())")
    assert r.status == "Finished" and r.return_code == 0, r
    assert r.stdout.split("]")[0] + "]" == str(sorted(["bin", "dev", "lib", "lib64", "old", "sbin", "scratch", "usr"]))
    assert "/scratch" in r.stdout


def test_host_files_are_out_of_sight(box):
    repo_file = os.path.abspath(__file__)
    for path in ("/etc/passwd", "/etc/hostname", repo_file, "/proc/1/environ", "/root", os.path.expanduser("~")):
        r = run(box, f"import os\np = {path!r}\nprint(os.listdir(p) if os.path.isdir(p) else open(p).read())")
        assert r.status == "Error" and ("FileNotFoundError" in r.stderr or "PermissionError" in r.stderr), (path, r)
    # nor through the directory the host gave it, nor by climbing out of the root
    r = run(box, "import os\nos.chdir('/'); os.chdir('../../..'); print(sorted(os.listdir('.')))")
    assert "etc" not in r.stdout and "work" not in r.stdout and "tmp" not in r.stdout, r


def test_nothing_is_written_outside_scratch(box, tmp_path):
    host = tmp_path / "pwned"
    for target in (str(host), "/usr/pwned", "/pwned", "/dev/pwned", "/old/pwned"):
        r = run(box, f"open({target!r}, 'w').write('x')")
        assert r.status == "Error" and "Error" in r.stderr, (target, r)
    assert not host.exists() and not os.path.exists("/usr/pwned")
    r = run(box, "open('/scratch/ok', 'w').write('x' * 100); print(open('/scratch/ok').read()[:3])")
    assert r.stdout.strip() == "xxx"
    r = run(box, "open('/scratch/big', 'wb').write(b'x' * (64 << 20))")  # over the scratch size
    assert r.status == "Error", r


def test_no_network_not_even_the_hosts_loopback(box):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        r = run(box, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert r.status == "Error" and ("Errno" in r.stderr or "timed out" in r.stderr), r
        with pytest.raises(socket.timeout):
            listener.accept()
        r = run(box, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
        assert r.status == "Error" and "OSError" in r.stderr or "Errno" in r.stderr, r
    finally:
        listener.close()


def test_a_fork_bomb_is_contained_and_cleaned_up(box):
    t0 = time.monotonic()
    r = run(box, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert time.monotonic() - t0 < LIMITS.wall_s + 5
    assert r.status in ("TimeLimitExceeded", "Error"), r


def test_memory_cpu_and_output_are_bounded(box):
    r = run(box, "x = bytearray(1 << 30)\nprint(len(x))")
    assert r.status == "Error" and "MemoryError" in r.stderr, r
    t0 = time.monotonic()
    r = run(box, "while True:\n    pass")
    assert r.status == "TimeLimitExceeded" and time.monotonic() - t0 < LIMITS.wall_s + 3, r
    r = run(box, "import sys\nwhile True:\n    sys.stdout.write('y' * 1000)")
    assert r.status == "Error" and len(r.stdout) <= LIMITS.output_bytes and "output over" in r.stderr, r


def test_no_process_is_left_behind(box):
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/usr/bin/sleep', ['sleep', '987654'])\n"
            "print('parent done')")  # fmt: skip
    r = run(box, code)
    assert r.stdout.strip() == "parent done", r
    deadline = time.monotonic() + 5
    while sandboxed_processes("987654") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandboxed_processes("987654")


def test_it_refuses_to_start_without_isolation_unless_told(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="unshare program .* not installed.*--allow-unsafe"):
        Sandbox(LIMITS)
    unsafe = Sandbox(LIMITS, allow_unsafe=True)
    assert not unsafe.isolated
    assert unsafe.run_code("print(7 * 6)").stdout.strip() == "42"


def test_the_cli_answers_one_request_on_stdin(box):
    req = {"code": "print(input() * 2)", "language": "python", "stdin": "ab\n", "run_timeout": 5}
    out = subprocess.run([sys.executable, "-m", "mindrl.cli.sandbox"], input=json.dumps(req), capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert resp["status"] == "Success" and resp["run_result"]["stdout"] == "abab\n"
    assert box.handle({"code": 1})["status"] == "SandboxError"
    assert box.handle({"code": "", "language": "cpp"})["message"].startswith("language 'cpp'")


def test_the_code_tool_calls_the_served_sandbox(box):
    from mindrl.cli.sandbox import _handler

    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(box))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
        tool = CodeTool({"sandbox_fusion_url": url, "default_timeout": 5, "num_workers": 4, "type": "native"},
                        CODE_SCHEMA)  # fmt: skip
        assert tool.execute({"code": "print(2 ** 100)"}) == f"{2**100}\n"
        with pytest.raises(ToolError, match="ZeroDivisionError"):
            tool.execute({"code": "1 / 0"})
        with pytest.raises(ToolError, match="time limit exceeded"):
            CodeTool({"sandbox_fusion_url": url, "default_timeout": 1}, CODE_SCHEMA).execute({"code": "while 1: pass"})
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ToolError, match="did not answer"):
        tool.execute({"code": "print(1)"})
