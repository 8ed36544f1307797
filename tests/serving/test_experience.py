"""The experience message: bit-exact round trips, and every malformed, truncated or wrong-version message
rejected with a MalformedMessage naming the reason (msgpack only: nothing is unpickled)."""

import pickle

import msgpack
import numpy as np
import pytest
import torch

from mindrl.serving.experience import SCHEMA_VERSION, Experience, MalformedMessage, decode, encode


def make(n=5, ref=True, ids_dtype=np.int32, lp_dtype=np.float32, seed=0, **kw):
    rng = np.random.default_rng(seed)
    fields = dict(
        prompt_ids=rng.integers(0, 150_000, size=4).astype(ids_dtype),
        response_ids=rng.integers(0, 150_000, size=n).astype(ids_dtype),
        behaviour_logprobs=-rng.random(n).astype(lp_dtype) * 10,
        ref_logprobs=(-rng.random(n).astype(lp_dtype) * 10) if ref else None,
        rewards={"acc": 1.0, "format": 0.25},
        finish_reason="length",
        prompt_index=17,
        epoch=2,
        sampler_id="sampler-1",
        weight_version=9,
        meta={"gen_s": 0.5},
    )
    fields.update(kw)
    return Experience(**fields)


def assert_same(a: Experience, b: Experience):
    for k in ("prompt_ids", "response_ids", "behaviour_logprobs", "ref_logprobs"):
        x, y = getattr(a, k), getattr(b, k)
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k  # bit-exact, NaN-free by validation
    for k in ("rewards", "finish_reason", "prompt_index", "epoch", "sampler_id", "weight_version", "meta"):
        assert getattr(a, k) == getattr(b, k), k


@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("lp_dtype", [np.float32, np.float64])
def test_round_trip_bit_exact(ids_dtype, lp_dtype):
    group = [make(n, ref=n % 2 == 0, ids_dtype=ids_dtype, lp_dtype=lp_dtype, seed=n) for n in (0, 1, 5, 300)]
    back = decode(encode(group))
    assert len(back) == len(group)
    for a, b in zip(group, back):
        assert_same(a, b)
    assert back[2].behaviour_logprobs.flags.writeable  # decoded arrays are owned copies


def test_torch_and_list_inputs():
    e = make(response_ids=torch.tensor([1, 2, 3]), behaviour_logprobs=[-0.5, -1.0, -2.0], ref=False)
    assert e.response_ids.dtype == np.int64 and e.behaviour_logprobs.dtype == np.float32
    assert_same(e, decode(encode([e]))[0])


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(behaviour_logprobs=[-1.0, -1.0]), "behaviour_logprobs has 2 entries for 5 response tokens"),
        (dict(ref_logprobs=np.zeros(4, np.float32)), "ref_logprobs has 4 entries for 5"),
        (dict(finish_reason="eos"), "finish_reason must be one of"),
        (dict(prompt_index=-1), "prompt_index must be a non-negative integer"),
        (dict(weight_version=1.5), "weight_version must be a non-negative integer"),
        (dict(sampler_id=""), "sampler_id must be a non-empty string"),
        (dict(rewards={"acc": float("nan")}), "rewards must map verifier names to finite numbers"),
        (dict(response_ids=np.arange(5, dtype=np.float32)), "response_ids has dtype float32"),
        (dict(behaviour_logprobs=np.full(5, 0.5, np.float32)), "behaviour_logprobs must be log-probabilities"),
        (dict(prompt_ids=[]), "prompt_ids is empty"),
    ],
)
def test_constructor_validates(kw, reason):
    with pytest.raises(MalformedMessage, match=reason):
        make(**kw)


def good_wire():
    return msgpack.unpackb(encode([make()]), raw=False)


def mutated(fn):
    msg = good_wire()
    fn(msg)
    return msgpack.packb(msg, use_bin_type=True)


def _set(path, value):
    def fn(msg):
        d = msg
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return fn


@pytest.mark.parametrize(
    "data, reason",
    [
        (mutated(_set(["version"], SCHEMA_VERSION + 1)), f"schema version {SCHEMA_VERSION + 1}; this build reads"),
        (mutated(_set(["schema"], "other")), "not an experience message"),
        (mutated(_set(["extra"], 1)), "unexpected header fields \\['extra'\\]"),
        (mutated(_set(["experiences"], [])), "experiences must be a non-empty list"),
        (mutated(lambda m: m["experiences"][0].pop("epoch")), "missing fields \\['epoch'\\]"),
        (mutated(_set(["experiences", 0, "bogus"], 1)), "unknown fields \\['bogus'\\]"),
        (mutated(_set(["experiences", 0, "response_ids", "dtype"], "|O")), "response_ids: dtype '\\|O' not allowed"),
        (mutated(_set(["experiences", 0, "response_ids", "len"], 6)), "response_ids: 6 x <i4 needs 24 bytes, got 20"),
        (mutated(_set(["experiences", 0, "response_ids", "len"], 1 << 40)), "response_ids: len must be an integer"),
        (mutated(_set(["experiences", 0, "behaviour_logprobs", "data"], b"\0" * 8)), "needs 20 bytes, got 8"),
        (
            mutated(
                lambda m: m["experiences"][0].update(behaviour_logprobs={"dtype": "<f4", "len": 3, "data": b"\0" * 12})
            ),
            "experiences\\[0\\]: behaviour_logprobs has 3 entries for 5 response tokens",
        ),
        (encode([make()]) + b"\x00", "trailing bytes"),
        (b"", "truncated"),
        (b"\xc1", "not valid msgpack|truncated"),
        (msgpack.packb([1, 2, 3]), "not an experience message"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "extension type 1"),
        (
            pickle.dumps({"schema": "mindrl.experience"}),
            "msgpack|experience message|trailing bytes",
        ),  # a pickle is just bytes that fail
    ],
)
def test_malformed_rejected_with_reason(data, reason):
    with pytest.raises(MalformedMessage, match=reason):
        decode(data)


def test_every_truncation_rejected():
    data = encode([make(n=7), make(n=3, seed=1)])
    for cut in range(len(data)):
        with pytest.raises(MalformedMessage):
            decode(data[:cut])
