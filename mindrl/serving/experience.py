"""The asynchronous trainer's experience message: a schema'd record per sampled response, encoded as msgpack with
raw little-endian numpy buffers under a versioned header; decoding validates every field (never unpickles)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA = "mindrl.experience"
SCHEMA_VERSION = 1
"""Bumped on any incompatible change; a receiver rejects other versions with a MalformedMessage naming both."""

FINISH_REASONS = ("stop", "length", "abort")
GEN_SECONDS = "gen_s"
"""The `meta` key where a sampler puts the seconds it spent generating a group (the trainer's sampler_tps)."""
REF_SECONDS = "ref_s"
"""The `meta` key of the seconds a sampler spent on a group's reference logprobs (rl_config.async_sampler_ref)."""
RUN_ID = "run_id"
"""The `meta` key of the run id of the trainer whose weights sampled the experience (checked by the trainer's end)."""
ID_DTYPES = ("<i4", "<i8")
LOGPROB_DTYPES = ("<f4", "<f8")
DEFAULT_MAX_TOKENS = 1 << 22
"""Upper bound on a prompt's or response's length in a decoded message (a hostile length cannot allocate more)."""


class MalformedMessage(ValueError):
    """A message on a data or sync channel that does not decode or validate; `reason` says what is wrong.
    Receivers log it and drop the message: it never reaches the trainer."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Experience:
    """One sampled response with what the trainer needs to train on it off-policy."""

    prompt_ids: np.ndarray
    """(prompt_len,) int32/int64 token ids, unpadded."""
    response_ids: np.ndarray
    """(response_len,) int32/int64 token ids, unpadded."""
    behaviour_logprobs: np.ndarray
    """(response_len,) float32/float64: log p of each response token under the weights that sampled it."""
    rewards: dict[str, float]
    """Score per verifier name (e.g. {"acc": 1.0}). Empty from a sampler: the bounded trainer scores every response
    with its own verifiers and refuses a group that carries scores (`trainer/pipeline/intake.Intake`)."""
    finish_reason: str
    """One of FINISH_REASONS."""
    prompt_index: int
    """The prompt's index in the dataset (the prompt ledger's unit)."""
    epoch: int
    """The data epoch the prompt was issued in."""
    sampler_id: str
    weight_version: int
    """The version of the weights that produced the response (the staleness of the experience is measured in these)."""
    ref_logprobs: np.ndarray | None = None
    """(response_len,) float32/float64 under the reference model, when the sampler computes them."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form scalars (str/int/float/bool) a sampler may attach, e.g. its wall time; not used by training."""

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array(self.prompt_ids, ID_DTYPES, "prompt_ids", np.int32)
        self.response_ids = _as_array(self.response_ids, ID_DTYPES, "response_ids", np.int32)
        self.behaviour_logprobs = _as_array(self.behaviour_logprobs, LOGPROB_DTYPES, "behaviour_logprobs", np.float32)
        if self.ref_logprobs is not None:
            self.ref_logprobs = _as_array(self.ref_logprobs, LOGPROB_DTYPES, "ref_logprobs", np.float32)
        _validate(self)

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])


def _as_array(x: Any, allowed: tuple[str, ...], what: str, default: type) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor: its numpy view (CPU) keeps the dtype
        x = x.detach().cpu().numpy()
    a = np.asarray(x) if isinstance(x, np.ndarray) else np.asarray(x, dtype=default)
    if a.ndim != 1:
        raise MalformedMessage(f"{what} must be 1-D, got shape {a.shape}")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    if a.dtype.str not in allowed:
        raise MalformedMessage(f"{what} has dtype {a.dtype} (allowed: {', '.join(allowed)})")
    return np.ascontiguousarray(a)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _validate(e: Experience) -> None:
    n = e.response_len
    if e.behaviour_logprobs.shape[0] != n:
        raise MalformedMessage(
            f"behaviour_logprobs has {e.behaviour_logprobs.shape[0]} entries for {n} response tokens"
        )
    if e.ref_logprobs is not None and e.ref_logprobs.shape[0] != n:
        raise MalformedMessage(f"ref_logprobs has {e.ref_logprobs.shape[0]} entries for {n} response tokens")
    if e.prompt_ids.shape[0] == 0:
        raise MalformedMessage("prompt_ids is empty")
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(e, name)
        if ids.size and ids.min() < 0:
            raise MalformedMessage(f"{name} holds a negative token id ({int(ids.min())})")
    for name in ("behaviour_logprobs", "ref_logprobs"):
        lp = getattr(e, name)
        if lp is not None and lp.size and (np.isnan(lp).any() or (lp > 0).any()):
            raise MalformedMessage(f"{name} must be log-probabilities (<= 0, not NaN)")
    if not isinstance(e.rewards, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in e.rewards.items()
    ):
        raise MalformedMessage(f"rewards must map verifier names to finite numbers, got {_short(e.rewards)}")
    e.rewards = {k: float(v) for k, v in e.rewards.items()}
    if e.finish_reason not in FINISH_REASONS:
        raise MalformedMessage(f"finish_reason must be one of {FINISH_REASONS}, got {_short(e.finish_reason)}")
    for name in ("prompt_index", "epoch", "weight_version"):
        v = getattr(e, name)
        if not _is_int(v) or v < 0:
            raise MalformedMessage(f"{name} must be a non-negative integer, got {_short(v)}")
        setattr(e, name, int(v))
    if not isinstance(e.sampler_id, str) or not e.sampler_id:
        raise MalformedMessage(f"sampler_id must be a non-empty string, got {_short(e.sampler_id)}")
    if not isinstance(e.meta, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in e.meta.items()
    ):
        raise MalformedMessage(f"meta must map strings to scalars, got {_short(e.meta)}")


