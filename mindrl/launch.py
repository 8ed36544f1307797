"""A pool of local torch.distributed ranks for tools, tests and checkpoint conversion (the trainer's are Ray actors):
runs a picklable function on every rank; a rank that fails or hangs fails the call with its traceback or stacks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Listener, wait
from typing import Any

import torch

from mindrl.kernels import current_kernels
from mindrl.platform import current_platform, determinism_requested
from mindrl.platform.orphans import exit_with_parent


class RankError(RuntimeError):
    """A rank raised or died; the message carries its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 1800,
    threads: int | None = None,
    megatron: bool = True,
) -> None:
    """How every rank starts, whoever spawned it (a Ray worker group, `RankPool`, the rollout server's TP replicas):
    its coordinates in the environment (LOCAL_RANK: the platform's, unless already set), its torch threads, for a
    megatron rank the platform's adaptation and the kernels, then the default process group with the platform's
    backend (hccl / nccl / gloo) on its device. A process started with MINDRL_DETERMINISTIC=1 first turns on
    deterministic computation (`Platform.enable_determinism`)."""
    platform = current_platform()
    if determinism_requested():  # before the first kernel and communicator of this process
        platform.enable_determinism()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    os.environ.setdefault("LOCAL_RANK", str(platform.local_rank(rank)))
    if threads is not None:
        torch.set_num_threads(threads)
    if megatron:
        platform.apply()
        current_kernels().install()
    platform.set_device(int(os.environ["LOCAL_RANK"]))
    platform.prepare_process_groups()
    torch.distributed.init_process_group(
        backend=platform.dist_backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, cp: int = 1, ep: int = 1) -> None:
    """(Re)initialise megatron's parallel state for TP x CP x PP (DP = world / (TP*CP*PP)), with EP expert-parallel
    ranks (carved out of DP x CP, as megatron does) for MoE layers, and seed its RNGs.

    Re-initialising with the same layout only reseeds, so a long-lived rank can switch layouts cheaply.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = torch.distributed.get_world_size()
    if ps.model_parallel_is_initialized():
        same = ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp
        same = same and ps.get_expert_model_parallel_world_size() == ep
        if not same or ps.get_context_parallel_world_size() != cp:
            destroy_model_parallel()
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not divisible by TP*CP*PP = {tp}*{cp}*{pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Megatron's destroy_model_parallel forgets its process groups without closing them; each gloo group
    keeps three threads and its sockets alive. Close every group it holds, then reset its state."""
    from megatron.core import parallel_state as ps

    world = torch.distributed.group.WORLD
    closed: set[int] = set()

    def close(value) -> None:
        if isinstance(value, (list, tuple, set)):
            for v in value:
                close(v)
        elif isinstance(value, dict):
            for v in value.values():
                close(v)
        elif isinstance(value, torch.distributed.ProcessGroup) and value is not world and id(value) not in closed:
            closed.add(id(value))
            torch.distributed.destroy_process_group(value)

    for name, value in list(vars(ps).items()):
        if name.startswith("_") and name.isupper():
            close(value)
    ps.destroy_model_parallel()


_STACKS: list = []  # the open file faulthandler writes a rank's stacks into (kept open for the process's life)
_STACKS_SIGNAL = signal.SIGUSR1


def _rank_main() -> None:
    """Entry point of a rank process (started by RankPool with its coordinates in the environment)."""
    from multiprocessing.connection import Client

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _STACKS.append(open(_stacks_path(os.environ["MINDRL_STACKS_DIR"], rank), "a"))  # noqa: SIM115
    faulthandler.register(_STACKS_SIGNAL, file=_STACKS[0], all_threads=True)  # forked children inherit it
    exit_with_parent(os.getppid())  # a pool killed by SIGKILL must not leave its ranks behind
    conn = Client(_pool_address(), authkey=bytes.fromhex(os.environ.pop("MINDRL_POOL_KEY")))
    _send(conn, rank)
    try:
        port, timeout_s = int(os.environ["MASTER_PORT"]), float(os.environ["MINDRL_PG_TIMEOUT"])
        threads = int(os.environ.get("MINDRL_RANK_THREADS", "1"))
        megatron = os.environ.get("MINDRL_RANK_MEGATRON", "1") == "1"
        join_world(rank, world_size, "127.0.0.1", port, timeout_s, threads, megatron=megatron)
        _send(conn, ("ready", None))
    except BaseException as e:  # report start-up failures instead of dying silently
        _send(conn, ("err", _pack_error(rank, e)))
        return
    while True:
        try:
            msg = _recv(conn)
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            _send(conn, ("ok", fn(*args, **kwargs)))
        except BaseException as e:
            _send(conn, ("err", _pack_error(rank, e)))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _send(conn, obj) -> None:
    # Plain pickle, not Connection.send: torch registers shared-memory reducers there that need
    # multiprocessing's own process keys. Tensors travel by value.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _stacks_path(stacks_dir: str, rank: int) -> str:
    return os.path.join(stacks_dir, f"rank{rank}.txt")


