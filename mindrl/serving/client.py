"""The trainer's side of the rollout server's protocol (health, versioned generation and weight pushes); errors name the
URL. A request is tried once: a generate or weight push that failed half-way must be redone from the start."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mindrl.rollout.base import RolloutSample, SamplingConfig
from mindrl.serving import protocol as p

logger = logging.getLogger("mindrl.serving.client")


class RolloutServerError(RuntimeError):
    """A rollout server refused or failed a request. `status` / `code` come from its error body (None when it did
    not answer); `extra` holds the body's other fields (e.g. `version` of a version_mismatch)."""

    def __init__(self, url: str, message: str, status: int | None = None, code: str | None = None, **extra: Any):
        super().__init__(message)
        self.url = url
        self.status = status
        self.code = code
        self.extra = extra


class ServerUnreachable(RolloutServerError):
    """No answer: connection refused or reset, a timeout, or a gateway / unavailable status (worth a retry)."""


class VersionMismatch(RolloutServerError):
    """The server serves another weight version than the one the trainer asked for (`served` vs `expected`)."""

    @property
    def served(self) -> int | None:
        v = self.extra.get("version")
        return v if isinstance(v, int) else None


_RETRYABLE_STATUS = (502, 503, 504)


@dataclass
class PushOutcome:
    """One weight push to one server (a plain dataclass: it travels back from the worker ranks through Ray)."""

    url: str
    version: int
    ok: bool
    seconds: float = 0.0  # begin to committed
    bytes: int = 0  # tensor bytes sent
    num_buckets: int = 0
    num_tensors: int = 0
    commit_seconds: float = 0.0  # the server's own time to apply the weights (its load into the engine)
    error: str | None = None
    retryable: bool = False  # the server did not answer (a retry after it is back may succeed)

    def sent(self, tensors: int, nbytes: int) -> None:
        """One more bucket of `tensors` tensors and `nbytes` tensor bytes reached the server."""
        self.num_buckets += 1
        self.num_tensors += tensors
        self.bytes += nbytes


def backoff_delays(first: float = 0.5, factor: float = 2.0, cap: float = 10.0):
    """0.5, 1, 2, 4, 8, 10, 10, ... seconds."""
    delay = first
    while True:
        yield delay
        delay = min(delay * factor, cap)


