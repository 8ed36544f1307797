"""The rollout server: one `VllmEngine` behind HTTP (FastAPI + uvicorn) with generation, atomic versioned weight updates
and an OpenAI-compatible `/v1/completions`; the wire format is `mindrl.serving.protocol`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import difflib
import hmac
import ipaddress
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from mindrl.config.settings import RolloutConfig, SamplingConfig
from mindrl.platform import current_platform
from mindrl.rollout.base import RolloutEngine, RolloutSample
from mindrl.serving import channel as C
from mindrl.serving import protocol as P
from mindrl.serving.protocol import ServerError, bad_request

LOG_PREFIX = "mindrl-rollout-server:"
DEFAULT_MAX_BODY_MB = 2048.0
"""Four times the trainer's default bucket (generate_config.bucket_size_mb 512): a bucket overshoots its size only
by one tensor, and a tensor larger than a bucket travels alone."""


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or "localhost"; any other name counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerConfig:
    """What `mindrl-rollout-server` serves and how; validated before any engine is built."""

    engine: RolloutConfig
    """The engine: `model` is the HF model dir the server starts from (version 0), loaded with load_format 'auto'.
    With data_parallel_size > 1, replica i samples with seed + i."""
    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs a token."""
    port: int = 8000
    """TCP port; 0 picks a free one (the ready line names it)."""
    token: str | None = None
    """Bearer token required on every request but /health (None: no auth, loopback only)."""
    data_parallel_size: int = 1
    """Engine replicas, one child process each."""
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    """Largest request body accepted (413 above it): bounds the host memory one request can take."""

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.infer_tensor_parallel_size

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"mindrl-rollout-server: {msg}")

        if not is_loopback(self.host) and not self.token:
            bad(
                f"--host {self.host} is not a loopback address and no token is set: anyone who can reach it "
                "could replace the weights. Pass --token-file FILE (clients send 'Authorization: Bearer <token>') "
                "or bind 127.0.0.1"
            )
        if self.token is not None and not self.token.strip():
            bad("the token is empty (check --token-file)")
        if not (0 <= self.port < 65536):
            bad(f"--port must be in [0, 65535], got {self.port}")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            bad(f"--data-parallel-size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.data_parallel_size > 1:
            bad("--tensor-parallel-size > 1 with --data-parallel-size > 1 is not supported yet: run one server per "
                "TP group and list them all in the trainer's server_urls")  # fmt: skip
        if not (isinstance(self.max_body_mb, (int, float)) and self.max_body_mb > 0):
            bad(f"--max-body-mb must be > 0, got {self.max_body_mb!r}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            bad(f"--model {self.model} has no config.json: pass an HF model directory")


@dataclass
class _Transfer:
    """A weight update being received: buckets staged in host memory until the commit."""

    id: str
    version: int
    buckets: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    bytes: int = 0
    pending: set[int] = field(default_factory=set)
    """Dist channel: the bucket indices announced (received or not yet)."""
    channel: Any = None
    """The dist channel's receiver (`channel.ChannelReceiver`) when the tensors come by broadcast, else None."""

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


@dataclass
class WeightSpec:
    """The model's HF weight names, their shapes, and the names a complete update must carry."""

    shapes: dict[str, tuple[int, ...]]
    required: set[str]

    @classmethod
    def of(cls, model_dir: str) -> WeightSpec:
        from transformers import AutoConfig, AutoModelForCausalLM

        from mindrl.rollout.vllm_engine import hf_weight_names  # the engine's own notion of names and ties

        hf_config = AutoConfig.from_pretrained(model_dir)
        names, required, _ = hf_weight_names(hf_config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        state = model.state_dict()
        shapes = {n: tuple(state[n].shape) for n in names if n in state}
        for n in names - state.keys():  # a tied name absent from the state dict: shaped like its source
            shapes[n] = tuple(state["model.embed_tokens.weight"].shape)
        return cls(shapes, required)

    def check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.shapes:
            close = difflib.get_close_matches(name, sorted(self.shapes), n=3)
            raise bad_request(f"weight {name!r} is not a weight of the model (close matches: {close})")
        if tuple(tensor.shape) != self.shapes[name]:
            raise bad_request(
                f"weight {name!r} has shape {list(tensor.shape)}, the model's is {list(self.shapes[name])}"
            )
        if not tensor.is_floating_point():
            raise bad_request(f"weight {name!r} has dtype {tensor.dtype}; weights must be floating point")


class RolloutServer:
    """The engine, its weight version and the HTTP app. Build it (loads the engine), then `serve`.

    Every engine call (creation, generate, load_weights, shutdown) runs on one dedicated thread, in arrival order:
    that single thread is the lock that keeps a generate from ever seeing half-applied weights, and keeps vLLM's
    in-process engine on the thread it was built on. Weight buckets are decoded and checked off that thread, so
    uploads overlap generation; they are staged in host memory and applied only by a commit whose counts match."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.version = 0
        self._broken: str | None = None  # set when a commit failed midway: weights unknown, refuse to serve
        self._transfer: _Transfer | None = None
        self._discarded: tuple[str, str] | None = (
            None  # (transfer id, why) of the last transfer a channel failure dropped
        )
        # The engine thread: every engine call, in order (see the class docstring).
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mindrl-engine")
        self.engine = None
        building = self._thread.submit(self._make_engine)
        try:
            self.engine = building.result()
        except BaseException:  # e.g. SIGTERM while loading: the build finishes on its thread, then shut it down
            self._thread.submit(_shutdown_if_built, building)
            self._thread.shutdown(wait=True)
            raise
        self.weights = WeightSpec.of(config.model)
        self.tokenizer = None
        if self.engine.has_tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.app = self._make_app()

    def engine_config(self, replica: int = 0) -> RolloutConfig:
        # replicas sample different streams for unseeded requests
        return dataclasses.replace(self.config.engine, seed=self.config.engine.seed + replica)

    def _make_engine(self):
        d, t = self.config.data_parallel_size, self.config.tensor_parallel_size
        if t > 1:  # one world of t ranks, each running the same engine steps (vLLM's external_launcher)
            return Replicas([self.engine_config()] * t, make_engine, tensor_parallel=True)
        if d == 1:
            return make_engine(self.engine_config())
        return Replicas([self.engine_config(i) for i in range(d)], make_engine)

    def close(self) -> None:
        """Shut the engine down (after any queued engine call); idempotent."""
        self._drop_transfer()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            self._thread.submit(engine.shutdown).result()
        self._thread.shutdown(wait=True)

    # ---- engine-thread jobs -----------------------------------------------------------------------------

    async def _on_engine(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _check_servable(self) -> None:
        if self._broken:
            raise ServerError(503, P.E_UNAVAILABLE, self._broken)

    def _generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None, expected: int | None
    ) -> tuple[int, list[list[RolloutSample]]]:
        self._check_servable()
        # Checked here, on the engine thread, so no commit can land between the check and the generation.
        if expected is not None and expected != self.version:
            raise ServerError(
                409,
                P.E_VERSION_MISMATCH,
                f"the server serves weight version {self.version}, the request expects {expected}",
                version=self.version,
                expected=expected,
            )
        # As vLLM's OpenAI server does (its offline engine caps instead): a request must fit max_model_len whole, so
        # a client gets its max_tokens or an error, never fewer tokens than it asked for without being told.
        limit = self.config.engine.max_model_len
        for i, p in enumerate(prompts):
            if len(p) + sampling.max_tokens > limit:
                raise bad_request(f"prompt {i} has {len(p)} tokens; with max_tokens={sampling.max_tokens} that is "
                                  f"{len(p) + sampling.max_tokens} > max_model_len={limit}")  # fmt: skip
        try:
            samples = self.engine.generate(prompts, sampling, seeds) if prompts else []
        except (ValueError, TypeError) as e:  # the engine's checks of prompts against the model
            raise bad_request(str(e)) from None
        return self.version, samples

    def _apply(self, t: _Transfer) -> dict[str, Any]:
        if t.version <= self.version:
            raise ServerError(409, P.E_CONFLICT, f"version {t.version} is not newer than the served {self.version}")
        start = time.perf_counter()

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for k in sorted(t.buckets):
                yield from t.buckets[k].items()

        try:
            self.engine.load_weights(stream())
        except Exception as e:
            # Checked complete before, so this is the engine failing: some layers may hold new weights.
            self._broken = (
                f"a weight commit (version {t.version}) failed while applying ({type(e).__name__}: {e}); the "
                f"weights are in an unknown state: push a complete update again"
            )
            raise ServerError(500, P.E_INTERNAL, self._broken) from None
        self.version = t.version
        self._broken = None
        return {"version": self.version, "seconds": time.perf_counter() - start, "bytes": t.bytes}

    # ---- HTTP -------------------------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        # FastAPI reads the handlers' annotations (Request, Response) from this module's globals.
        app = FastAPI(title="mindrl rollout server", docs_url=None, redoc_url=None, openapi_url=None)

        def reply(obj: Any, status: int = 200) -> Response:
            return Response(P.dumps(obj), status_code=status, media_type="application/json")

        @app.exception_handler(ServerError)
        async def server_error(request: Request, e: ServerError) -> Response:
            return reply(e.to_json(), e.status)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, e: Exception) -> Response:
            return reply({"error": P.E_INTERNAL, "message": f"{type(e).__name__}: {e}"}, 500)

        async def json_body(request: Request) -> Any:
            return P.loads(await self._read_body(request))

        @app.get(P.HEALTH)
        async def health() -> Response:
            c = self.config
            h = P.Health(
                status="ok" if not self._broken else "broken",
                version=self.version,
                model=c.model,
                tensor_parallel_size=c.tensor_parallel_size,
                data_parallel_size=c.data_parallel_size,
                max_model_len=c.engine.max_model_len,
                max_body_bytes=c.max_body_bytes,
            )
            return reply(h.__dict__)

        @app.post(P.GENERATE)
        async def generate(request: Request) -> Response:
            self._auth(request)
            req = P.GenerateRequest.from_json(await json_body(request))
            version, samples = await self._on_engine(
                self._generate, req.prompts, req.sampling, req.seeds, req.expected_version
            )
            return reply(P.GenerateResponse(version, samples).to_json())

        @app.post(P.WEIGHTS_BEGIN)
        async def begin(request: Request) -> Response:
            self._auth(request)
            d = await json_body(request)
            P._check_keys(d, {"version"}, "begin request", ("version",))
            version = d["version"]
            if not P._is_int(version):
                raise bad_request(f"version must be an integer, got {version!r}", 422)
            if version <= self.version:
                raise ServerError(
                    409, P.E_CONFLICT, f"version {version} is not newer than the served version {self.version}"
                )
            self._drop_transfer()
            self._transfer = _Transfer(secrets.token_hex(8), version)  # drops any unfinished transfer
            return reply({"transfer_id": self._transfer.id, "max_body_bytes": self.config.max_body_bytes})

        @app.post(P.WEIGHTS_BUCKET)
        async def bucket(request: Request) -> Response:
            self._auth(request)
            transfer_id = request.query_params.get("transfer_id")
            index = request.query_params.get("index")
            if transfer_id is None or index is None or not index.isdigit():
                raise bad_request(
                    f"{P.WEIGHTS_BUCKET} needs query parameters transfer_id=ID and index=K (K >= 0), got "
                    f"transfer_id={transfer_id!r} index={index!r}"
                )
            index = int(index)
            t = self._current(transfer_id)
            if t.channel is not None:
                raise ServerError(409, P.E_CONFLICT, f"transfer {transfer_id} receives its tensors by the dist channel")
            if index in t.buckets:
                raise ServerError(409, P.E_CONFLICT, f"bucket {index} of transfer {transfer_id} was already received")
            data = await self._read_body(request)
            tensors = await asyncio.to_thread(P.decode_bucket, data)
            for name, tensor in tensors.items():
                self.weights.check(name, tensor)
                if name in t.names:
                    raise bad_request(f"weight {name!r} was already sent in an earlier bucket of this transfer")
            t = self._current(transfer_id)  # a begin or abort may have replaced it while decoding
            t.buckets[index] = tensors
            t.names.update(tensors)
            t.bytes += P.bucket_bytes(tensors)
            return reply({"transfer_id": t.id, "index": index, "num_tensors": len(tensors)})

        @app.post(P.WEIGHTS_COMMIT)
        async def commit(request: Request) -> Response:
            self._auth(request)
            req = P.CommitRequest.from_json(await json_body(request))
            t = self._current(req.transfer_id)
            if t.channel is not None:  # every announced bucket received (each wait bounded by the channel timeout)
                failed = await asyncio.to_thread(t.channel.drain)
                if failed:
                    self._channel_failed(t.id, failed)
                    raise ServerError(
                        409, P.E_CONFLICT, f"commit of transfer {t.id} refused, nothing applied: {failed}"
                    )
            problems = []
            if req.version != t.version:
                problems.append(f"version {req.version} != {t.version} given at begin")
            if sorted(t.buckets) != list(range(req.num_buckets)):
                problems.append(f"expected buckets 0..{req.num_buckets - 1}, received {sorted(t.buckets)}")
            if req.num_tensors != len(t.names):
                problems.append(f"expected {req.num_tensors} tensors, received {len(t.names)}")
            missing = self.weights.required - t.names
            if not problems and missing:
                problems.append(f"the update lacks {len(missing)} of the model's weights, e.g. {sorted(missing)[:3]}")
            if problems:  # the transfer stays staged: missing buckets may still arrive
                raise ServerError(
                    409, P.E_CONFLICT, f"commit of transfer {t.id} refused, nothing applied: " + "; ".join(problems)
                )
            self._drop_transfer()
            return reply(await self._on_engine(self._apply, t))

        @app.post(P.WEIGHTS_ABORT)
        async def abort(request: Request) -> Response:
            self._auth(request)
            d = await json_body(request)
            P._check_keys(d, {"transfer_id"}, "abort request", ("transfer_id",))
            aborted = self._transfer is not None and self._transfer.id == d["transfer_id"]
            if aborted:
                self._drop_transfer()
            return reply({"aborted": aborted})

        @app.post(P.WEIGHTS_DIST_OPEN)
        async def dist_open(request: Request) -> Response:
            self._auth(request)
            d = await json_body(request)
            keys = ("transfer_id", "master_addr", "master_port", "backend", "timeout_s")
            P._check_keys(d, set(keys), "channel open request", keys)
            t = self._current(d["transfer_id"])
            addr, port, timeout_s = d["master_addr"], d["master_port"], d["timeout_s"]
            if not isinstance(addr, str) or not addr:
                raise bad_request(f"master_addr must be a host address, got {addr!r}", 422)
            if not P._is_int(port) or not 0 < port < 65536:
                raise bad_request(f"master_port must be in [1, 65535], got {port!r}", 422)
            if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= C.MAX_TIMEOUT_S:
                raise bad_request(f"timeout_s must be in (0, {C.MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}", 422)
            backend = current_platform().dist_backend
            if d["backend"] != backend:
                raise ServerError(
                    409,
                    P.E_CONFLICT,
                    f"the trainer's channel backend {d['backend']!r} is not this server's {backend!r} (another "
                    "platform): set generate_config.weight_transfer: http",
                )
            if t.channel is not None or t.buckets:
                raise ServerError(409, P.E_CONFLICT, f"transfer {t.id} already has a channel or HTTP buckets")
            loop = asyncio.get_running_loop()
            t.channel = C.ChannelReceiver(
                addr, port, float(timeout_s), f"mindrl-{t.id}",
                on_error=lambda why: loop.call_soon_threadsafe(self._channel_failed, t.id, why),
            )  # fmt: skip
            return reply({"transfer_id": t.id, "backend": backend})

        @app.post(P.WEIGHTS_DIST_BUCKET)
        async def dist_bucket(request: Request) -> Response:
            self._auth(request)
            d = await json_body(request)
            P._check_keys(d, {"transfer_id", "index", "tensors"}, "dist bucket", ("transfer_id", "index", "tensors"))
            t = self._current(d["transfer_id"])
            if t.channel is None:
                raise ServerError(
                    409, P.E_CONFLICT, f"transfer {t.id} has no channel: POST {P.WEIGHTS_DIST_OPEN} first"
                )
            index = d["index"]
            if not P._is_int(index) or index < 0:
                raise bad_request(f"index must be a non-negative integer, got {index!r}", 422)
            if index in t.pending:
                raise ServerError(409, P.E_CONFLICT, f"bucket {index} of transfer {t.id} was already announced")
            meta = C.meta_from_json(d["tensors"])
            names = [m.name for m in meta]
            for m in meta:
                self.weights.check(m.name, torch.empty(m.shape, dtype=C.DTYPES[m.dtype], device="meta"))
                if m.name in t.names or names.count(m.name) > 1:
                    raise bad_request(f"weight {m.name!r} was already sent in this transfer")
            t.pending.add(index)
            t.names.update(names)

            def received(tensors: dict[str, torch.Tensor]) -> None:  # on the channel's thread
                t.buckets[index] = tensors
                t.bytes += P.bucket_bytes(tensors)

            t.channel.receive(index, meta, received)
            return reply({"transfer_id": t.id, "index": index, "num_tensors": len(meta)})

        @app.post(P.COMPLETIONS)
        async def completions(request: Request) -> Response:
            self._auth(request)
            prompt, sampling, name = self._completion_request(await json_body(request))
            version, samples = await self._on_engine(self._generate, [prompt], sampling, None, None)
            return reply(self._completion_response(name, prompt, samples[0], version, sampling.logprobs))

        return app

    def _auth(self, request) -> None:
        token = self.config.token
        if token is None:
            return
        got = request.headers.get(P.AUTH_HEADER, "")
        if not got.startswith(P.BEARER) or not hmac.compare_digest(got[len(P.BEARER) :].encode(), token.encode()):
            raise ServerError(
                401,
                P.E_UNAUTHORIZED,
                "missing or wrong token: send 'Authorization: Bearer <token>' with the server's token",
            )

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 once it exceeds --max-body-mb: a declared Content-Length before reading
        anything, a chunked body as soon as the running total passes the limit (never buffered whole)."""
        limit = self.config.max_body_bytes

        def too_large(size: str) -> ServerError:
            return ServerError(
                413,
                P.E_TOO_LARGE,
                f"request body of {size} exceeds the server's limit of {limit} bytes ({self.config.max_body_mb:g} MiB, "
                "--max-body-mb): send smaller weight buckets (generate_config.bucket_size_mb) or fewer prompts per "
                "request, or restart the server with a larger --max-body-mb",
                limit=limit,
            )

        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _drop_transfer(self) -> None:
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None

    def _channel_failed(self, transfer_id: str, why: str) -> None:
        """A dist channel failed (the sender died or timed out): its transfer is discarded, the served version stays."""
        if self._transfer is not None and self._transfer.id == transfer_id:
            version = self._transfer.version
            self._drop_transfer()
            self._discarded = (transfer_id, why)
            print(f"{LOG_PREFIX} weight transfer {transfer_id} (version {version}) discarded: {why}", flush=True)

    def _current(self, transfer_id: str) -> _Transfer:
        t = self._transfer
        if self._discarded is not None and self._discarded[0] == transfer_id:
            raise ServerError(409, P.E_CONFLICT, f"transfer {transfer_id} was discarded: {self._discarded[1]}")
        if t is None or t.id != transfer_id:
            now = f"the open transfer is {t.id}" if t else "no transfer is open"
            raise ServerError(
                409, P.E_CONFLICT, f"unknown transfer {transfer_id!r} ({now}; a new begin discards the old one)"
            )
        return t

    # ---- /v1/completions --------------------------------------------------------------------------------

    COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "stream"}

    def _completion_request(self, d: Any) -> tuple[list[int], SamplingConfig, str]:
        P._check_keys(d, self.COMPLETION_FIELDS, "completion request", ("prompt",))
        name = self.config.model
        if d.get("model") not in (None, name, name.rstrip("/").rsplit("/", 1)[-1]):
            raise ServerError(
                404, P.E_BAD_REQUEST, f"model {d['model']!r} is not served here; this server serves {name!r}"
            )
        if d.get("stream"):
            raise bad_request("stream=true is not supported")
        prompt = d["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_request(f"a text prompt needs a tokenizer; {name} has none: send token ids")
            prompt = self.tokenizer.encode(prompt)
        else:
            prompt = P._int_list(prompt, "prompt (a string or a list of token ids)")
        logprobs = d.get("logprobs")
        if logprobs is not None and (not P._is_int(logprobs) or logprobs < 0):
            raise bad_request(f"logprobs must be a non-negative integer or null, got {logprobs!r}", 422)
        fields = {k: d[k] for k in ("temperature", "top_p", "n", "seed") if d.get(k) is not None}
        fields["max_tokens"] = d.get("max_tokens", 16)  # OpenAI's default
        fields["logprobs"] = logprobs or 0
        fields["detokenize"] = self.tokenizer is not None
        return prompt, P.sampling_from_json(fields, "completion request"), name

    def _completion_response(
        self, name: str, prompt: list[int], samples: list[RolloutSample], version: int, logprobs: int
    ) -> dict[str, Any]:
        def piece(t: int) -> str:
            return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

        choices = []
        for i, s in enumerate(samples):
            lp = {
                "tokens": [piece(t) for t in s.token_ids],
                "token_logprobs": [P.finite_or_none(x) for x in s.logprobs],
                "top_logprobs": (
                    [{piece(t): P.finite_or_none(x) for t, x in pos.items()} for pos in s.top_logprobs]
                    if s.top_logprobs is not None
                    else None
                ),
            }
            choices.append(
                {
                    "index": i,
                    "text": s.text,
                    "token_ids": s.token_ids,
                    "logprobs": lp if logprobs else None,
                    "finish_reason": s.finish_reason,
                }
            )
        completion = sum(len(s.token_ids) for s in samples)
        return {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
            "mindrl_version": version,
        }

    # ---- serving ----------------------------------------------------------------------------------------

    async def serve(self, sock: socket.socket) -> None:
        """Serve HTTP on a bound socket until SIGTERM/SIGINT (uvicorn's graceful shutdown)."""
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=30, lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(
                f"{LOG_PREFIX} serving {self.config.model} on http://{shown}:{port} (version {self.version})",
                flush=True,
            )
        await task


def make_engine(config: RolloutConfig) -> RolloutEngine:
    from mindrl.rollout.vllm_engine import VllmEngine

    return VllmEngine(config)


class Replicas(RolloutEngine):
    """Engines in child processes (vLLM keeps one engine per process), called from the server's engine thread only,
    so they always hold one version. `data_parallel_size` replicas: a prompt batch is split into contiguous chunks,
    one per replica, and reassembled in prompt order. `tensor_parallel=True`: the processes are the ranks of one
    torch.distributed world (the platform's backend, on loopback) sharing one TP engine; each gets the whole batch
    (vLLM's external_launcher runs the same steps on every rank) and rank 0's samples are the answer. A weight update
    goes to every process (each rank takes the full HF tensors; vLLM shards them)."""

    def __init__(
        self,
        configs: list[RolloutConfig],
        factory: Callable[[RolloutConfig], RolloutEngine],
        tensor_parallel: bool = False,
    ):
        import functools
        import multiprocessing as mp

        super().__init__(configs[0])
        self.tensor_parallel = tensor_parallel
        ctx = mp.get_context("spawn")  # no fork of a process that already runs threads
        self.conns, self.procs = [], []
        port = _free_port() if tensor_parallel else 0
        try:
            for i, config in enumerate(configs):
                parent, child = ctx.Pipe()
                make = (
                    functools.partial(_tp_rank_engine, factory, i, len(configs), port) if tensor_parallel else factory
                )
                proc = ctx.Process(target=_replica_main, args=(child, config, make), name=f"replica-{i}", daemon=True)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            infos = self._gather(range(len(configs)), "start")
        except BaseException:
            self.shutdown()
            raise
        self.has_tokenizer = infos[0]["has_tokenizer"]
        self.vocab_size = infos[0]["vocab_size"]

    def _gather(self, which, what: str) -> list:
        out = []
        for i in which:
            try:
                status, value = self.conns[i].recv()
            except (EOFError, OSError):
                raise RuntimeError(
                    f"engine replica {i} died during {what} (exit code {self.procs[i].exitcode})"
                ) from None
            out.append((status, value))
        for status, value in out:  # every reply is read first, so the pipes stay in step
            if status == "error":
                kind, message = value
                raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return [value for _, value in out]

    def _generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None
    ) -> list[list[RolloutSample]]:
        # generate() checked the whole batch, so an error names the prompt's index in the request, not in a chunk.
        if self.tensor_parallel:
            for conn in self.conns:
                conn.send(("generate", (prompt_token_ids, sampling, seeds)))
            return self._gather(range(len(self.conns)), "generate")[0]
        n, d = len(prompt_token_ids), len(self.conns)
        bounds = [i * n // d for i in range(d + 1)]
        busy = [i for i in range(d) if bounds[i + 1] > bounds[i]]
        for i in busy:
            lo, hi = bounds[i], bounds[i + 1]
            self.conns[i].send(
                ("generate", (prompt_token_ids[lo:hi], sampling, None if seeds is None else seeds[lo:hi]))
            )
        return [s for chunk in self._gather(busy, "generate") for s in chunk]

    def load_weights(self, weights) -> None:
        tensors = list(weights)
        for conn in self.conns:
            conn.send(("load_weights", tensors))
        self._gather(range(len(self.conns)), "load_weights")

    def shutdown(self) -> None:
        """Stop every replica (each shuts its engine down); idempotent."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("shutdown", None))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []


def _replica_main(conn, config: RolloutConfig, factory: Callable[[RolloutConfig], RolloutEngine]) -> None:
    """A replica process: build the engine, then serve the parent's calls until shutdown or the pipe closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process handles Ctrl-C and shuts us down
    torch.set_num_threads(1)
    try:
        engine = factory(config)
        conn.send(("ok", {"has_tokenizer": engine.has_tokenizer, "vocab_size": engine.vocab_size}))
    except Exception as e:
        conn.send(("error", (type(e).__name__, f"{type(e).__name__}: {e}")))
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the server died: nothing left to serve
                return
            if method == "shutdown":
                return
            try:
                if method == "generate":
                    result = engine.generate(*args)
                else:
                    result = engine.load_weights(args)
                conn.send(("ok", result))
            except Exception as e:
                kind = "ValueError" if isinstance(e, (ValueError, TypeError)) else type(e).__name__
                conn.send(("error", (kind, str(e) if kind == "ValueError" else f"{type(e).__name__}: {e}")))
    finally:
        engine.shutdown()
        if torch.distributed.is_initialized():  # a TP rank's world (see _tp_rank_engine)
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_rank_engine(
    factory: Callable[[RolloutConfig], RolloutEngine], rank: int, world: int, port: int, config: RolloutConfig
) -> RolloutEngine:
    """In a TP rank's process: join the loopback world of the server's ranks, then build the engine (which joins
    that world through vLLM's external_launcher)."""
    from mindrl.launch import join_world
    from mindrl.platform import current_platform

    os.environ["LOCAL_RANK"] = str(current_platform().local_rank(rank))  # this replica's, not an inherited one
    join_world(rank, world, "127.0.0.1", port, megatron=False)
    return factory(config)


def _shutdown_if_built(building: concurrent.futures.Future) -> None:
    if building.exception() is None:
        building.result().shutdown()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (bound before the slow engine start, so a busy port fails at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without, a small answer waits for the client's delayed ACK (Nagle); the
    # cost is in docs/rollout_server.md.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{LOG_PREFIX} cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock
