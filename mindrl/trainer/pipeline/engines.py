"""The engine layer: who samples tokens for the trainer's own rollouts (the engines inside the integrated workers, an
engine group on devices of its own, or rollout servers), behind `RolloutSource.generate`; `Engine` is what episodes
call. (bounded's sampler processes are engines outside the trainer: `bounded`.)"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mindrl.rollout.base import RolloutSample, SamplingConfig
from mindrl.serving.client import (
    PushOutcome,
    RolloutClient,
    RolloutServerError,
    ServerUnreachable,
    VersionMismatch,
    samples_in_order,
)
from mindrl.serving.protocol import read_token

logger = logging.getLogger("mindrl.rollout")


@dataclass
class RolloutResult:
    samples: list[list[RolloutSample]]
    """Per prompt (in prompt order), `sampling.n` samples with token ids and logprobs."""
    timing: dict[str, float] = field(default_factory=dict)
    """Metrics of the call: timing/reshard_to_infer, timing/rollout, timing/reshard_to_train (seconds, slowest rank)
    integrated; timing/weight_sync, timing/rollout and rollout/weight_sync_bytes ... from servers."""


class RolloutSource(abc.ABC):
    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        """Samples from the current policy (its weights are the trainer's latest). seeds: one per prompt, so
        the samples do not depend on how the prompts are spread over engine replicas."""

    def awake(self, timing: dict[str, float]) -> contextlib.AbstractContextManager:
        """Within it, every `generate` samples from the weights loaded on entry, loaded once for all of them (an
        agent loop's turns); its own timings added to `timing`. By default each call loads them itself."""
        return contextlib.nullcontext()


class Engine:
    """The rollout as episodes and the evaluation call it: each call enters the rollout phase (a rollout leaves the
    models where scoring wants them), pads the prompts to split over the `replicas` engine replicas (the copies'
    samples dropped), and sums the call's timings into `timing`. Inside `awake` the calls share one weight load."""

    SUMMED = ("timing/", "rollout/weight_loads", "rollout/server_resyncs")
    """Metrics that add up over the calls of one iteration (the others are the last call's)."""

    def __init__(self, source: RolloutSource, enter_phase: Callable[[str, dict], None], replicas: int):
        self.source, self.enter_phase, self.replicas = source, enter_phase, replicas
        self._awake = False

    @contextlib.contextmanager
    def awake(self, timing: dict[str, float]):
        """The rollout phase and the current weights in the engines for all the `generate` calls within (an agent
        loop's turns): entered and loaded once, not once per call."""
        if self._awake:
            yield
            return
        self.enter_phase("rollout", timing)
        t0 = time.perf_counter()
        got: dict[str, float] = {}
        with self.source.awake(got):
            self._awake = True
            try:
                yield
            finally:
                self._awake = False
        timing["timing/rollout_total"] = timing.get("timing/rollout_total", 0.0) + time.perf_counter() - t0
        self._add(timing, got)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int], timing: dict[str, float]
    ) -> list[list[RolloutSample]]:
        if not self._awake:
            self.enter_phase("rollout", timing)
        prompts, seeds = list(prompts), list(seeds)
        pad = -len(prompts) % self.replicas
        t0 = time.perf_counter()
        result = self.source.generate(prompts + prompts[-1:] * pad, sampling, seeds + seeds[-1:] * pad)
        if not self._awake:  # else the time is awake's, which also holds the weight load and the tools
            timing["timing/rollout_total"] = timing.get("timing/rollout_total", 0.0) + time.perf_counter() - t0
        self._add(timing, result.timing)
        return result.samples[: len(prompts)]

    def _add(self, timing: dict[str, float], metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            timing[k] = timing.get(k, 0.0) + v if k.startswith(self.SUMMED) else v


class IntegratedRollout(RolloutSource):
    """The engines inside the integrated worker group: each engine replica (infer-TP ranks) takes a
    contiguous slice of the prompts; the actor weights are resharded into them on every call, or once for the calls
    within `awake`."""

    def __init__(self, group, infer_tp: int):
        self.group = group
        self.infer_tp = infer_tp

    @contextlib.contextmanager
    def awake(self, timing: dict[str, float]):
        _slowest(timing, self.group.wake_engine(True))
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended the rollout is the one to report
                self.group.sleep_engine()
            raise
        _slowest(timing, self.group.sleep_engine())

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        replicas = self.group.world_size // self.infer_tp
        if len(prompts) % replicas:
            raise ValueError(f"{len(prompts)} prompts do not split over {replicas} engine replicas")
        size = len(prompts) // replicas
        args = []
        for rank in range(self.group.world_size):
            r = rank // self.infer_tp
            first = rank % self.infer_tp == 0
            part = (list(prompts[r * size : (r + 1) * size]), list(seeds[r * size : (r + 1) * size]))
            args.append((*(part if first else (None, None)), sampling))
        results = self.group.generate(args)
        samples = [group for s, _ in results if s is not None for group in s]
        timing: dict[str, float] = {}
        _slowest(timing, [t for _, t in results])
        return RolloutResult(samples, timing)


def _slowest(timing: dict[str, float], per_rank: Sequence[dict[str, float]]) -> None:
    """Each metric of the ranks' `per_rank` at its largest (the slowest rank's time) into `timing`."""
    for t in per_rank:
        for k, v in t.items():
            timing[k] = max(timing.get(k, 0.0), v)


class EngineGroupRollout(RolloutSource):
    """Separate placement's engines on devices of their own (`rl_config.rollout_resource`): every call streams the
    actor's weights to them as version V = previous + 1 over the weight group (`mindrl.workers.weight_sync`), then
    each engine replica samples a contiguous slice of the prompts with V; within `awake`, once for all the calls."""

    def __init__(self, actor, engines, infer_tp: int, timeout_s: float = 1800.0):
        self.actor, self.engines, self.infer_tp = actor, engines, infer_tp
        self.version = 0
        """The weight version the engines hold (0: their dummy weights, before the first call)."""
        self._held = False
        self.keep = False
        """Keep a copy of what the engines received (`engines.received_weights()`; tests)."""
        addr, port = actor.call_one(0, "node_address")
        size = actor.world_size + engines.world_size
        joins = [actor.join_weights.start([(addr, port, r, size, timeout_s) for r in range(actor.world_size)]),
                 engines.join_weights.start([(addr, port, actor.world_size + r, size, timeout_s)
                                             for r in range(engines.world_size)])]  # fmt: skip
        _wait_both(joins, actor, engines)

    def sync(self) -> dict[str, float]:
        """Stream the actor's current weights to the engines as the next version; its metrics."""
        version = self.version + 1
        t0 = time.perf_counter()
        actor, _ = _wait_both([self.actor.send_weights.start(version),
                              self.engines.receive_weights.start(version, self.keep)], self.actor, self.engines)  # fmt: skip
        self.version = version
        return {"timing/weight_sync": time.perf_counter() - t0, "rollout/weight_sync_bytes": float(actor[0][1]),
                "rollout/weight_version": float(version)}  # fmt: skip

    @contextlib.contextmanager
    def awake(self, timing: dict[str, float]):
        """One version streamed on entry; the calls within sample with it (the actor does not change meanwhile)."""
        timing.update(self.sync())
        self._held = True
        try:
            yield
        finally:
            self._held = False

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        timing = {} if self._held else self.sync()
        replicas = self.engines.world_size // self.infer_tp
        if len(prompts) % replicas:
            raise ValueError(f"{len(prompts)} prompts do not split over {replicas} engine replicas")
        size = len(prompts) // replicas
        args = []
        for rank in range(self.engines.world_size):
            r = rank // self.infer_tp
            part = (list(prompts[r * size : (r + 1) * size]), list(seeds[r * size : (r + 1) * size]))
            args.append((*(part if rank % self.infer_tp == 0 else (None, None)), sampling, self.version))
        results = self.engines.generate(args)
        samples = [group for s, _ in results if s is not None for group in s]
        for _, t in results:
            for k, v in t.items():
                timing[k] = max(timing.get(k, 0.0), v)
        return RolloutResult(samples, timing)


def trainer_rollout(remote: RemoteRollout | None, actor, engines, infer_tp: int) -> RolloutSource:
    """The rollout of the trainer's own generation: the rollout servers of `remote` (`connect_servers`), the engine
    group `engines` on devices of their own, or the engines inside the actor's workers."""
    if remote is not None:
        return remote.attach(actor)
    return EngineGroupRollout(actor, engines, infer_tp) if engines is not None else IntegratedRollout(actor, infer_tp)


def _wait_both(pending: list, actor, engines) -> list:
    """Collect two groups' calls (ALL / PER_RANK) that form one collective, in completion order: a failure in either
    kills both groups (the other side would wait in the collective until its timeout) and names the rank."""
    from mindrl.workers.group import collect

    refs = [ref for p in pending for ref in p.calls]
    labels = [f"{p.what} {label}" for p in pending for label in p.group.labels()]
    out = collect(refs, " + ".join(p.what for p in pending), [*actor.actors, *engines.actors], labels)
    n = len(pending[0].calls)
    return [out[:n], out[n:]]


class RemoteRolloutError(RuntimeError):
    """Rollout servers could not serve the current policy (a server gone past `server_timeout`, a refused request,
    or a version that is not the trainer's); the message names the server's URL."""


PushFn = Callable[[int, Sequence[str]], list[PushOutcome]]
"""push(version, urls): stream the actor's current weights to those servers as `version` (one collective pass over
the actor's ranks); one outcome per url."""


class RemoteRollout(RolloutSource):
    """Rollout servers (`mindrl-rollout-server`): every call pushes the actor's weights to all servers as version
    V = previous + 1 (within `awake`, once for all the calls), then each server samples a contiguous slice of the
    prompts with `expected_version=V`; the slices come back in prompt order. A server that stops answering is waited for (backoff, `timeout` seconds
    from its first failure); one that comes back with older weights (restarted) is re-synced before it serves."""

    def __init__(
        self,
        clients: Sequence[RolloutClient],
        push: PushFn,
        timeout: float,
        version: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not clients:
            raise ValueError("RemoteRollout needs at least one rollout server")
        self.clients = list(clients)
        self.by_url = {c.url: c for c in self.clients}
        self.push = push
        self.timeout = timeout
        self.version = version
        """The weight version the servers hold (all of them, between calls)."""
        self.sleep = sleep
        self.resyncs = 0
        """Full weight pushes to a server beyond the one per iteration (restarted or failed servers), in total."""
        self.token: str | None = None
        self.bucket_bytes = 512 << 20
        self.transfer = "auto"
        self._held = False

    def attach(self, group) -> RemoteRollout:
        """Push the weights of the actor's worker group (see `group_pusher`)."""
        self.push = group_pusher(group, self.clients, self.token, self.bucket_bytes, self.transfer)
        return self

    def close(self) -> None:
        for c in self.clients:
            c.close()

    @contextlib.contextmanager
    def awake(self, timing: dict[str, float]):
        """One version pushed on entry; the calls within sample with it. A server restarted meanwhile is re-synced to
        that version: the actor's weights do not change within."""
        t0 = time.perf_counter()
        sent = self._sync(self.version + 1, [c.url for c in self.clients], {})
        self.version += 1
        timing.update({"timing/weight_sync": time.perf_counter() - t0, "rollout/weight_sync_bytes": float(sent),
                       "rollout/weight_version": float(self.version)})  # fmt: skip
        self._held = True
        try:
            yield
        finally:
            self._held = False

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seeds: Sequence[int]
    ) -> RolloutResult:
        resyncs_before = self.resyncs
        t0 = time.perf_counter()
        sent = 0
        if not self._held:
            sent = self._sync(self.version + 1, [c.url for c in self.clients], {})
            self.version += 1
        t1 = time.perf_counter()
        samples, sent_again = self._generate_all(prompts, sampling, seeds, self.version)
        t2 = time.perf_counter()
        timing = {
            "timing/rollout": t2 - t1,  # includes any re-sync of a restarted server
            "rollout/server_resyncs": float(self.resyncs - resyncs_before),
        }
        if not self._held:  # else awake's
            timing.update({"timing/weight_sync": t1 - t0, "rollout/weight_sync_bytes": float(sent + sent_again),
                           "rollout/weight_version": float(self.version)})  # fmt: skip
        return RolloutResult(samples, timing)

    # ------------------------------------------------------------------------------------------------ pieces
    def _remaining(self, url: str, deadlines: dict[str, float]) -> float:
        """Seconds left for `url` to recover; its clock starts at its first failure in this call."""
        deadline = deadlines.setdefault(url, time.monotonic() + self.timeout)
        return deadline - time.monotonic()

    def _wait(self, url: str, deadlines: dict[str, float], what: str):
        left = self._remaining(url, deadlines)
        try:
            return self.by_url[url].wait_ready(max(left, 0.0), sleep=self.sleep, what=what)
        except ServerUnreachable as e:
            raise RemoteRolloutError(
                f"rollout server {url} is gone: {e} (generate_config.server_timeout={self.timeout:g} s)"
            ) from e

    def _sync(self, version: int, urls: Sequence[str], deadlines: dict[str, float]) -> int:
        """Push `version` to `urls` until every one committed it; returns the bytes sent. Servers that do not answer
        are waited for (and pushed to again) within their deadline."""
        sent = 0
        pending = list(urls)
        while pending:
            outcomes = self.push(version, pending)
            sent += sum(o.bytes for o in outcomes)
            pending = []
            for o in outcomes:
                if o.ok:
                    continue
                if not o.retryable:
                    raise RemoteRolloutError(f"weight update of rollout server {o.url} to version {version}: {o.error}")
                logger.warning("weight push to %s failed (%s); waiting for it", o.url, o.error)
                health = self._wait(o.url, deadlines, f"to receive weight version {version}")
                self._check_not_ahead(o.url, health.version, version)
                if health.version != version:  # else the commit went through and only its answer was lost
                    pending.append(o.url)
            self.resyncs += len(pending)
        return sent

    @staticmethod
    def _check_not_ahead(url: str, served: int | None, version: int) -> None:
        if served is not None and served > version:
            raise RemoteRolloutError(
                f"rollout server {url} serves weight version {served}, ahead of this trainer's {version}: another "
                "trainer is updating it (each trainer needs its own servers)"
            )

    def _generate_all(self, prompts, sampling, seeds, version: int) -> tuple[list[list[RolloutSample]], int]:
        """Contiguous slices over the servers, concurrently; failed slices are retried after recovery."""
        from concurrent.futures import ThreadPoolExecutor

        k = len(self.clients)
        bounds = [len(prompts) * i // k for i in range(k + 1)]  # slice sizes differ by at most one
        todo = {i: self.clients[i] for i in range(k) if bounds[i + 1] > bounds[i]}
        done: dict[int, list[list[RolloutSample]]] = {}
        deadlines: dict[str, float] = {}
        sent = 0
        with ThreadPoolExecutor(max_workers=k) as pool:
            while todo:
                futures = {
                    i: pool.submit(
                        c.generate,
                        prompts[bounds[i] : bounds[i + 1]],
                        sampling,
                        list(seeds[bounds[i] : bounds[i + 1]]),
                        version,
                    )
                    for i, c in todo.items()
                }
                failed: dict[int, RolloutClient] = {}
                for i, fut in futures.items():
                    try:
                        done[i] = fut.result().samples
                    except (ServerUnreachable, VersionMismatch) as e:
                        logger.warning("rollout on %s failed (%s); recovering", todo[i].url, e)
                        failed[i] = todo[i]
                    except RolloutServerError as e:
                        raise RemoteRolloutError(f"rollout on server {e.url}: {e}") from e
                stale = []
                for c in failed.values():
                    health = self._wait(c.url, deadlines, f"to sample with weight version {version}")
                    self._check_not_ahead(c.url, health.version, version)
                    if health.version != version:  # restarted (or a failed commit): older weights
                        logger.warning(
                            "rollout server %s is back with weight version %d; re-syncing it to %d",
                            c.url,
                            health.version,
                            version,
                        )
                        stale.append(c.url)
                if stale:
                    self.resyncs += len(stale)
                    sent += self._sync(version, stale, deadlines)
                todo = failed
        return samples_in_order(done), sent


def group_pusher(
    group, clients: Sequence[RolloutClient], token: str | None, bucket_bytes: int, transfer: str = "auto"
) -> PushFn:
    """A `PushFn` over the actor's worker group: every rank streams (a collective), and the servers are dealt out
    round-robin over the ranks so that several servers are sent to in parallel, by `transfer` (resolved on the
    ranks: "auto" is their platform's choice)."""
    timeout = max(c.timeout for c in clients)

    def push(version: int, urls: Sequence[str]) -> list[PushOutcome]:
        world = group.world_size
        args = [(version, list(urls[r::world]), token, bucket_bytes, timeout, transfer) for r in range(world)]
        by_url = {o.url: o for outs in group.push_weights(args) for o in outs}
        return [by_url[u] for u in urls]

    return push


def connect_servers(gen, needed_len: int) -> RemoteRollout:
    """Rollout-server mode, before any worker starts: a client per `gen.server_urls` (a validated generate_config),
    each server waited for (`server_timeout`), its token and its max_model_len checked. The RemoteRollout gets its
    weight pusher with `attach(actor_group)` once the actor's ranks exist."""
    token = None
    if gen.server_token_file:
        try:
            token = read_token(gen.server_token_file)
        except ValueError as e:
            raise RemoteRolloutError(f"generate_config.server_token_file: {e}") from None
    clients = [RolloutClient(u, token, gen.server_timeout) for u in gen.server_urls]
    try:
        versions = [_check_server(c, needed_len) for c in clients]
    except BaseException:
        for c in clients:
            c.close()
        raise
    rollout = RemoteRollout(clients, _unattached, gen.server_timeout, version=max(versions))
    rollout.token = token
    rollout.bucket_bytes = int(gen.bucket_size_mb * 1024 * 1024)
    rollout.transfer = gen.weight_transfer
    return rollout


def _check_server(c: RolloutClient, needed_len: int) -> int:
    """Wait for the server, check the token and max_model_len; returns the weight version it holds."""
    try:
        health = c.wait_ready(what="at the start of the run")
        c.check_token()
    except RolloutServerError as e:
        key = "server_token_file" if e.status == 401 else "server_urls"
        raise RemoteRolloutError(f"generate_config.{key}: {e}") from e
    if health.max_model_len < needed_len:
        raise RemoteRolloutError(
            f"rollout server {c.url} serves max_model_len={health.max_model_len}, but prompts of "
            f"rl_config.max_prompt_length plus sampling_config.max_tokens (with multi_turn_enable, plus "
            f"max_total_response_length where larger: a whole episode) need {needed_len} (start it with "
            f"--max-model-len {needed_len})"
        )
    logger.info("rollout server %s: %s at weight version %d", c.url, health.model, health.version)
    return health.version


def _unattached(version: int, urls: Sequence[str]) -> list[PushOutcome]:
    raise RuntimeError("RemoteRollout.attach(actor_group) was not called: there is no one to push the weights")
