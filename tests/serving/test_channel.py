"""The dist weight channel's pieces in one process (no server): bucket packing, metadata checks, and a sender and
receiver on loopback gloo (each bucket arrives bit for bit; a sender that stops sending fails the receive by the
timeout, reported once)."""

from __future__ import annotations

import threading

import pytest
import torch

from mindrl.serving import channel as C
from mindrl.serving.protocol import ServerError


def _bucket() -> dict[str, torch.Tensor]:
    flat = torch.randn(40)
    return {"a": flat[:12].view(3, 4).t(), "b": torch.randn(5).to(torch.bfloat16), "c": torch.zeros(0, 2)}


def test_pack_unpack_roundtrip():
    bucket = _bucket()
    meta = C.bucket_meta(bucket)
    assert C.meta_from_json(C.meta_to_json(meta)) == meta
    out = C.unpack(meta, C.pack(bucket, torch.device("cpu")))
    assert out.keys() == bucket.keys() and all(out[k].dtype == bucket[k].dtype for k in out)
    assert all(torch.equal(out[k], bucket[k]) for k in out)
    with pytest.raises(ValueError, match="dist channel carries"):
        C.bucket_meta({"i": torch.ones(2, dtype=torch.int64)})


@pytest.mark.parametrize(
    "tensors, message",
    [([], "non-empty list"), ([["w", "int8", [2]]], "tensors[0] must be"), ([["w", "float32", [-1]]], "tensors[0]"),
     ([["w", "float32", [2]], "x"], "tensors[1] must be")],
)  # fmt: skip
def test_meta_is_checked(tensors, message):
    with pytest.raises(ServerError, match=message.replace("[", r"\[")) as e:
        C.meta_from_json(tensors)
    assert e.value.status == 422


def test_loopback_channel_and_timeout():
    torch.set_num_threads(1)
    errors: list[str] = []
    got: dict[int, dict] = {}
    box: dict = {}

    def open_(addr, port, backend):  # what the server's /weights/dist/open does
        box["rx"] = C.ChannelReceiver(addr, port, 2.0, "t1", errors.append)

    tx = C.ChannelSender("127.0.0.1", 9, 2.0, "t1", open_)
    rx = box["rx"]
    buckets = [_bucket(), {"z": torch.arange(6.0)}]
    for i, b in enumerate(buckets):
        rx.receive(i, C.bucket_meta(b), lambda t, i=i: got.__setitem__(i, t))
        tx.send(C.pack(b, tx.device))
    assert rx.drain() is None and not errors
    assert all(torch.equal(got[i][k], buckets[i][k]) for i in range(2) for k in buckets[i])

    # The sender announces a bucket and never sends it: the receive fails after the timeout, once.
    rx.receive(2, C.bucket_meta(buckets[1]), lambda t: got.__setitem__(2, t))
    rx.receive(3, C.bucket_meta(buckets[1]), lambda t: got.__setitem__(3, t))
    timer = threading.Timer(10, lambda: errors.append("drain hung"))
    timer.start()
    err = rx.drain()
    timer.cancel()
    assert err and "bucket 2" in err and errors == [err] and 2 not in got and 3 not in got
    tx.close()
    rx.close()