class RolloutClient:
    """One rollout server. `timeout`: seconds a single request may take to answer (generation and commits included);
    also the default deadline of `wait_ready`."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
        transport: Any = None,  # an httpx transport (tests: httpx.MockTransport)
    ):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout server URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.max_body_bytes: int | None = None  # the server's request body limit, learnt at `begin`
        headers = {p.AUTH_HEADER: p.BEARER + token} if token else {}
        # trust_env=False: an HTTP(S)_PROXY meant for the internet must not capture the cluster-internal servers.
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(self.timeout, connect=min(connect_timeout, self.timeout)),
            trust_env=False,
            # TCP_NODELAY: a request's headers and body go out at once instead of the body waiting on Nagle.
            transport=transport or httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RolloutClient({self.url!r})"

    # ---------------------------------------------------------------------------------------------- transport
    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        """The decoded JSON answer; a RolloutServerError naming the URL otherwise."""
        import httpx

        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:  # connect / read / write errors and timeouts
            raise ServerUnreachable(self.url, f"{what}: no answer from {self.url} ({type(e).__name__}: {e})") from e
        try:
            body = json.loads(r.content) if r.content else {}
        except ValueError:
            body = {"message": r.text[:200]}
        if r.status_code >= 400:
            if not isinstance(body, dict):
                body = {"message": str(body)[:200]}
            err = p.ServerError.from_json(r.status_code, body)
            cls = RolloutServerError
            if err.code == p.E_VERSION_MISMATCH:
                cls = VersionMismatch
            elif r.status_code in _RETRYABLE_STATUS:
                cls = ServerUnreachable
            hint = ""
            if r.status_code == 401:
                hint = " (the trainer's token does not match the server's --token-file)"
            raise cls(
                self.url,
                f"{what}: {self.url} answered {r.status_code} {err.code}: {err.message}{hint}",
                r.status_code,
                err.code,
                **err.extra,
            )
        return body

    def _post(self, path: str, obj: Any, what: str, **kwargs: Any) -> Any:
        return self._request(
            "POST", path, what, content=p.dumps(obj), headers={"content-type": "application/json"}, **kwargs
        )

    # ---------------------------------------------------------------------------------------------- endpoints
    def health(self) -> p.Health:
        body = self._request("GET", p.HEALTH, "health check")
        try:
            return p.Health.from_json(body)
        except TypeError as e:
            raise RolloutServerError(self.url, f"health check: {self.url} is not a mindrl rollout server: {e}") from e

    def wait_ready(
        self, timeout: float | None = None, sleep: Callable[[float], None] = time.sleep, what: str = "waiting"
    ) -> p.Health:
        """/health, retried with backoff while the server does not answer, for at most `timeout` seconds (default:
        the client's). ServerUnreachable naming the URL and the last error once the time is up."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delays = backoff_delays()
        warned = False
        while True:
            try:
                return self.health()
            except ServerUnreachable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerUnreachable(
                        self.url,
                        f"rollout server {self.url} did not answer within {timeout:.0f} s ({what}); last error: {e}",
                    ) from e
                if not warned:
                    logger.warning("rollout server %s does not answer (%s); retrying for %.0f s", self.url, e, left)
                    warned = True
                sleep(min(next(delays), left))

    def check_token(self) -> None:
        """An authenticated request that changes nothing (abort of a transfer that does not exist): a 401 here is a
        wrong or missing token, found before any training."""
        try:
            self._post(p.WEIGHTS_ABORT, {"transfer_id": "mindrl-token-check"}, "token check")
        except RolloutServerError as e:
            if e.status == 401 or e.status is None or e.status >= 500:
                raise
            # any other refusal of the request came after the token was accepted

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None = None,
        expected_version: int | None = None,
    ) -> p.GenerateResponse:
        """`sampling.n` samples per prompt, in prompt order. With `expected_version`, any other served version is a
        VersionMismatch (never a silent off-policy sample)."""
        req = p.GenerateRequest([list(x) for x in prompts], sampling, None if seeds is None else list(seeds))
        req.expected_version = expected_version
        body = self._post(p.GENERATE, req.to_json(), "generate")
        try:
            resp = p.GenerateResponse.from_json(body)
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutServerError(self.url, f"generate: {self.url} sent a malformed answer: {e!r}") from e
        if expected_version is not None and resp.version != expected_version:
            raise VersionMismatch(
                self.url,
                f"generate: {self.url} answered with weight version {resp.version}, expected {expected_version}",
                code=p.E_VERSION_MISMATCH,
                version=resp.version,
                expected=expected_version,
            )
        counts = [len(g) for g in resp.samples]
        if len(counts) != len(prompts) or any(c != sampling.n for c in counts):
            raise RolloutServerError(
                self.url,
                f"generate: {self.url} returned {len(counts)} prompts' samples ({sorted(set(counts))} each) for "
                f"{len(prompts)} prompts x n={sampling.n}",
            )
        return resp

    def begin(self, version: int) -> str:
        """Open a transfer; the answer also gives the server's body limit (`max_body_bytes`, None if not said)."""
        body = self._post(p.WEIGHTS_BEGIN, {"version": version}, f"weight update to version {version}")
        limit = body.get("max_body_bytes")
        self.max_body_bytes = limit if isinstance(limit, int) else None
        return str(body["transfer_id"])

    def send_bucket(self, transfer_id: str, index: int, data: bytes) -> None:
        self._request(
            "POST",
            p.WEIGHTS_BUCKET,
            f"weight bucket {index}",
            params={"transfer_id": transfer_id, "index": index},
            content=data,
            headers={"content-type": p.BUCKET_CONTENT_TYPE},
        )

    def commit(self, transfer_id: str, version: int, num_buckets: int, num_tensors: int) -> p.CommitResponse:
        req = p.CommitRequest(transfer_id, version, num_buckets, num_tensors)
        # Twice the client's timeout: the server may first wait up to one channel timeout (this client's) for a dist
        # bucket still in flight, and only then commits; the same wait here would give up just as the server answers.
        what = f"commit of weight version {version}"
        body = self._post(p.WEIGHTS_COMMIT, req.to_json(), what, timeout=2 * self.timeout)
        return p.CommitResponse(int(body["version"]), float(body.get("seconds", 0.0)), int(body.get("bytes", 0)))

    def open_channel(
        self, transfer_id: str, master_addr: str, master_port: int, backend: str, timeout_s: float
    ) -> None:
        """Ask the server to join transfer `transfer_id`'s dist channel (it starts joining, then answers)."""
        req = {"transfer_id": transfer_id, "master_addr": master_addr, "master_port": master_port,
               "backend": backend, "timeout_s": timeout_s}  # fmt: skip
        self._post(p.WEIGHTS_DIST_OPEN, req, "opening the weight channel")

    def announce_bucket(self, transfer_id: str, index: int, meta: list) -> None:
        """Dist channel: bucket `index`'s names, dtypes and shapes (`channel.meta_to_json`); its bytes follow by
        broadcast."""
        req = {"transfer_id": transfer_id, "index": index, "tensors": meta}
        self._post(p.WEIGHTS_DIST_BUCKET, req, f"weight bucket {index}")

    def channel_sender(self, transfer_id: str):
        """The trainer's end of a dist channel to this server (`channel.ChannelSender`), joined; its collectives and
        the server's wait at most this client's timeout."""
        from urllib.parse import urlsplit

        from mindrl.serving.channel import ChannelSender

        u = urlsplit(self.url)
        return ChannelSender(
            u.hostname, u.port or 80, self.timeout, f"mindrl-{transfer_id}",
            lambda addr, port, backend: self.open_channel(transfer_id, addr, port, backend, self.timeout),
        )  # fmt: skip

    def abort(self, transfer_id: str) -> None:
        self._post(p.WEIGHTS_ABORT, {"transfer_id": transfer_id}, "abort of a weight update")

    def push_weights(
        self,
        version: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int = 512 << 20,
        transfer: str = "http",
    ) -> PushOutcome:
        """begin -> buckets of about `bucket_bytes` -> commit as `version`; raises on failure (after an abort)."""
        (out,) = push_to_servers([self], version, weights, bucket_bytes, transfer)
        if not out.ok:
            cls = ServerUnreachable if out.retryable else RolloutServerError
            raise cls(self.url, out.error or "weight push failed")
        return out


