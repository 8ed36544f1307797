"""Transports between asynchronous samplers and the trainer behind one interface (experiences with backpressure one
way, versioned weights and prompt leases the other): ZeroMQ across hosts, Ray inside one cluster. See docs/async.md."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from mindrl.data.prompt_ledger import Lease, PromptLedger
from mindrl.serving.experience import RUN_ID, Experience, MalformedMessage, decode, encode
from mindrl.serving.protocol import ServerError, decode_bucket, encode_bucket

logger = logging.getLogger("mindrl.serving.transport")

DATA_PORT = 5555
SYNC_PORT = 5556
SYNC_SCHEMA = "mindrl.sync"
SYNC_VERSION = 1
DEFAULT_BUCKET_BYTES = 64 << 20


class TransportTimeout(TimeoutError):
    """A bounded wait ran out; the message says which channel (and address) it was."""


@dataclass
class WeightUpdate:
    version: int
    tensors: dict[str, torch.Tensor]
    run_id: str = ""
    """The publishing trainer's run id: the sampler stamps it on the groups these weights sample."""


@dataclass
class TransportStats:
    received: int = 0
    """Experience groups accepted (handed to the trainer)."""
    dropped_malformed: int = 0
    dropped_duplicate: int = 0
    dropped_stale: int = 0
    """Experiences (responses) refused as older than the trainer's freshness bound; their prompts are re-issued."""
    dropped_foreign: int = 0
    """Experiences refused as sampled with another run's weights (their run id is not this trainer's, or their version
    is newer than any it published): a previous run's, e.g. past the checkpoint this one resumed from. Their prompts
    are re-issued."""
    last_reason: str = ""
    last_seen: dict[str, float] = field(default_factory=dict)
    """sampler_id -> time.monotonic() of its last message on either channel."""


def check_group(group: Sequence[Experience]) -> tuple[str, int, int]:
    """(sampler_id, prompt_index, epoch) shared by every experience of one message; MalformedMessage otherwise."""
    keys = {(e.sampler_id, e.prompt_index, e.epoch) for e in group}
    if len(keys) != 1:
        raise MalformedMessage(
            f"one message must hold one prompt's responses, got (sampler, prompt, epoch) {sorted(keys)}"
        )
    return keys.pop()


def weight_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[bytes]:
    """The tensors as safetensors byte buckets of about `bucket_bytes` each (a tensor is never split)."""
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = t
        size += n
    return [encode_bucket(b) for b in buckets if b]


