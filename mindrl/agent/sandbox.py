"""The local code sandbox: runs model-written Python behind SandboxFusion's `/run_code` request and response, for
laptops and CI (`mindrl-sandbox`; the code tool can point at a real SandboxFusion deployment instead).

It is a security boundary. Each call runs in fresh Linux namespaces (`unshare`): its own network namespace (no
interface up, so neither the network nor the host's loopback is reachable), its own PID namespace (when the code's
first process ends, the kernel kills every process it left), its own mount namespace whose root is a new tmpfs
holding only a read-only `/usr` (the interpreter and its libraries), `/dev/{null,zero,urandom}` and a size-bounded
writable `/scratch`, reached by `pivot_root` with the host's tree detached (no chroot to climb out of). The code runs
with no new privileges under rlimits on CPU seconds, address space, processes, file size and open files; as root it
also runs as an unprivileged uid of its own. The caller bounds wall time and output bytes and kills the process
group. Where `unshare` cannot create the namespaces (user namespaces off, no permission), `Sandbox` refuses to start
and says why, unless `allow_unsafe` is set (then only rlimits and a process-group kill apply)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

# Runs inside the new namespaces, as their root, before the code: builds the new root, pivots into it, drops
# privileges and limits, then execs the interpreter. Standard library only (it runs with -I -S).
_INIT = r"""
import ctypes, json, os, resource, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def mount(src, dst, fs, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()) != 0:
        e = ctypes.get_errno(); raise OSError(e, f"mount {src} -> {dst}: {os.strerror(e)}")
mount(None, "/", None, MS_REC | MS_PRIVATE)
root = a["root"]
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
for d in ("usr", "scratch", "dev", "old"):
    os.mkdir(os.path.join(root, d))