def _signal_and_read(pid: int, path: str, settle_s: float = 0.2, limit_s: float = 2.0) -> str:
    """Send pid the stacks signal and return what it appended to path, once the file stops growing."""
    try:
        start = os.path.getsize(path)
        os.kill(pid, _STACKS_SIGNAL)
    except OSError as e:
        return f"(no stacks: {e})"
    size, stable_since, end = start, time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < end:
        time.sleep(0.05)
        now_size = os.path.getsize(path)
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif size > start and time.monotonic() - stable_since >= settle_s:
            break
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def _pool_address() -> tuple[str, int]:
    host, port = os.environ["MINDRL_POOL_ADDR"].rsplit(":", 1)
    return host, int(port)


_PEER_FAILURE = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL communicator was aborted",
)


def is_peer_failure(summary: str) -> bool:
    """True for errors a rank gets because another rank failed (its collective lost the peer)."""
    return any(s in summary for s in _PEER_FAILURE)


def _pack_error(rank: int, e: BaseException) -> tuple:
    tb = traceback.format_exc()
    try:
        exc = pickle.loads(pickle.dumps(e))
    except Exception:
        exc = None
    return rank, exc, f"{type(e).__name__}: {e}", tb


STACKS_PREFIX = "mindrl-stacks-"
"""A rank pool's folder for its ranks' stack dumps: <tmp>/mindrl-stacks-<creator pid>-<random>, removed at close."""