def tensors_from_buckets(frames: Sequence[bytes]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, frame in enumerate(frames):
        try:
            out.update(decode_bucket(bytes(frame)))
        except ServerError as e:
            raise MalformedMessage(f"weight bucket {i}: {e.message}") from None
    return out


class TrainerEnd(ABC):
    """The trainer's side: accepted experience groups in, versioned weights and prompt leases out. Owns the
    prompt ledger: every received group is checked against it, duplicates and malformed messages are dropped
    (logged, counted in `stats`), never raised."""

    def __init__(self, ledger: PromptLedger):
        self.ledger = ledger
        self.run_id = secrets.token_hex(6)
        """This trainer's run (one per start, a resume included): published with the weights, checked on each group."""
        self.stats = TransportStats()
        self._lock = threading.Lock()  # ledger and stats: the sync thread serves leases concurrently
        self._oldest_version: int | None = None  # groups sampled with older weights are refused (set_freshness)
        self._newest_version: int | None = None  # the newest weights published (set by publish_weights)
        self.max_in_flight: int | None = None
        """At most this many prompts leased and not yet received (None: no bound): how far samplers run ahead."""

    def set_max_in_flight(self, count: int | None) -> None:
        """Lease at most `count` prompts beyond those received (None: no bound): how far samplers run ahead."""
        self.max_in_flight = count

    def set_freshness(self, version: int, max_staleness: int) -> None:
        """From now on refuse groups with an experience older than `version - max_staleness`: counted in
        `stats.dropped_stale`, their prompt given back to the ledger (re-issued first)."""
        self._oldest_version = version - max_staleness

    @abstractmethod
    def receive(self, max_groups: int, timeout_s: float) -> list[list[Experience]]:
        """Up to `max_groups` accepted groups (one prompt's responses each), waiting at most `timeout_s` for the
        first; fewer (possibly none) on timeout."""

    @abstractmethod
    def publish_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Make `version` the newest weights samplers fetch; older ones are released."""

    @abstractmethod
    def close(self) -> None: ...

    def sampler_dead(self, sampler_id: str) -> list[Lease]:
        """Declare a sampler dead: its in-flight prompts are re-issued to the next lease requests."""
        with self._lock:
            back = self.ledger.sampler_dead(sampler_id)
            self.stats.last_seen.pop(sampler_id, None)
        logger.warning("sampler %s declared dead; %d in-flight prompts re-issued", sampler_id, len(back))
        return back

    def ledger_state(self) -> dict:
        """The ledger's `state_dict`, taken while no lease is being served."""
        with self._lock:
            return self.ledger.state_dict()

    def restore_ledger(self, state: dict) -> list[str]:
        """Load a checkpoint's ledger state; the samplers holding leases in it (the previous run's) are declared dead,
        so their prompts are re-issued (returned: those samplers)."""
        with self._lock:
            self.ledger.load_state_dict(state)
            holders = self.ledger.holders()
        for s in holders:
            self.sampler_dead(s)
        return holders

    def silent_samplers(self, timeout_s: float) -> list[str]:
        """Samplers not heard from on either channel for `timeout_s`."""
        now = time.monotonic()
        with self._lock:
            return [s for s, t in self.stats.last_seen.items() if now - t > timeout_s]

    def _seen(self, sampler_id: str) -> None:
        self.stats.last_seen[sampler_id] = time.monotonic()

    def _lease(self, sampler_id: str, count: int) -> list[Lease]:
        with self._lock:
            self._seen(sampler_id)
            if self.max_in_flight is not None:
                count = max(0, min(count, self.max_in_flight - len(self.ledger.in_flight())))
            return self.ledger.issue(sampler_id, count) if count else []

    def _accept(self, data: bytes) -> list[Experience] | None:
        """The group in `data` if it decodes and the ledger accepts it; None (logged, counted) otherwise."""
        try:
            group = decode(data)
            sampler_id, prompt_index, epoch = check_group(group)
        except MalformedMessage as e:
            with self._lock:
                self.stats.dropped_malformed += 1
                self.stats.last_reason = e.reason
            logger.warning("dropped a malformed experience message (%d bytes): %s", len(data), e.reason)
            return None
        with self._lock:
            self._seen(sampler_id)
            oldest = min(e.weight_version for e in group)
            newest = max(e.weight_version for e in group)
            runs = {e.meta.get(RUN_ID) for e in group} - {None}  # none: a sampler that stamps no run id
            foreign = None
            if runs and runs != {self.run_id}:
                foreign = f"run {', '.join(sorted(map(str, runs)))}, not this trainer's {self.run_id}"
            elif self._newest_version is not None and newest > self._newest_version:
                foreign = f"weight version {newest}, newer than this trainer's {self._newest_version}"
            if foreign is not None:
                self.stats.dropped_foreign += len(group)
                self.stats.last_reason = (f"prompt {prompt_index} epoch {epoch} from {sampler_id} sampled with "
                                          f"{foreign} (a previous run's weights)")  # fmt: skip
                self.ledger.give_back(sampler_id, prompt_index, epoch)
                logger.info("dropped %s", self.stats.last_reason)
                return None
            if self._oldest_version is not None and oldest < self._oldest_version:
                self.stats.dropped_stale += len(group)
                self.stats.last_reason = (f"stale prompt {prompt_index} epoch {epoch} from {sampler_id}: weight version "
                                          f"{oldest} < {self._oldest_version}")  # fmt: skip
                self.ledger.give_back(sampler_id, prompt_index, epoch)
                logger.info("dropped %s", self.stats.last_reason)
                return None
            if not self.ledger.complete(sampler_id, prompt_index, epoch):
                self.stats.dropped_duplicate += 1
                self.stats.last_reason = f"duplicate prompt {prompt_index} epoch {epoch} from {sampler_id}"
                logger.info("dropped %s", self.stats.last_reason)
                return None
            self.stats.received += 1
        return group


class SamplerEnd(ABC):
    """A sampler's side: experiences out (blocking when the trainer's queue is full), leases and weights in."""

    def __init__(self, sampler_id: str):
        self.sampler_id = sampler_id

    @abstractmethod
    def send(self, group: Sequence[Experience], timeout_s: float | None = None) -> None:
        """Send one prompt's responses; blocks while the channel is full, TransportTimeout after `timeout_s`
        (None: wait for ever)."""

    @abstractmethod
    def lease(self, count: int, timeout_s: float = 30.0) -> list[Lease]:
        """Up to `count` prompts to sample; an empty list when the data is exhausted."""

    @abstractmethod
    def fetch_weights(
        self, have_version: int | None, timeout_s: float = 60.0, have_run: str | None = None
    ) -> WeightUpdate | None:
        """The trainer's newest weights unless they are version `have_version` (None: none held) of run `have_run`
        (None: any run), else None. Other weights are returned even if older: a resumed trainer's replace a previous
        run's."""

    @abstractmethod
    def close(self) -> None: ...


# ---- ZeroMQ -------------------------------------------------------------------------------------------------------


def _sync_request(op: str, sampler_id: str, **kw: Any) -> bytes:
    return msgpack.packb({"schema": SYNC_SCHEMA, "version": SYNC_VERSION, "op": op, "sampler_id": sampler_id, **kw})


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack's own errors for any malformed or truncated input
        raise MalformedMessage(f"{what} is not valid msgpack: {e}") from None
    if not isinstance(msg, dict) or msg.get("schema") != SYNC_SCHEMA:
        raise MalformedMessage(f"{what} is not a {SYNC_SCHEMA} message")
    if msg.get("version") != SYNC_VERSION:
        raise MalformedMessage(f"{what} has version {msg.get('version')!r}; this build reads {SYNC_VERSION}")
    return msg


class ZmqTrainerEnd(TrainerEnd):
    """Binds a PULL socket (experiences) on `data_port` and a ROUTER socket (weights and leases, served by a
    thread) on `sync_port`. `hwm` bounds the messages queued per sampler connection on the receiving side."""

    def __init__(
        self,
        ledger: PromptLedger,
        host: str = "0.0.0.0",
        data_port: int = DATA_PORT,
        sync_port: int = SYNC_PORT,
        hwm: int = 64,
        max_message_bytes: int = 1 << 30,
    ):
        import zmq

        super().__init__(ledger)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, hwm)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.data_address = f"tcp://{host}:{data_port}"
        self.sync_address = f"tcp://{host}:{sync_port}"
        self._bind(self._pull, self.data_address, "data")
        self._weights: tuple[int, list[bytes]] | None = None
        self._stop = threading.Event()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # requests are small
        try:
            self._bind(router, self.sync_address, "sync")
        except OSError:
            router.close()
            self._pull.close()
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._serve, args=(router,), name="mindrl-sync", daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, address: str, what: str) -> None:
        try:
            sock.bind(address)
        except self._zmq.ZMQError as e:
            raise OSError(f"cannot bind the {what} channel on {address}: {e}") from None

    def receive(self, max_groups: int, timeout_s: float) -> list[list[Experience]]:
        out: list[list[Experience]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < max_groups:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000)) if not out else 0
            if not self._pull.poll(wait_ms):
                if out or time.monotonic() >= deadline:
                    break
                continue
            group = self._accept(self._pull.recv(copy=True))
            if group is not None:
                out.append(group)
        return out

    def publish_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        frames = weight_buckets(tensors)
        with self._lock:
            if self._weights is not None and version <= self._weights[0]:
                raise ValueError(f"weight version {version} is not newer than the published {self._weights[0]}")
            self._weights = (version, frames)
            self._newest_version = version

    def _serve(self, router: Any) -> None:
        zmq = self._zmq
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or frames[1] != b"":  # [identity, empty delimiter (REQ envelope), request]
                    logger.warning("dropped a sync request with %d frames (expected a REQ envelope)", len(frames))
                    continue
                ident = frames[0]
                try:
                    reply = self._answer(_unpack(frames[2], "sync request"))
                except MalformedMessage as e:
                    logger.warning("dropped a malformed sync request: %s", e.reason)
                    reply = [msgpack.packb({"op": "error", "reason": e.reason})]
                router.send_multipart([ident, b"", *reply], copy=False)
        except zmq.ZMQError as e:  # the context was terminated under us: the end is closing
            if not self._stop.is_set():
                logger.error("sync channel %s failed: %s", self.sync_address, e)
        finally:
            router.close(linger=0)

    def _answer(self, req: dict[str, Any]) -> list[bytes]:
        sampler_id, op = req.get("sampler_id"), req.get("op")
        if not isinstance(sampler_id, str) or not sampler_id:
            raise MalformedMessage(f"sampler_id must be a non-empty string, got {sampler_id!r}")
        if op == "lease":
            count = req.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 1 << 16:
                raise MalformedMessage(f"lease count must be an integer in [0, 65536], got {count!r}")
            leases = self._lease(sampler_id, count)
            return [msgpack.packb({"op": "lease", "leases": [[x.prompt_index, x.epoch] for x in leases]})]
        if op == "weights":
            have, have_run = req.get("have"), req.get("have_run")
            with self._lock:
                self._seen(sampler_id)
                current = self._weights
            # a sampler that outlived a previous run may hold that run's weights, even a newer version than this
            # (resumed) trainer's: weights of another version or run are replaced
            if current is None or (current[0] == have and have_run in (None, self.run_id)):
                version = None if current is None else current[0]
                return [msgpack.packb({"op": "weights", "weight_version": version, "num_buckets": 0,
                                       "run_id": self.run_id})]  # fmt: skip
            version, buckets = current
            header = {"op": "weights", "weight_version": version, "num_buckets": len(buckets), "run_id": self.run_id}
            return [msgpack.packb(header), *buckets]
        if op == "ping":
            with self._lock:
                self._seen(sampler_id)
            return [msgpack.packb({"op": "ping"})]
        raise MalformedMessage(f"unknown sync op {op!r} (lease, weights, ping)")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pull.close(linger=0)
        self._ctx.term()