mount("/usr", root + "/usr", None, MS_BIND | MS_REC)
mount(None, root + "/usr", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
for top in ("bin", "lib", "lib64", "sbin"):
    if os.path.islink("/" + top):
        os.symlink(os.readlink("/" + top), os.path.join(root, top))
    elif os.path.isdir("/" + top):
        os.mkdir(os.path.join(root, top))
        mount("/" + top, os.path.join(root, top), None, MS_BIND | MS_REC)
        mount(None, os.path.join(root, top), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
for dev in ("null", "zero", "urandom"):
    open(os.path.join(root, "dev", dev), "w").close()
    mount("/dev/" + dev, os.path.join(root, "dev", dev), None, MS_BIND)
scratch = root + "/scratch"
mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={a['scratch_bytes']},mode=1777")
with open(scratch + "/main.py", "w") as f:
    f.write(a["code"])
with open(scratch + "/stdin", "w") as f:
    f.write(a["stdin"])
mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
os.chdir(root)
if libc.syscall(155, b".", b"old") != 0:  # pivot_root(2)
    e = ctypes.get_errno(); raise OSError(e, f"pivot_root: {os.strerror(e)}")
if libc.umount2(b"/old", 2) != 0:  # MNT_DETACH: the host's tree is gone from this namespace
    e = ctypes.get_errno(); raise OSError(e, f"umount /old: {os.strerror(e)}")
os.chdir("/scratch")
fd = os.open("/scratch/stdin", os.O_RDONLY); os.dup2(fd, 0); os.close(fd)
if a["uid"] is not None:
    os.setgroups([]); os.setgid(a["uid"]); os.setuid(a["uid"])
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
for name, v in a["rlimits"].items():
    # CPU: SIGXCPU at the limit, the kernel's SIGKILL a second later (equal limits give SIGKILL at once)
    resource.setrlimit(getattr(resource, name), (v, v + 1) if name == "RLIMIT_CPU" else (v, v))
env = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
# This process stays the namespace's init (pid 1) and runs the code as its child: the kernel delivers no signal that
# pid 1 does not handle (SIGXCPU among them), and unshare does not pass on a child's death by signal (it exits 1), so
# init reaps every orphan, waits for the code, and exits 128 + its signal. When init exits, the kernel kills the rest.
code_pid = os.fork()
if code_pid == 0:
    os.execve(a["python"], [a["python"], "-I", "/scratch/main.py"], env)
while True:
    pid, status = os.wait()
    if pid == code_pid:
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate the code (the message says why and names the unsafe switch)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call bounds; a request may ask for less (its `run_timeout`, `memory_limit_MB`), never more."""

    wall_s: float = 30.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 32
    """Processes (and threads) the code may have at once."""
    output_bytes: int = 64 << 10
    """Of stdout and of stderr each; past it the run is killed and the output cut."""
    scratch_mb: int = 64
    """The writable /scratch (tmpfs, counted in memory)."""
    open_files: int = 64


@dataclass
class Run:
    status: str  # SandboxFusion's run status: Finished | TimeLimitExceeded | Error
    return_code: int | None
    stdout: str
    stderr: str
    execution_time: float


def _unshare_flags(as_root: bool) -> list[str]:
    flags = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    return flags if as_root else ["--user", "--map-root-user", *flags]


class Sandbox:
    """Runs Python code isolated as the module doc says. `python`: the interpreter inside (it and its standard
    library must live under /usr). `allow_unsafe`: run without namespaces where they cannot be had (only rlimits and
    the process-group kill then: the code can read the host's files and reach its network)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str = "/usr/bin/python3",
                 allow_unsafe: bool = False) -> None:  # fmt: skip
        self.limits, self.python = limits, python
        self.as_root = os.geteuid() == 0
        self.isolated = True
        why = self._why_not_isolated()
        if why is not None:
            if not allow_unsafe:
                raise SandboxUnavailable(
                    f"the code sandbox cannot isolate code on this machine: {why}. Enable user namespaces "
                    "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0) or run as root; or "
                    "point the code tool's sandbox_fusion_url at a SandboxFusion deployment; or, knowing the code "
                    "can then read your files and reach your network, pass --allow-unsafe (MINDRL_SANDBOX_UNSAFE=1)"
                )
            self.isolated = False

    def _why_not_isolated(self) -> str | None:
        if not os.path.realpath(self.python).startswith("/usr/"):
            return f"the interpreter {self.python} is not under /usr (only /usr is visible inside)"
        if shutil.which("unshare") is None:
            return "the unshare program (util-linux) is not installed"
        probe = self.run_code("print(6 * 7)")
        if probe.status == "Finished" and probe.stdout.strip() == "42":
            return None
        return f"a trial run in new namespaces failed: {(probe.stderr or probe.stdout).strip()[-400:]}"

    def run_code(self, code: str, stdin: str = "", timeout_s: float | None = None,
                 memory_mb: int | None = None) -> Run:  # fmt: skip
        lim = self.limits
        wall = min(timeout_s or lim.wall_s, lim.wall_s)
        memory = min(memory_mb or lim.memory_mb, lim.memory_mb)
        cpu = max(1, min(lim.cpu_s, int(wall) + 1))
        rlimits = {"RLIMIT_CPU": cpu, "RLIMIT_AS": memory << 20, "RLIMIT_NPROC": lim.processes,
                   "RLIMIT_FSIZE": lim.scratch_mb << 20, "RLIMIT_NOFILE": lim.open_files, "RLIMIT_CORE": 0}  # fmt: skip
        root = tempfile.mkdtemp(prefix="mindrl-sandbox-")
        try:
            if getattr(self, "isolated", True):
                args = {"root": root, "code": code, "stdin": stdin, "python": self.python,
                        "scratch_bytes": lim.scratch_mb << 20, "rlimits": rlimits,
                        "uid": 100_000 + secrets.randbelow(900_000) if self.as_root else None}  # fmt: skip
                cmd = ["unshare", *_unshare_flags(self.as_root), sys.executable, "-I", "-S", "-c", _INIT,
                       json.dumps(args)]  # fmt: skip
                return self._supervise(cmd, None, wall, _die_with_parent)
            with open(os.path.join(root, "main.py"), "w") as f:
                f.write(code)
            rlimits.pop("RLIMIT_NPROC")  # counted per user: it would count the caller's own processes

            def limit() -> None:
                import resource

                for name, v in rlimits.items():
                    resource.setrlimit(getattr(resource, name), (v, v + 1) if name == "RLIMIT_CPU" else (v, v))

            return self._supervise([self.python, "-I", "main.py"], (root, stdin), wall, limit)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _supervise(self, cmd: list[str], unsafe, wall: float, preexec) -> Run:
        """Runs `cmd` in a session of its own; output past the limit or time past `wall` kills the whole group."""
        cap = self.limits.output_bytes
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE if unsafe else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, env=env, cwd=unsafe[0] if unsafe else None,
            preexec_fn=preexec,
        )  # fmt: skip
        over = threading.Event()
        bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}

        def drain(stream, buf: bytearray) -> None:
            while chunk := stream.read1(65536):
                room = cap + 1 - len(buf)
                buf += chunk[: max(room, 0)]
                if len(buf) > cap:
                    over.set()
                    _kill(proc)
                    return

        readers = [threading.Thread(target=drain, args=(s, bufs[k]), daemon=True)
                   for s, k in ((proc.stdout, "out"), (proc.stderr, "err"))]  # fmt: skip
        for r in readers:
            r.start()
        if unsafe:
            try:
                proc.stdin.write(unsafe[1].encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
        timed_out = False
        try:
            proc.wait(timeout=wall)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill(proc)
        proc.wait()
        for r in readers:
            r.join(timeout=5)
        elapsed = time.monotonic() - t0
        out, err = bytes(bufs["out"][:cap]), bytes(bufs["err"][:cap]).decode("utf-8", "replace")
        rc = proc.returncode
        if timed_out or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU, 128 + signal.SIGKILL) and elapsed >= wall:
            return Run("TimeLimitExceeded", None, out.decode("utf-8", "replace"), err, elapsed)
        if over.is_set():
            note = f"\n[output over {cap} bytes: the run was stopped]"
            return Run("Error", rc, out.decode("utf-8", "replace"), err + note, elapsed)
        if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            return Run("TimeLimitExceeded", rc, out.decode("utf-8", "replace"), err + "\n[CPU time limit]", elapsed)
        return Run("Finished" if rc == 0 else "Error", rc, out.decode("utf-8", "replace"), err, elapsed)

    # --------------------------------------------------------------------------------------- SandboxFusion API
    def handle(self, request: Any) -> dict[str, Any]:
        """A `/run_code` request body (SandboxFusion's: code, language, stdin, run_timeout, memory_limit_MB) ->
        its response body (status Success | Failed | SandboxError, run_result)."""
        problem = _check_request(request)
        if problem:
            return {"status": "SandboxError", "message": problem, "compile_result": None, "run_result": None,
                    "executor_pod_name": None, "files": {}}  # fmt: skip
        run = self.run_code(request["code"], request.get("stdin") or "", request.get("run_timeout"),
                            request.get("memory_limit_MB"))  # fmt: skip
        return {
            "status": "Success" if run.status == "Finished" and run.return_code == 0 else "Failed",
            "message": "",
            "compile_result": None,
            "run_result": {
                "status": run.status,
                "execution_time": round(run.execution_time, 4),
                "return_code": run.return_code,
                "stdout": run.stdout,
                "stderr": run.stderr,
            },  # fmt: skip
            "executor_pod_name": None,
            "files": {},
        }


def _check_request(req: Any) -> str | None:
    if not isinstance(req, dict):
        return "the request body must be a JSON object"
    if not isinstance(req.get("code"), str):
        return "'code' must be a string"
    lang = req.get("language", "python")
    if lang not in ("python", "python3"):
        return f"language {lang!r} is not supported by mindrl's sandbox (python only)"
    for key in ("run_timeout", "memory_limit_MB"):
        v = req.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            return f"'{key}' must be a positive number, got {v!r}"
    if req.get("stdin") is not None and not isinstance(req["stdin"], str):
        return "'stdin' must be a string"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it dies (a killed server leaves no sandbox
    running; `unshare --kill-child` then kills the namespace's processes)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