def sweep_stale_stacks_dirs(root: str | None = None) -> list[str]:
    """Remove the stack-dump folders of rank pools whose creating process is gone (killed before its close could
    remove them): the ones named with a pid that no process has now. Folders of live processes (this one's other
    pools included) and folders without a pid in the name are left. Returns the removed paths."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid = name[len(STACKS_PREFIX) :].split("-", 1)[0] if name.startswith(STACKS_PREFIX) else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or a process we may not signal): not ours to remove
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


THREADS_ENV = "MINDRL_WORKER_THREADS"


def threads_from_env() -> int | None:
    """$MINDRL_WORKER_THREADS, the torch threads of every rank (Ray worker groups and mindrl-sft / -dpo / -rm's rank
    pool), or None when unset. The tests pin 1: their two lanes fill both cores, and an OpenMP team of two per process
    then spins for cores the other lane holds (a 40-step tiny SFT: 30-35 CPU s with 2 threads, 11.4 with 1)."""
    value = os.environ.get(THREADS_ENV)
    if not value:
        return None
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"${THREADS_ENV}={value!r}: expected a positive number of threads")
    return threads


class RankPool:
    """`world_size` local ranks with torch.distributed initialised; `run(fn, ...)` runs fn on all of them.

    fn must be importable (module-level). Results come back as a list indexed by rank. megatron=False: ranks for
    torch.distributed alone skip megatron-core's import and the platform's adaptation of it (seconds per rank).
    """

    def __init__(
        self,
        world_size: int,
        threads: int = 1,
        timeout_s: float | None = None,
        pg_timeout_s: float = 1800,
        megatron: bool = True,
    ):
        self.world_size = world_size
        self.timeout_s = timeout_s
        sweep_stale_stacks_dirs()
        self._stacks_dir = tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-")
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = {**current_kernels().worker_env, **os.environ}  # the platform's defaults, below the user's settings
        env.update(
            WORLD_SIZE=str(world_size),
            MASTER_PORT=str(free_port()),
            MINDRL_POOL_ADDR=f"{listener.address[0]}:{listener.address[1]}",
            MINDRL_POOL_KEY=key.hex(),
            MINDRL_RANK_THREADS=str(threads),
            MINDRL_PG_TIMEOUT=str(pg_timeout_s),
            MINDRL_STACKS_DIR=self._stacks_dir,
            MINDRL_RANK_MEGATRON="1" if megatron else "0",
            # Ranks import what the caller can import (e.g. test helpers on the caller's sys.path).
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        )
        self._procs = []
        for rank in range(world_size):
            env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, "-c", "from mindrl.launch import _rank_main; _rank_main()"]
            self._procs.append(subprocess.Popen(cmd, env=env_r))
        self.closed = False
        conns: dict[int, object] = {}
        listener._listener._socket.settimeout(1.0)  # accept() must not outwait a rank that died
        deadline = time.monotonic() + 600
        try:
            while len(conns) < world_size:
                dead = [r for r, p in enumerate(self._procs) if p.poll() is not None and r not in conns]
                if dead or time.monotonic() > deadline:
                    self._conns = list(conns.values())
                    self.close(force=True)
                    why = f"rank {dead[0]} exited with code {self._procs[dead[0]].returncode}" if dead else "timeout"
                    raise RankError(f"start-up: {why} before connecting")
                try:
                    conn = listener.accept()
                except TimeoutError:
                    continue
                conns[_recv(conn)] = conn
        finally:
            listener.close()
        self._conns = [conns[r] for r in range(world_size)]
        self._collect("start-up", timeout_s=max(timeout_s or 0, 600))

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        if self.closed:
            raise RankError("the rank pool was closed after an earlier failure; create a new one")
        for conn in self._conns:
            _send(conn, (fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", str(fn)), self.timeout_s)

    def _collect(self, what: str, timeout_s: float | None) -> list:
        results: dict[int, Any] = {}
        errors: list[tuple] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {c: r for r, c in enumerate(self._conns)}
        grace_end = None
        while pending:
            now = time.monotonic()
            if errors and grace_end is None:  # the others may be stuck in a collective with the failed rank
                grace_end = now + 2.0
            limits = [t for t in (deadline, grace_end) if t is not None]
            if limits and now >= min(limits):
                break
            ready = wait(list(pending), timeout=1.0)
            if not ready:
                for conn, rank in list(pending.items()):
                    code = self._procs[rank].poll()
                    if code is not None and not conn.poll():
                        pending.pop(conn)
                        errors.append((rank, None, f"rank {rank} died (exit code {code})", ""))
                continue
            for obj in ready:
                rank = pending.pop(obj)
                try:
                    status, payload = _recv(obj)
                except EOFError:  # the rank exited: report how
                    try:
                        code = self._procs[rank].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = "still running"
                    errors.append((rank, None, f"rank {rank} died (exit code {code})", ""))
                    continue
                if status == "err":
                    errors.append(payload)
                else:
                    results[rank] = payload
        if errors or pending:
            stacks = self._stacks(sorted(pending.values())) if pending and not errors else ""
            self.close(force=True)
            if errors:
                # Report the root cause: a rank's own error or death before its peers' broken connections.
                rank, exc, summary, tb = sorted(errors, key=lambda e: (is_peer_failure(e[2]), e[0]))[0]
                if isinstance(exc, Exception) and not isinstance(exc, RankError):
                    # Re-raise the rank's own exception type (e.g. a ConversionError) with its context.
                    raise exc from RankError(f"{what}: rank {rank} failed:\n{tb}")
                raise RankError(f"{what}: rank {rank} failed: {summary}\n{tb}")
            ranks = sorted(pending.values())
            raise RankError(
                f"{what}: ranks {ranks} did not answer within {timeout_s:.0f} s; where they were:\n{stacks}"
            )
        return [results[r] for r in range(self.world_size)]

    def _stacks(self, ranks: list[int], max_chars: int = 6000) -> str:
        """The Python stacks of every thread of these ranks and of their child processes (e.g. megatron's
        checkpoint writers), which faulthandler writes on `_STACKS_SIGNAL` into the rank's file (children inherit
        it), one process at a time so that their lines do not interleave."""
        import psutil

        parts = []
        for rank in ranks:
            pids = [self._procs[rank].pid]
            with contextlib.suppress(psutil.Error):
                pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)]
            path = _stacks_path(self._stacks_dir, rank)
            for pid in pids:
                text = _signal_and_read(pid, path)
                if len(text) > max_chars:  # the current thread comes last
                    text = "...\n" + text[-max_chars:]
                who = f"rank {rank}" if pid == pids[0] else f"a child of rank {rank}"
                parts.append(f"--- {who} (pid {pid}) ---\n{text.strip() or '(no answer)'}")
        return "\n".join(parts)

    def close(self, force: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for conn, p in zip(self._conns, self._procs):
            if not force and p.poll() is None:
                try:
                    _send(conn, None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=0.1 if force else 10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._stacks_dir, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)


def run_distributed(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list:
    """Start `world_size` ranks, run fn on each, shut them down; returns the per-rank results."""
    with RankPool(world_size) as pool:
        return pool.run(fn, *args, **kwargs)