class ZmqSamplerEnd(SamplerEnd):
    """Connects a PUSH socket to the trainer's data port (at most `hwm` messages queued before `send` blocks;
    none are queued while no trainer is connected) and a REQ socket to its sync port, recreated after a
    timed-out request so a restarted trainer is picked up again. ZeroMQ reconnects both by itself."""

    def __init__(
        self,
        sampler_id: str,
        host: str,
        data_port: int = DATA_PORT,
        sync_port: int = SYNC_PORT,
        hwm: int = 64,
        linger_s: float = 10.0,
        max_weight_bytes: int = 1 << 36,
    ):
        import zmq

        super().__init__(sampler_id)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self.data_address = f"tcp://{host}:{data_port}"
        self.sync_address = f"tcp://{host}:{sync_port}"
        self._max_weight_bytes = max_weight_bytes
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, hwm)
        self._push.setsockopt(zmq.IMMEDIATE, 1)
        self._push.setsockopt(zmq.LINGER, int(linger_s * 1000))
        self._push.setsockopt(zmq.RECONNECT_IVL, 100)
        self._push.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._push.connect(self.data_address)
        self._req = None
        self._new_req()

    def _new_req(self) -> None:
        zmq = self._zmq
        if self._req is not None:
            self._req.close(linger=0)
        self._req = self._ctx.socket(zmq.REQ)
        self._req.setsockopt(zmq.LINGER, 0)
        self._req.setsockopt(zmq.RECONNECT_IVL, 100)
        self._req.setsockopt(zmq.MAXMSGSIZE, self._max_weight_bytes)
        self._req.connect(self.sync_address)

    def send(self, group: Sequence[Experience], timeout_s: float | None = None) -> None:
        data = encode(group)
        self._push.setsockopt(self._zmq.SNDTIMEO, -1 if timeout_s is None else int(timeout_s * 1000))
        try:
            self._push.send(data, copy=False)
        except self._zmq.Again:
            raise TransportTimeout(
                f"data channel {self.data_address}: no room after {timeout_s}s "
                "(the trainer is not reading, or not reachable)"
            ) from None

    def _request(self, payload: bytes, timeout_s: float) -> list[bytes]:
        self._req.send(payload)
        if not self._req.poll(int(timeout_s * 1000)):
            self._new_req()  # a REQ socket waiting for a reply cannot send again: start afresh
            raise TransportTimeout(f"sync channel {self.sync_address}: no reply within {timeout_s}s")
        frames = self._req.recv_multipart(copy=True)
        head = msgpack.unpackb(frames[0], raw=False)
        if isinstance(head, dict) and head.get("op") == "error":
            raise MalformedMessage(f"the trainer refused the request: {head.get('reason')}")
        return frames

    def lease(self, count: int, timeout_s: float = 30.0) -> list[Lease]:
        frames = self._request(_sync_request("lease", self.sampler_id, count=count), timeout_s)
        return [Lease(int(p), int(e)) for p, e in msgpack.unpackb(frames[0], raw=False)["leases"]]

    def ping(self, timeout_s: float = 10.0) -> None:
        self._request(_sync_request("ping", self.sampler_id), timeout_s)

    def fetch_weights(
        self, have_version: int | None, timeout_s: float = 60.0, have_run: str | None = None
    ) -> WeightUpdate | None:
        frames = self._request(_sync_request("weights", self.sampler_id, have=have_version, have_run=have_run),
                               timeout_s)  # fmt: skip
        head = msgpack.unpackb(frames[0], raw=False)
        if head["num_buckets"] == 0:
            return None
        if len(frames) - 1 != head["num_buckets"]:
            raise MalformedMessage(f"weights reply has {len(frames) - 1} buckets, header says {head['num_buckets']}")
        return WeightUpdate(int(head["weight_version"]), tensors_from_buckets(frames[1:]), str(head.get("run_id", "")))

    def close(self) -> None:
        self._push.close()  # lingers up to linger_s so queued experiences still reach the trainer
        self._req.close(linger=0)
        self._ctx.term()


