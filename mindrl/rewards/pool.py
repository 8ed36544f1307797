"""A persistent pool of verifier processes with a per-sample wall-clock timeout enforced from outside.
A worker past its deadline is SIGKILLed and replaced; its sample is marked timed out; the batch goes on."""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

_WORKER_MODULE = "mindrl.rewards._worker"
_MATH_MODULE = "mindrl.rewards.equivalence"  # verifiers.MATH_MODULE, named here without importing the verifiers
# Startup (imports, warm-up) is not charged to any sample, but a worker that never comes up is a bug.
STARTUP_TIMEOUT_S = 120.0


@dataclass
class PoolOutcome:
    """Per-sample results of one `VerifierPool.score` call.

    scores[i]: one float per verifier, or None when sample i did not finish (see status[i]).
    status[i]: "ok", "timeout" (killed at its deadline), "error" (a verifier raised) or "crash"
    (the worker process died). errors: the messages of "error"/"crash" samples, by index."""

    scores: list[tuple[float, ...] | None]
    status: list[str]
    errors: dict[int, str] = field(default_factory=dict)
    worker_restarts: int = 0


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, math_verifiers: bool):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        from mindrl.rewards._worker import worker_main

        self.proc = ctx.Process(
            target=worker_main, args=(child_conn, math_verifiers), daemon=True, name="mindrl-verifier"
        )
        self.proc.start()
        child_conn.close()
        self.conn: Connection = parent_conn
        self.math = math_verifiers  # started or asked to warm the math verifiers up
        self.unready = 1  # "ready" replies still to come (its start, then one per warm-up asked)
        self.started = time.monotonic()  # of its start or of the last warm-up asked
        self.chunk: deque[int] = deque()  # sample indices sent and not yet answered, in order
        self.deadline = math.inf  # for chunk[0]

    @property
    def ready(self) -> bool:
        return self.unready == 0

    def warm_math(self) -> None:
        """Ask it to warm the math verifiers up (it answers "ready" when done); the samples' clocks start after."""
        self.conn.send(("warm_math",))
        self.math, self.unready, self.started = True, self.unready + 1, time.monotonic()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def default_num_workers() -> int:
    """CPUs this process may run on, capped at 8 (scoring is cheap; more only adds startup)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


class VerifierPool:
    """`num_workers` long-lived processes scoring (response, label) samples with module-level verifier
    functions. Thread-safe: concurrent `score` calls are serialised, and `close` from another thread stops one in
    flight within half a second.

    math_verifiers: start the processes with math-verify imported and warm (the forkserver preloads it); a `score`
    call with math_verifiers=True on a pool started without asks its processes to warm up first. Without either,
    they never import it."""

    def __init__(
        self, num_workers: int, start_method: str = "forkserver", max_chunk: int = 32, math_verifiers: bool = False
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.max_chunk = max_chunk
        self.owner_pid = os.getpid()
        self.math = math_verifiers
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if this process has not started its forkserver yet; otherwise workers
            # import what they need themselves before reporting ready, which costs time but not correctness.
            self._ctx.set_forkserver_preload([_WORKER_MODULE, *([_MATH_MODULE] if math_verifiers else [])])
        self._lock = threading.Lock()
        self._workers = [_Worker(self._ctx, math_verifiers) for _ in range(num_workers)]
        self.total_restarts = 0
        self.closed = False
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.math)
        self.total_restarts += 1

    def worker_pids(self) -> list[int | None]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers: ask politely, then kill whatever is still running (e.g. stuck in sympy)."""
        self._closing = True  # a `score` in another thread gives the lock up at its next wake-up
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for w in self._workers:
                try:
                    w.conn.send(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for w in self._workers:
                w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
                w.kill()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring

    def score(
        self,
        responses: Sequence[str],
        labels: Sequence[str | None],
        verifier_fns: Sequence[Callable[[str, str | None], float]],
        timeout: float,
        math_verifiers: bool = False,
    ) -> PoolOutcome:
        """Score every sample with every function in verifier_fns, each sample within `timeout` seconds
        of wall-clock time (all its verifiers together), measured from when its worker started on it.
        math_verifiers: verifier_fns include math verifiers (the workers are warmed up for them first)."""
        with self._lock:
            if self.closed or self._closing:
                raise RuntimeError("VerifierPool is closed")
            try:
                if math_verifiers and not self.math:
                    self.math = True  # replacements start warm from now on
                    for slot, w in enumerate(self._workers):
                        try:
                            w.warm_math()
                        except (BrokenPipeError, ConnectionResetError):  # died while idle: a warm one replaces it
                            self._replace(slot)
                return self._score(responses, labels, tuple(verifier_fns), timeout)
            except BaseException:
                # interrupted mid-batch (Ctrl-C, a bug): workers may hold stale work; start clean next time
                if not self._closing:
                    for slot in range(len(self._workers)):
                        self._replace(slot)
                raise

    def _score(self, responses, labels, fns, timeout) -> PoolOutcome:
        n = len(responses)
        out = PoolOutcome(scores=[None] * n, status=["pending"] * n)
        pending: deque[int] = deque(range(n))
        remaining = n
        # small enough chunks that the tail of the batch spreads over all workers
        chunk = max(1, min(self.max_chunk, math.ceil(n / (4 * self.num_workers))))
        restarts_before = self.total_restarts

        def finish(i: int, status: str, scores=None, error: str | None = None) -> None:
            nonlocal remaining
            out.status[i] = status
            out.scores[i] = scores
            if error is not None:
                out.errors[i] = error
            remaining -= 1

        def fail_current(slot: int, status: str, error: str | None) -> None:
            w = self._workers[slot]
            finish(w.chunk.popleft(), status, error=error)
            pending.extendleft(reversed(w.chunk))  # the rest of its chunk goes to the front of the queue
            w.chunk.clear()
            self._replace(slot)

        while remaining:
            if self._closing:
                raise RuntimeError("VerifierPool closed while scoring")
            for slot, w in enumerate(self._workers):
                if w.ready and not w.chunk and pending:
                    take = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    try:
                        w.conn.send(("score", fns, [(i, responses[i], labels[i]) for i in take]))
                    except (BrokenPipeError, ConnectionResetError):
                        # died while idle (e.g. the OOM killer): nothing of this batch was lost
                        pending.extendleft(reversed(take))
                        self._replace(slot)
                        continue
                    w.chunk.extend(take)
                    w.deadline = time.monotonic() + timeout

            now = time.monotonic()
            waiting = [w for w in self._workers if w.chunk or not w.ready]
            deadlines = [w.deadline for w in waiting if w.chunk] + [
                w.started + STARTUP_TIMEOUT_S for w in waiting if not w.ready
            ]
            wake = min([*deadlines, now + 0.5])  # at least twice a second: `close` may be waiting
            ready_conns = wait([w.conn for w in waiting], timeout=max(0.0, wake - now))

            for conn in ready_conns:
                slot = next(s for s, w in enumerate(self._workers) if w.conn is conn)
                w = self._workers[slot]
                try:
                    while True:
                        message = conn.recv()
                        if message[0] == "ready":
                            w.unready -= 1
                        else:
                            idx, scores, error = message
                            if not w.chunk or idx != w.chunk[0]:
                                raise RuntimeError(f"verifier worker answered sample {idx} out of order")
                            w.chunk.popleft()
                            finish(idx, "ok" if scores is not None else "error", scores, error)
                            w.deadline = time.monotonic() + timeout
                        if not conn.poll():
                            break
                except (EOFError, OSError):
                    if not w.ready:
                        code = w.proc.exitcode
                        raise RuntimeError(
                            f"a verifier worker died during startup (exit code {code}); run "
                            f"`python -c 'import {_WORKER_MODULE}'` to see why. A script that scores (or calls "
                            "mindrl's train()) needs `if __name__ == '__main__':` around its work: each verifier "
                            "process imports the main module"
                        ) from None
                    if w.chunk:
                        fail_current(slot, "crash", f"worker process died (exit code {w.proc.exitcode})")
                    else:
                        self._replace(slot)

            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if w.chunk and now >= w.deadline:
                    fail_current(slot, "timeout", None)
                elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"a verifier worker did not start within {STARTUP_TIMEOUT_S:.0f}s")

        out.worker_restarts = self.total_restarts - restarts_before
        return out


_shared_pool: VerifierPool | None = None
_shared_lock = threading.Lock()


def get_shared_pool(num_workers: int | None = None, math_verifiers: bool = False) -> VerifierPool:
    """The process-wide pool, created on first use and kept across calls (worker startup is the
    expensive part). A different num_workers replaces it; a forked child gets its own. math_verifiers: a new
    pool starts warm for the math verifiers (an existing one warms up at its first such `score`)."""
    global _shared_pool
    num_workers = num_workers or default_num_workers()
    with _shared_lock:
        pool = _shared_pool
        if pool is not None and pool.owner_pid != os.getpid():
            pool = None  # inherited through fork: those workers belong to our parent
        if pool is not None and (pool.closed or pool.num_workers != num_workers):
            pool.close()
            pool = None
        if pool is None:
            pool = VerifierPool(num_workers, math_verifiers=math_verifiers)
        _shared_pool = pool
        return pool


def shutdown_shared_pool() -> None:
    """Stop the shared pool's workers (also registered at interpreter exit)."""
    global _shared_pool
    with _shared_lock:
        pool, _shared_pool = _shared_pool, None
    if pool is not None and pool.owner_pid == os.getpid():
        pool.close()


atexit.register(shutdown_shared_pool)
