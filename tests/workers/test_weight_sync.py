"""The actor-to-engines weight group (mindrl.workers.weight_sync): a stream sent as a version arrives bit-equal, bucket
by bucket, at every engine rank; another version than announced is refused. Ranks are threads of this process."""

from __future__ import annotations

import threading

import pytest
import torch

from mindrl.launch import free_port
from mindrl.workers.weight_sync import WeightSyncError, join


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=g).to(torch.float16),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(64, 16, generator=g),
    }


def _run(world: int, send_version: int, expected: int, bucket_bytes: int, timeout_s: float = 20.0):
    """Rank 0 sends `send_version`; ranks 1.. receive announced `expected`. Returns (each receiver's result or
    exception, the sender's (tensors, bytes) or exception)."""
    port = free_port()
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            group = join("127.0.0.1", port, r, world, timeout_s)
            if r == 0:
                out[r] = group.send(send_version, iter(_weights().items()), bucket_bytes)
            else:
                out[r] = {n: t.clone() for n, t in group.receive(expected)}
        except Exception as e:  # reported to the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [out.get(r) for r in range(1, world)], out.get(0)


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])  # a bucket per tensor; one bucket for all
def test_stream_arrives_bit_equal_at_every_engine(bucket_bytes):
    received, sent = _run(3, 7, 7, bucket_bytes)
    want = _weights()
    assert sent[0] == len(want)
    for got in received:
        assert list(got) == list(want)  # the stream's order
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_another_version_is_refused():
    received, sent = _run(2, 3, 4, 1 << 20, timeout_s=3.0)
    assert isinstance(received[0], WeightSyncError) and "version 3" in str(received[0])
    assert isinstance(sent, RuntimeError)  # the sender's broadcast times out (the driver kills both groups sooner)