# ---- Ray ----------------------------------------------------------------------------------------------------------


class _Hub:
    """The Ray actor between samplers and the trainer (async: a blocked `put` does not stall the others): a
    bounded queue of encoded experience messages, the newest weight buckets, and the prompt ledger. Only bytes,
    ints, strings and lists cross it; the payloads are the same msgpack messages the ZeroMQ transport carries."""

    def __init__(self, maxsize: int, ledger_args: dict[str, Any]):
        import asyncio

        self._queue: asyncio.Queue = asyncio.Queue(maxsize)
        self._weights: tuple[int, list[bytes]] | None = None
        self._run_id = ""
        self._ledger = PromptLedger(**ledger_args)
        self._seen: dict[str, float] = {}
        self._max_in_flight: int | None = None

    async def set_max_in_flight(self, count: int | None) -> None:
        self._max_in_flight = count

    async def put(self, data: bytes, timeout_s: float | None) -> bool:
        import asyncio

        try:
            await asyncio.wait_for(self._queue.put(data), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def get_many(self, max_items: int, timeout_s: float) -> list[bytes]:
        import asyncio

        try:
            out = [await asyncio.wait_for(self._queue.get(), timeout_s)]
        except asyncio.TimeoutError:
            return []
        while len(out) < max_items and not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    async def depth(self) -> int:
        return self._queue.qsize()

    async def publish(self, version: int, buckets: list[bytes], run_id: str = "") -> None:
        if self._weights is not None and version <= self._weights[0]:
            raise ValueError(f"weight version {version} is not newer than the published {self._weights[0]}")
        self._weights, self._run_id = (version, buckets), run_id

    async def fetch(self, sampler_id: str, have: int | None, have_run: str | None = None) -> tuple[int | None, str,
                                                                                                   list[bytes]]:  # fmt: skip
        self._seen[sampler_id] = time.monotonic()
        if self._weights is None or (self._weights[0] == have and have_run in (None, self._run_id)):  # as ZmqTrainerEnd
            return (None if self._weights is None else self._weights[0]), self._run_id, []
        return self._weights[0], self._run_id, self._weights[1]

    async def lease(self, sampler_id: str, count: int) -> list[list[int]]:
        self._seen[sampler_id] = time.monotonic()
        if self._max_in_flight is not None:
            count = max(0, min(count, self._max_in_flight - len(self._ledger.in_flight())))
        return [[x.prompt_index, x.epoch] for x in self._ledger.issue(sampler_id, count)] if count else []

    async def ledger_call(self, name: str, args: list[Any]) -> Any:
        value = getattr(self._ledger, name)
        result = value(*args) if callable(value) else value
        if isinstance(result, list) and result and isinstance(result[0], Lease):
            return [[x.prompt_index, x.epoch] for x in result]
        return result


class _LedgerProxy:
    """The hub's ledger as the trainer sees it (the methods TrainerEnd uses, plus the counters)."""

    def __init__(self, hub: Any):
        self._hub = hub

    def _call(self, name: str, *args: Any) -> Any:
        import ray

        return ray.get(self._hub.ledger_call.remote(name, list(args)))

    def complete(self, sampler_id: str, prompt_index: int, epoch: int) -> bool:
        return self._call("complete", sampler_id, prompt_index, epoch)

    def issue(self, sampler_id: str, count: int) -> list[Lease]:
        return [Lease(p, e) for p, e in self._call("issue", sampler_id, count)]

    def give_back(self, sampler_id: str, prompt_index: int, epoch: int) -> bool:
        return self._call("give_back", sampler_id, prompt_index, epoch)

    def sampler_dead(self, sampler_id: str) -> list[Lease]:
        return [Lease(p, e) for p, e in self._call("sampler_dead", sampler_id)]

    def in_flight(self, sampler_id: str | None = None) -> list[Lease]:
        return [Lease(p, e) for p, e in self._call("in_flight", sampler_id)]

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def holders(self) -> list[str]:
        return self._call("holders")

    def __getattr__(self, name: str) -> Any:  # counters: epochs_closed, duplicates, reissued, epoch
        if name.startswith("_"):
            raise AttributeError(name)
        return self._call(name)


class RayTrainerEnd(TrainerEnd):
    """Inside one Ray cluster: creates the hub actor (queue of at most `maxsize` messages: samplers block beyond
    it) holding a PromptLedger(**ledger_args). Hand `hub` to the samplers (`RaySamplerEnd(sampler_id, hub)`)."""

    def __init__(self, ledger_args: dict[str, Any], maxsize: int = 64, name: str | None = None):
        import ray

        self.hub = ray.remote(num_cpus=0, max_concurrency=64)(_Hub).options(name=name).remote(maxsize, ledger_args)
        super().__init__(_LedgerProxy(self.hub))  # type: ignore[arg-type]

    def receive(self, max_groups: int, timeout_s: float) -> list[list[Experience]]:
        import ray

        out: list[list[Experience]] = []
        deadline = time.monotonic() + timeout_s
        while not out:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for data in ray.get(self.hub.get_many.remote(max_groups - len(out), left)):
                group = self._accept(data)
                if group is not None:
                    out.append(group)
        return out

    def set_max_in_flight(self, count: int | None) -> None:
        import ray

        super().set_max_in_flight(count)
        ray.get(self.hub.set_max_in_flight.remote(count))

    def queue_depth(self) -> int:
        import ray

        return ray.get(self.hub.depth.remote())

    def publish_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        import ray

        ray.get(self.hub.publish.remote(version, weight_buckets(tensors), self.run_id))
        with self._lock:
            self._newest_version = version

    def close(self) -> None:
        import ray

        ray.kill(self.hub)


class RaySamplerEnd(SamplerEnd):
    def __init__(self, sampler_id: str, hub: Any):
        super().__init__(sampler_id)
        self.hub = hub

    def send(self, group: Sequence[Experience], timeout_s: float | None = None) -> None:
        import ray

        if not ray.get(self.hub.put.remote(encode(group), timeout_s)):
            raise TransportTimeout(f"Ray experience queue: no room after {timeout_s}s (the trainer is not reading)")

    def lease(self, count: int, timeout_s: float = 30.0) -> list[Lease]:
        import ray

        return [Lease(p, e) for p, e in ray.get(self.hub.lease.remote(self.sampler_id, count), timeout=timeout_s)]

    def fetch_weights(
        self, have_version: int | None, timeout_s: float = 60.0, have_run: str | None = None
    ) -> WeightUpdate | None:
        import ray

        version, run_id, buckets = ray.get(self.hub.fetch.remote(self.sampler_id, have_version, have_run),
                                           timeout=timeout_s)  # fmt: skip
        return None if not buckets else WeightUpdate(version, tensors_from_buckets(buckets), run_id)

    def close(self) -> None:
        pass
