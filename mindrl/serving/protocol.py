"""The rollout server's wire format, shared by the server and the client: paths, headers, JSON schemas, weight buckets
(safetensors bytes: no pickle, nothing executed) and the errors both sides raise. Endpoints: docs/rollout_server.md."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mindrl.rollout.base import RolloutSample, SamplingConfig

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of the wire format; /health reports it."""

HEALTH = "/health"
GENERATE = "/generate"
WEIGHTS_BEGIN = "/weights/begin"
WEIGHTS_BUCKET = "/weights/bucket"
WEIGHTS_COMMIT = "/weights/commit"
WEIGHTS_ABORT = "/weights/abort"
WEIGHTS_DIST_OPEN = "/weights/dist/open"
WEIGHTS_DIST_BUCKET = "/weights/dist/bucket"
COMPLETIONS = "/v1/completions"

AUTH_HEADER = "Authorization"
BEARER = "Bearer "
BUCKET_CONTENT_TYPE = "application/octet-stream"

# Error codes (the "error" field of an error body).
E_BAD_REQUEST = "bad_request"  # 400/422: malformed body, bad field, unknown weight name, bad shape
E_UNAUTHORIZED = "unauthorized"  # 401: token missing or wrong
E_VERSION_MISMATCH = "version_mismatch"  # 409 on /generate: the server serves another weight version
E_CONFLICT = "conflict"  # 409 on /weights/*: stale version, unknown transfer, count mismatch
E_TOO_LARGE = "too_large"  # 413: the request body exceeds the server's --max-body-mb
E_UNAVAILABLE = "unavailable"  # 503: the server cannot serve (a failed commit left the weights unknown)
E_INTERNAL = "internal"  # 500


class ServerError(Exception):
    """An error with its HTTP status and machine-readable code; the server turns it into
    `{"error": code, "message": message, **extra}`, the client raises it back from such a body."""

    def __init__(self, status: int, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.extra}

    @classmethod
    def from_json(cls, status: int, body: Mapping[str, Any]) -> ServerError:
        extra = {k: v for k, v in body.items() if k not in ("error", "message")}
        return cls(status, str(body.get("error", "unknown")), str(body.get("message", body)), **extra)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


def bad_request(message: str, status: int = 400) -> ServerError:
    return ServerError(status, E_BAD_REQUEST, message)


# ---- JSON encoding ----------------------------------------------------------------------------------------


def read_token(path: str) -> str:
    """The bearer token in `path` (stripped), for the server and the trainer alike; ValueError naming the file if it
    cannot be read or holds no token."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def dumps(obj: Any) -> bytes:
    """JSON bytes. NaN/±Infinity are written as Python's json does (a truncated top logprob may be -inf);
    both ends are Python, whose json reads them back."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()


def loads(data: bytes | str, what: str = "request body") -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"{what} is not valid JSON: {e}") from None


# ---- schemas ----------------------------------------------------------------------------------------------