def _buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Consecutive {hf_name: tensor} groups of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in weights:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += n
    if bucket:
        yield bucket


def push_to_servers(
    clients: Sequence[RolloutClient],
    version: int,
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    transfer: str = "http",
) -> list[PushOutcome]:
    """Push one pass of `weights` to every client as `version`, each bucket serialized once: `transfer` "http" sends
    safetensors bodies, "dist" announces each bucket over HTTP and broadcasts its bytes over a process group per
    server (mindrl.serving.channel). A server that fails is dropped (its transfer aborted if it still answers) and
    the others go on; the iterator is always exhausted (it may be a collective stream that every rank must drain).
    One outcome per client, in order."""
    if transfer not in ("http", "dist"):
        raise ValueError(f"transfer must be 'http' or 'dist', got {transfer!r}")
    dist = transfer == "dist"
    t0 = time.perf_counter()
    state: dict[int, dict[str, Any]] = {}
    outcomes = [PushOutcome(c.url, version, ok=False) for c in clients]

    def fail(i: int, e: Exception) -> None:
        outcomes[i].error = str(e)
        outcomes[i].retryable = isinstance(e, ServerUnreachable)
        st = state.pop(i, {})
        if st.get("sender") is not None:
            st["sender"].close()
        tid = st.get("tid")
        if tid is not None and not outcomes[i].retryable:
            try:
                clients[i].abort(tid)
            except RolloutServerError:
                pass

    for i, c in enumerate(clients):
        try:
            state[i] = {"tid": c.begin(version)}
            if dist:
                state[i]["sender"] = _joined(c, state[i]["tid"])
        except RolloutServerError as e:
            fail(i, e)
    index = 0
    for bucket in _buckets(weights, bucket_bytes):
        if not state:
            continue  # nobody left to send to: keep draining the stream
        nbytes = p.bucket_bytes(bucket)
        if dist:
            _send_dist(clients, state, index, bucket, fail, outcomes, nbytes)
            index += 1
            continue
        data = p.encode_bucket(bucket)
        for i in list(state):
            limit = clients[i].max_body_bytes
            if limit is not None and len(data) > limit:  # refused anyway: say why instead of a reset connection
                fail(
                    i,
                    RolloutServerError(
                        clients[i].url,
                        f"weight bucket {index} ({len(data)} bytes, {len(bucket)} tensors) exceeds {clients[i].url}'s "
                        f"request body limit of {limit} bytes: lower generate_config.bucket_size_mb "
                        f"(now {bucket_bytes / (1 << 20):g}) or restart the server with a larger --max-body-mb",
                        413,
                        p.E_TOO_LARGE,
                    ),
                )
                continue
            try:
                clients[i].send_bucket(state[i]["tid"], index, data)
            except RolloutServerError as e:
                fail(i, e)
                continue
            outcomes[i].sent(len(bucket), nbytes)
        index += 1
        del data, bucket
    for i in list(state):
        o = outcomes[i]
        try:
            o.commit_seconds = clients[i].commit(state[i]["tid"], version, o.num_buckets, o.num_tensors).seconds
        except RolloutServerError as e:
            fail(i, e)
            continue
        o.ok = True
        o.seconds = time.perf_counter() - t0
        if state[i].get("sender") is not None:
            state[i]["sender"].close()
    return outcomes