def _short(x: Any, limit: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# ---- encoding -------------------------------------------------------------------------------------------------

_ARRAYS = ("prompt_ids", "response_ids", "behaviour_logprobs", "ref_logprobs")
_SCALARS = ("rewards", "finish_reason", "prompt_index", "epoch", "sampler_id", "weight_version", "meta")
_FIELDS = frozenset(_ARRAYS + _SCALARS)


def _array_to_wire(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": a.dtype.str, "len": int(a.shape[0]), "data": a.tobytes()}


def encode(experiences: Sequence[Experience]) -> bytes:
    """One message holding `experiences` (typically the n responses of one prompt): msgpack of
    {schema, version, experiences: [{field: value | {dtype, len, data}}]}."""
    if not experiences:
        raise ValueError("encode needs at least one experience")
    records = []
    for e in experiences:
        r: dict[str, Any] = {k: getattr(e, k) for k in _SCALARS}
        for k in _ARRAYS:
            a = getattr(e, k)
            r[k] = None if a is None else _array_to_wire(a)
        records.append(r)
    return msgpack.packb({"schema": SCHEMA, "version": SCHEMA_VERSION, "experiences": records}, use_bin_type=True)


def _array_from_wire(d: Any, allowed: tuple[str, ...], what: str, max_tokens: int) -> np.ndarray:
    if not isinstance(d, dict) or set(d) != {"dtype", "len", "data"}:
        raise MalformedMessage(f"{what} must be {{dtype, len, data}}, got {_short(d)}")
    dtype, n, data = d["dtype"], d["len"], d["data"]
    if dtype not in allowed:
        raise MalformedMessage(f"{what}: dtype {_short(dtype)} not allowed (allowed: {', '.join(allowed)})")
    if not _is_int(n) or n < 0 or n > max_tokens:
        raise MalformedMessage(f"{what}: len must be an integer in [0, {max_tokens}], got {_short(n)}")
    if not isinstance(data, bytes) or len(data) != n * np.dtype(dtype).itemsize:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise MalformedMessage(f"{what}: {n} x {dtype} needs {n * np.dtype(dtype).itemsize} bytes, got {got}")
    return np.frombuffer(data, dtype=dtype).copy()


def decode(data: bytes, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Experience]:
    """The experiences in one message; MalformedMessage naming the problem (truncated, not msgpack, wrong schema
    or version, unknown/missing field, bad dtype or length, inconsistent lengths) otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"message must be bytes, got {type(data).__name__}")
    try:
        # msgpack never executes anything; ext types are refused, maps keep str keys only
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=_no_ext)
    except MalformedMessage:
        raise
    except msgpack.ExtraData:
        raise MalformedMessage("trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException) as e:
        kind = (
            "truncated" if "incomplete" in str(e).lower() or isinstance(e, msgpack.OutOfData) else "not valid msgpack"
        )
        raise MalformedMessage(f"message is {kind}: {e}") from None
    if not isinstance(msg, dict) or msg.get("schema") != SCHEMA:
        got = msg.get("schema") if isinstance(msg, dict) else type(msg).__name__
        raise MalformedMessage(f"not an experience message (schema {_short(got)}, expected {SCHEMA!r})")
    if msg.get("version") != SCHEMA_VERSION:
        raise MalformedMessage(
            f"schema version {_short(msg.get('version'))}; this build reads version {SCHEMA_VERSION}"
        )
    if set(msg) != {"schema", "version", "experiences"}:
        raise MalformedMessage(f"unexpected header fields {sorted(set(msg) - {'schema', 'version', 'experiences'})}")
    records = msg["experiences"]
    if not isinstance(records, list) or not records:
        raise MalformedMessage("experiences must be a non-empty list")
    out = []
    for i, r in enumerate(records):
        where = f"experiences[{i}]"
        if not isinstance(r, dict):
            raise MalformedMessage(f"{where} must be a map, got {_short(r)}")
        if set(r) != _FIELDS:
            missing, extra = sorted(_FIELDS - set(r)), sorted(set(r) - _FIELDS)
            raise MalformedMessage(f"{where}: missing fields {missing}, unknown fields {extra}")
        kw = {k: r[k] for k in _SCALARS}
        for k in _ARRAYS:
            if r[k] is None and k == "ref_logprobs":
                kw[k] = None
                continue
            allowed = ID_DTYPES if k.endswith("_ids") else LOGPROB_DTYPES
            kw[k] = _array_from_wire(r[k], allowed, f"{where}.{k}", max_tokens)
        try:
            out.append(Experience(**kw))
        except MalformedMessage as e:
            raise MalformedMessage(f"{where}: {e.reason}") from None
    return out


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not part of the schema")