@dataclass
class Health:
    status: str
    version: int
    model: str
    tensor_parallel_size: int
    data_parallel_size: int
    max_model_len: int
    protocol: int = PROTOCOL_VERSION
    max_body_bytes: int | None = None
    """The largest request body the server accepts (None: a server that does not say)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Health:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any, what: str) -> list[int]:
    if not isinstance(x, list) or not all(_is_int(t) for t in x):
        raise bad_request(f"{what} must be a list of integers, got {_short(x)}", 422)
    return x


def _short(x: Any, limit: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _check_keys(d: Any, allowed: set[str], what: str, required: tuple[str, ...] = ()) -> None:
    if not isinstance(d, dict):
        raise bad_request(f"{what} must be a JSON object, got {_short(d)}", 422)
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=3)
            raise bad_request(f"{what}: unknown field {key!r}" + (f" (close: {close})" if close else ""), 422)
    for key in required:
        if key not in d:
            raise bad_request(f"{what}: missing field {key!r}", 422)


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingConfig)}


def sampling_from_json(d: Any, what: str = "sampling") -> SamplingConfig:
    """A SamplingConfig from its JSON fields; unknown fields and SamplingConfig's own validation errors
    become 422s that name the field."""
    if d is None:
        return SamplingConfig()
    _check_keys(d, SAMPLING_FIELDS, what)
    for f in dataclasses.fields(SamplingConfig):  # name the field where SamplingConfig's math would say only "str"
        v = d.get(f.name)
        if (
            isinstance(f.default, float)
            and v is not None
            and not (isinstance(v, (int, float)) and not isinstance(v, bool))
        ):
            raise bad_request(f"{what}: {f.name} must be a number, got {_short(v)}", 422)
    try:
        return SamplingConfig(**d)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{what}: {e}", 422) from None


def sampling_to_json(s: SamplingConfig) -> dict[str, Any]:
    return dataclasses.asdict(s)


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    """Token ids per prompt (unpadded)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seeds: list[int] | None = None
    """One per prompt (overrides sampling.seed; see RolloutEngine.generate)."""
    expected_version: int | None = None
    """If set, the server answers 409 version_mismatch unless it serves exactly this weight version."""

    def to_json(self) -> dict[str, Any]:
        return {
            "prompts": [list(map(int, p)) for p in self.prompts],
            "seeds": None if self.seeds is None else [int(s) for s in self.seeds],
            "sampling": sampling_to_json(self.sampling),
            "expected_version": self.expected_version,
        }

    @classmethod
    def from_json(cls, d: Any) -> GenerateRequest:
        _check_keys(d, {"prompts", "seeds", "sampling", "expected_version"}, "generate request", ("prompts",))
        prompts = d["prompts"]
        if not isinstance(prompts, list):
            raise bad_request(f"prompts must be a list of token-id lists, got {_short(prompts)}", 422)
        prompts = [_int_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        seeds = d.get("seeds")
        if seeds is not None:
            seeds = _int_list(seeds, "seeds")
            if len(seeds) != len(prompts):
                raise bad_request(f"seeds has {len(seeds)} entries for {len(prompts)} prompts (one per prompt)", 422)
        version = d.get("expected_version")
        if version is not None and not _is_int(version):
            raise bad_request(f"expected_version must be an integer or null, got {_short(version)}", 422)
        return cls(prompts, sampling_from_json(d.get("sampling")), seeds, version)


def sample_to_json(s: RolloutSample) -> dict[str, Any]:
    d: dict[str, Any] = {"token_ids": s.token_ids, "logprobs": s.logprobs, "finish_reason": s.finish_reason}
    if s.stop_reason is not None:
        d["stop_reason"] = s.stop_reason
    if s.text is not None:
        d["text"] = s.text
    if s.top_logprobs is not None:  # JSON object keys are strings: token ids travel as decimal strings
        d["top_logprobs"] = [{str(t): lp for t, lp in pos.items()} for pos in s.top_logprobs]
    return d


def sample_from_json(d: Mapping[str, Any]) -> RolloutSample:
    top = d.get("top_logprobs")
    if top is not None:
        top = [{int(t): float(lp) for t, lp in pos.items()} for pos in top]
    return RolloutSample(
        token_ids=[int(t) for t in d["token_ids"]],
        logprobs=[float(x) for x in d["logprobs"]],
        finish_reason=d["finish_reason"],
        stop_reason=d.get("stop_reason"),
        text=d.get("text"),
        top_logprobs=top,
    )


@dataclass
class GenerateResponse:
    version: int
    samples: list[list[RolloutSample]]
    """Per prompt (prompt order), sampling.n samples."""

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "samples": [[sample_to_json(s) for s in ss] for ss in self.samples]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerateResponse:
        return cls(int(d["version"]), [[sample_from_json(s) for s in ss] for ss in d["samples"]])


@dataclass
class CommitRequest:
    transfer_id: str
    version: int
    num_buckets: int
    num_tensors: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> CommitRequest:
        names = ("transfer_id", "version", "num_buckets", "num_tensors")
        _check_keys(d, set(names), "commit request", names)
        if not isinstance(d["transfer_id"], str):
            raise bad_request(f"transfer_id must be a string, got {_short(d['transfer_id'])}", 422)
        for k in names[1:]:
            if not _is_int(d[k]) or d[k] < 0:
                raise bad_request(f"{k} must be a non-negative integer, got {_short(d[k])}", 422)
        return cls(**d)


@dataclass
class CommitResponse:
    version: int
    seconds: float
    bytes: int


# ---- weight buckets ---------------------------------------------------------------------------------------


def encode_bucket(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of {hf_name: tensor}. Tensors may live on any device, be non-contiguous or views
    into a larger buffer (safetensors refuses shared storage): each is copied to a compact host tensor."""
    from safetensors.torch import save

    flat = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
            t = t.clone()
        flat[name] = t
    return save(flat)


def decode_bucket(data: bytes) -> dict[str, torch.Tensor]:
    """{hf_name: tensor} from safetensors bytes (a parser of a data format: nothing executed). 400 if malformed."""
    from safetensors.torch import load

    if not data:
        raise bad_request("weight bucket body is empty (expected safetensors bytes)")
    try:
        return load(bytes(data))
    except Exception as e:  # safetensors raises its own error types for any malformed header or size
        raise bad_request(f"weight bucket is not valid safetensors data: {e}") from None


def bucket_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def finite_or_none(x: float) -> float | None:
    """OpenAI clients expect null, not -Infinity, for a logprob outside the kept set."""
    return x if math.isfinite(x) else None
