"""Ray plumbing: start (or join) Ray, one placement group with a bundle per device, and worker groups that spawn a
model's ranks, dispatch and collect; a failing rank fails the call at once and kills the group (never a hang)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mindrl.batch import shard_rows
from mindrl.launch import is_peer_failure
from mindrl.platform import DETERMINISTIC_ENV, current_platform
from mindrl.workers.dispatch import Dispatch, dispatch_mode
from mindrl.workers.ray_daemons import DriverLogMonitor

logger = logging.getLogger("mindrl.workers")


class WorkerError(RuntimeError):
    """A worker rank raised or died; the message names the group, the method and the rank."""


TASK_EVENTS_KEPT = 10_000  # finished tasks whose events a private Ray cluster's GCS keeps (Ray's default: 100,000)
_ENV_BEFORE_RAY: dict[str, str] | None = None
_LOG_MONITOR: DriverLogMonitor | None = None


def start_ray(
    address: str | None,
    num_devices: int,
    runtime_env: dict[str, Any] | None = None,
    runtime_env_path: str | None = None,
) -> bool:
    """Join the cluster at `address`, or start a private Ray on loopback. Returns True if this call initialised
    Ray (False: the caller already had, with its own runtime_env); `stop_ray` undoes it, environment variables
    included. Workers get configs/envs/runtime_env.yaml (or $MINDRL_RUNTIME_ENV) merged with this process's
    environment and `runtime_env` (see `mindrl.workers.runtime_env`)."""
    global _ENV_BEFORE_RAY, _LOG_MONITOR
    import ray

    from mindrl.workers.runtime_env import build_runtime_env

    if ray.is_initialized():
        return False
    env = build_runtime_env(
        runtime_env, path=runtime_env_path
    )  # before ray.init: a malformed file fails with nothing started
    logger.info(env.describe())
    _ENV_BEFORE_RAY = dict(os.environ)  # ray.init sets RAY_* and PYTHONBREAKPOINT in this process
    if address:
        handlers = _python_signal_handlers()
        with _without_arrow():
            ray.init(address=address, runtime_env=env.runtime_env, log_to_driver=True)
        _restore_signal_handlers(handlers)
        return True  # connected by us: disconnected by stop_ray (the cluster stays up)
    # The CPU stand-in claims one "device" per bundle; a laptop may run more ranks than it has cores.
    num_cpus = max(os.cpu_count() or 1, num_devices + 1)
    # Ray's GCS keeps an event record of every finished task, 100,000 of them by default: some 34 KiB per RL
    # iteration, so the GCS grows for thousands of iterations (docs/performance.md, steady state). Our private
    # cluster has no dashboard to show them; keep the last TASK_EVENTS_KEPT unless the user set Ray's variable.
    system_config = {}
    if "RAY_task_events_max_num_task_in_gcs" not in os.environ:
        system_config["task_events_max_num_task_in_gcs"] = TASK_EVENTS_KEPT
    # Ray prestarts a Python worker per CPU for tasks; mindrl runs only actors, each in a worker of its own, so the
    # prestarted ones sat idle (some 80 MiB each, docs/performance.md, footprint).
    for key in ("enable_worker_prestart", "prestart_worker_first_driver"):
        if f"RAY_{key}" not in os.environ:
            system_config[key] = False
    handlers = _python_signal_handlers()  # ray.init replaces them with its own (SIGTERM: log and abort)
    with _without_arrow():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=256 * 1024 * 1024,
            runtime_env=env.runtime_env,
            log_to_driver=True,
            configure_logging=False,
            _system_config=system_config or None,
        )
    _restore_signal_handlers(handlers)
    _stop_idle_daemons()
    _LOG_MONITOR = DriverLogMonitor()
    _LOG_MONITOR.start(ray._private.worker._global_node)
    return True


@contextlib.contextmanager
def _without_arrow():
    """Ray's serialization context imports pyarrow when it can, for Ray Data's tables, which mindrl never sends:
    ~25 MiB of RSS in the driver (docs/performance.md, footprint). The context is made here, with pyarrow hidden,
    then pyarrow is importable again (a parquet dataset reads with it). Workers hide it by MINDRL_BLOCKED_IMPORTS."""
    import ray

    hide = "pyarrow" not in sys.modules
    if hide:
        sys.modules["pyarrow"] = None  # type: ignore[assignment]  # `import pyarrow` raises ModuleNotFoundError
    try:
        yield
        try:
            ray._private.worker.global_worker.get_serialization_context()
        except Exception as exc:  # an older/newer Ray: it makes the context later, with pyarrow
            logger.debug("Ray's serialization context was not made at init (%s)", exc)
    finally:
        if hide and "pyarrow" in sys.modules and sys.modules["pyarrow"] is None:
            del sys.modules["pyarrow"]


def _stop_idle_daemons() -> None:
    """Stop the two head daemons a private single-node cluster never uses: the autoscaler monitor (nothing to scale)
    and the dashboard head (`include_dashboard=False` still starts it, for usage stats only); some 190 MiB of RSS
    (docs/performance.md, footprint). Ray's own node methods; a Ray without them keeps both."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    for name in ("kill_monitor", "kill_dashboard"):
        try:
            getattr(node, name)(check_alive=False)
        except Exception as exc:  # an older/newer Ray: the daemon stays, nothing else changes
            logger.debug("Ray's %s failed (%s); the daemon keeps running", name, exc)