def _joined(client: RolloutClient, transfer_id: str):
    """The dist channel's sender, joined with the server; a failure to join is a ServerUnreachable."""
    try:
        return client.channel_sender(transfer_id)
    except RolloutServerError:
        raise
    except Exception as e:  # the store or the group: a timeout or a refused connection
        raise ServerUnreachable(client.url, f"weight channel to {client.url}: {type(e).__name__}: {e}") from e


def _send_dist(clients, state, index: int, bucket, fail, outcomes, nbytes: int) -> None:
    """One bucket over every open channel: announced over HTTP, then its bytes in one broadcast."""
    from mindrl.serving.channel import bucket_meta, meta_to_json, pack

    meta = meta_to_json(bucket_meta(bucket))
    flat = None
    for i in list(state):
        c, sender = clients[i], state[i]["sender"]
        try:
            c.announce_bucket(state[i]["tid"], index, meta)
            if flat is None:
                flat = pack(bucket, sender.device)
            try:
                sender.send(flat)
            except RuntimeError as e:  # the server died or timed out mid-broadcast
                raise ServerUnreachable(c.url, f"weight bucket {index}: channel to {c.url} failed: {e}") from e
        except RolloutServerError as e:
            fail(i, e)
            continue
        outcomes[i].sent(len(bucket), nbytes)


def samples_in_order(parts: Mapping[int, list[list[RolloutSample]]]) -> list[list[RolloutSample]]:
    """Concatenate per-part sample lists by part index (contiguous prompt slices back into prompt order)."""
    return [group for k in sorted(parts) for group in parts[k]]