def _python_signal_handlers() -> dict:
    """This process's Python-level SIGTERM / SIGINT handlers (e.g. mindrl-train's), when set from the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    return {sig: h for sig, h in found.items() if callable(h)}


def _restore_signal_handlers(handlers: dict) -> None:
    """Put back what `_python_signal_handlers` found: Ray's core worker installs a C-level SIGTERM handler at
    ray.init that aborts the process (exit 134), which would skip the driver's cleanup of workers and shared
    memory."""
    import signal

    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def stop_ray() -> None:
    """Disconnect from (and, if we started it, stop) Ray; restore the environment variables ray.init changed."""
    global _ENV_BEFORE_RAY, _LOG_MONITOR
    import ray

    if _LOG_MONITOR is not None:
        _LOG_MONITOR.stop()
        _LOG_MONITOR = None
    ray.shutdown()
    if _ENV_BEFORE_RAY is not None:
        for key in set(os.environ) - set(_ENV_BEFORE_RAY):
            if key.startswith("RAY_") or key == "PYTHONBREAKPOINT":
                del os.environ[key]
        for key, value in _ENV_BEFORE_RAY.items():
            if key.startswith("RAY_") or key == "PYTHONBREAKPOINT":
                os.environ[key] = value
        _ENV_BEFORE_RAY = None


def device_placement_group(num_devices: int, timeout_s: float = 600):
    """One bundle per device (the platform's Ray resource), packed; waits until every bundle is reserved."""
    import ray
    from ray.util.placement_group import placement_group

    p = current_platform()
    bundle = {"CPU": 1} if p.is_cpu else {"CPU": 1, p.ray_resource: 1}
    pg = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise WorkerError(
            f"could not reserve {num_devices} x {bundle} within {timeout_s:.0f} s; the cluster has "
            f"{ray.cluster_resources()} (are all nodes' devices registered with Ray?)"
        )
    _log_placement(pg)
    return pg


def _log_placement(pg) -> None:
    """One line: the node (address) of each bundle, i.e. of each rank of the groups built on `pg`."""
    import ray
    from ray.util.placement_group import placement_group_table

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    by_bundle = placement_group_table(pg).get("bundles_to_node_id", {})
    where = [f"{i}->{ips.get(by_bundle[i], by_bundle[i][:8])}" for i in sorted(by_bundle)]
    logger.info("placement: rank->node %s (%d node(s))", " ".join(where), len(set(by_bundle.values())))


def _death_summary(e: Exception) -> str:
    """Ray's actor-death text is a page long; keep what tells the user what happened."""
    text = str(e)
    detail = ""
    for line in text.splitlines():
        if "exit detail" in line.lower():
            detail = line.split(":", 1)[-1].strip()
            break
    return "its process died (killed, e.g. by the OOM killer or kill -9, or crashed)" + (
        f": {detail}" if detail else ""
    )


PEER_GRACE_S = 15.0
"""How long a rank's error that only says its collective lost a peer waits for the other ranks' outcomes, so that
the error names the rank that died or raised (Ray may report a killed actor after its peers' broken connections)."""


def _root_cause(failure: tuple, pending: list, grace_s: float) -> tuple:
    """(ref, exception) to report: `failure` unless it is a peer failure and another of `pending` ends within
    `grace_s` with an error of its own (a death or an exception that is not a peer failure)."""
    import ray

    if not is_peer_failure(str(failure[1])) or not pending:
        return failure
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:
            if not is_peer_failure(str(e)):
                return ref, e
    return failure


def collect(refs: Sequence[Any], what: str, kill: Sequence[Any] = (), labels: Sequence[str] | None = None) -> list:
    """ray.get in completion order: the first error kills `kill` (the group's actors) and raises WorkerError
    naming `what` and the failing rank (labels[i], default "rank i"). An error that only reports a lost collective
    peer waits up to PEER_GRACE_S for the rank behind it (`_root_cause`). ray.kill does not wait for the processes
    to exit (and Ray reports an actor dead as soon as it is asked to kill it), so a killed rank may still write for
    a moment after this raises."""
    import ray
    from ray.exceptions import RayActorError

    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as first:
                ref, e = _root_cause((ref, first), pending, PEER_GRACE_S)
                for actor in kill:
                    ray.kill(actor, no_restart=True)
                who = labels[index[ref]] if labels else f"rank {index[ref]}"
                if isinstance(e, RayActorError):
                    raise WorkerError(f"{what}: {who} failed: {_death_summary(e)}") from e
                cause = getattr(e, "cause", None)  # a RayTaskError: the worker's own exception (traceback chained)
                why = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(e)
                raise WorkerError(f"{what}: {who} failed: {why}") from e
    return ray.get(list(refs))


def worker_threads(pg, world_size: int) -> list[int]:
    """Torch threads for each rank of a group on `pg`: $MINDRL_WORKER_THREADS if set (the tests pin 1), else its
    node's CPUs (as Ray counts them) shared among the group's ranks on that node, at least 1: a world-1 run uses
    every core instead of one.

    The actor's and the critic's ranks share the cores: they run in turn (only the critic's values overlap
    the actor's logprob passes). The rollout engine in the same process runs on these threads too."""
    import ray
    from ray.util.placement_group import placement_group_table

    from mindrl.launch import threads_from_env

    threads = threads_from_env()
    if threads is not None:
        return [threads] * world_size
    by_bundle = placement_group_table(pg).get("bundles_to_node_id", {})
    nodes = [by_bundle.get(i) for i in range(world_size)]
    cpus = {n["NodeID"]: n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive", True)}
    return [max(1, int(cpus.get(node) or os.cpu_count() or 1) // nodes.count(node)) for node in nodes]


class WorkerGroup:
    """`world_size` ranks of one model, one per bundle of `pg` from bundle `first_bundle` on (separate placement: a
    role's own devices), each claiming `fraction` of its device, with `threads` torch threads (one count for all
    ranks, or one per rank), their processes started with `env` besides the job's runtime env."""

    def __init__(
        self,
        cls: type,
        name: str,
        pg,
        world_size: int,
        fraction: float,
        threads: int | list[int] = 1,
        first_bundle: int = 0,
        env: dict[str, str] | None = None,
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name = name
        self.cls = cls
        options = current_platform().ray_actor_options(fraction)
        if env:  # merged over the job's env_vars by Ray
            options["runtime_env"] = {"env_vars": dict(env)}
        remote = ray.remote(**options)(cls)
        self.actors = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first_bundle + i),
                name=None,
            ).remote()
            for i in range(world_size)
        ]
        self.pids: list[int | None] = [None] * world_size
        addr, port = self.call_one(0, "node_address")
        per_rank = threads if isinstance(threads, list) else [threads] * world_size
        joined = self.call("init_world", [(i, world_size, addr, port, per_rank[i]) for i in range(world_size)])
        self.pids = [pid for pid, _ in joined]
        self.infos: list = []
        if env and env.get(DETERMINISTIC_ENV) == "1":  # asked for: a rank that did not turn it on fails the start
            off = [label for label, (_, on) in zip(self.labels(), joined) if not on]
            if off:
                self.shutdown()
                raise WorkerError(f"{name}: {', '.join(off)} started without deterministic computation although its "
                                  f"environment sets {DETERMINISTIC_ENV}=1")  # fmt: skip

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, method: str, per_rank_args: Sequence[tuple] | None = None, *args: Any) -> list:
        """Call `method` on every rank (per_rank_args[i] for rank i, else the same args) and collect."""
        if per_rank_args is None:
            per_rank_args = [args] * len(self.actors)
        refs = [getattr(a, method).remote(*a_args) for a, a_args in zip(self.actors, per_rank_args)]
        return collect(refs, f"{self.name}.{method}", self.actors, self.labels())

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        ref = getattr(self.actors[rank], method).remote(*args)
        return collect([ref], f"{self.name}.{method}", self.actors, [self.labels()[rank]])[0]

    def labels(self) -> list[str]:
        """ "rank R (pid P)" of each rank, for error messages."""
        return [f"rank {r}" + (f" (pid {pid})" if pid else "") for r, pid in enumerate(self.pids)]

    def setup(self, settings: Any) -> None:
        self.infos = self.call("setup", None, settings)

    @property
    def dp_size(self) -> int:
        return self.infos[0].dp_size

    def start(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        """Start `method` as its worker class declares (`mindrl.workers.dispatch`) without waiting (e.g. the critic's
        values while the actor computes); `Pending.wait` collects it. The group's stubs (`group.<method>(...)`)
        call this."""
        import ray

        mode = dispatch_mode(self.cls, method)
        if mode is None:
            raise AttributeError(f"{self.cls.__name__}.{method} is not a registered worker method")
        what = f"{self.name}.{method}"
        if mode is Dispatch.ALL:
            calls = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
            return Pending(self, what, mode, calls)
        if mode is Dispatch.PER_RANK:
            (per_rank_args,) = args
            calls = [getattr(a, method).remote(*a_args) for a, a_args in zip(self.actors, per_rank_args)]
            return Pending(self, what, mode, calls)
        batch, *rest = args
        bound = inspect.signature(getattr(self.cls, method)).bind(None, batch, *rest, **kwargs)
        shards = shard_rows(len(batch), self.dp_size, bound.arguments.get("num_mini_batches", 1))
        refs = {d: ray.put(batch.index(rows)) for d, rows in enumerate(shards)}
        calls = [
            getattr(actor, method).remote(refs[i.dp_rank] if i.is_source else None, *rest, **kwargs)
            for actor, i in zip(self.actors, self.infos)
        ]
        return Pending(self, what, mode, calls, shards, len(batch))

    def __getattr__(self, name: str) -> GroupMethod:
        cls = self.__dict__.get("cls")
        if name.startswith("_") or cls is None or dispatch_mode(cls, name) is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return GroupMethod(self, name)

    def shutdown(self, graceful_s: float | None = None) -> None:
        """Kill the ranks; with `graceful_s`, first let each run its own `shutdown` (e.g. an engine removing its
        shared memory) for up to that long."""
        import ray

        if graceful_s is not None and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=graceful_s)
            except Exception as e:
                logger.warning("%s shutdown: %s", self.name, e)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []


@dataclass
class Pending:
    """A started group call (`WorkerGroup.start`); `wait` collects it as its method's dispatch mode says."""

    group: WorkerGroup
    what: str
    mode: Dispatch
    calls: list
    shards: list[list[int]] = field(default_factory=list)
    num_rows: int = 0

    def wait(self) -> Any:
        g = self.group
        results = collect(self.calls, self.what, g.actors, g.labels())
        if self.mode in (Dispatch.ALL, Dispatch.PER_RANK):
            return results
        out = {i.dp_rank: r for i, r in zip(g.infos, results) if i.is_output}
        if self.mode is Dispatch.DP_OUTPUT:
            return out[0]
        parts = [(self.shards[d], out[d]) for d in range(g.dp_size)]
        return type(parts[0][1]).gather(parts, self.num_rows)


class GroupMethod:
    """`group.<method>`: calling it runs the registered worker method on the group and returns its collected
    result; `start` returns the `Pending` call instead."""

    def __init__(self, group: WorkerGroup, name: str):
        self.group, self.name = group, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.group.start(self.name, *args, **kwargs).wait()

    def start(self, *args: Any, **kwargs: Any) -> Pending:
        return self.group.start(self.name, *args, **kwargs)
