"""The rollout client's parsing, error mapping, backoff and bucketed pushes against an in-process fake transport
(httpx.MockTransport: no sockets, no engine); the real server is exercised by tests/trainer/test_remote_rollout.py."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from mindrl.rollout.base import SamplingConfig
from mindrl.serving import protocol as p
from mindrl.serving.client import (
    RolloutClient,
    RolloutServerError,
    ServerUnreachable,
    VersionMismatch,
    push_to_servers,
)

URL = "http://127.0.0.1:9"


class FakeServer:
    """Just enough of the protocol to check what the client sends and how it reads answers."""

    def __init__(self, token: str | None = None, version: int = 0):
        self.token = token
        self.version = version
        self.staged: dict[str, torch.Tensor] = {}
        self.buckets: list[int] = []
        self.requests: list[str] = []
        self.fail: dict[str, httpx.Response | Exception] = {}  # path -> canned answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append(path)
        if path in self.fail:
            f = self.fail[path]
            if isinstance(f, Exception):
                raise f
            return f
        if path != p.HEALTH and self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            return httpx.Response(401, json={"error": p.E_UNAUTHORIZED, "message": "missing or wrong token"})
        if path == p.HEALTH:
            return httpx.Response(200, json={"status": "ok", "version": self.version, "model": "m",
                                             "tensor_parallel_size": 1, "data_parallel_size": 1, "max_model_len": 64})  # fmt: skip
        if path == p.WEIGHTS_BEGIN:
            self.staged, self.buckets = {}, []
            return httpx.Response(200, json={"transfer_id": "t1"})
        if path == p.WEIGHTS_BUCKET:
            assert request.url.params["transfer_id"] == "t1"
            assert request.headers["content-type"] == p.BUCKET_CONTENT_TYPE
            self.buckets.append(int(request.url.params["index"]))
            self.staged.update(p.decode_bucket(request.content))
            return httpx.Response(200, json={})
        if path == p.WEIGHTS_COMMIT:
            d = json.loads(request.content)
            assert d == {"transfer_id": "t1", "version": d["version"], "num_buckets": len(self.buckets),
                         "num_tensors": len(self.staged)}  # fmt: skip
            self.version = d["version"]
            return httpx.Response(200, json={"version": self.version, "seconds": 0.01, "bytes": 1})
        if path == p.WEIGHTS_ABORT:
            return httpx.Response(200, json={"aborted": False})
        if path == p.GENERATE:
            req = p.GenerateRequest.from_json(json.loads(request.content))
            if req.expected_version is not None and req.expected_version != self.version:
                return httpx.Response(409, json={"error": p.E_VERSION_MISMATCH, "message": "other version",
                                                 "version": self.version, "expected": req.expected_version})  # fmt: skip
            samples = [[{"token_ids": [len(q), s], "logprobs": [-0.5, float("-inf")], "finish_reason": "length"}
                        for _ in range(req.sampling.n)] for q, s in zip(req.prompts, req.seeds or [0] * len(req.prompts))]  # fmt: skip
            return httpx.Response(200, content=p.dumps({"version": self.version, "samples": samples}))
        return httpx.Response(404, json={"error": "not_found", "message": path})


def client(server: FakeServer, token: str | None = None) -> RolloutClient:
    return RolloutClient(URL, token, timeout=5, transport=httpx.MockTransport(server))


def test_generate_parses_samples_and_checks_the_version():
    s = FakeServer(version=3)
    c = client(s)
    resp = c.generate([[1, 2, 3], [4]], SamplingConfig(n=2, max_tokens=2), seeds=[7, 8], expected_version=3)
    assert resp.version == 3
    assert [[x.token_ids for x in g] for g in resp.samples] == [[[3, 7]] * 2, [[1, 8]] * 2]
    assert resp.samples[0][0].logprobs[1] == float("-inf") and resp.samples[0][0].finish_reason == "length"
    with pytest.raises(VersionMismatch, match=rf"{URL} answered 409 version_mismatch") as e:
        c.generate([[1]], SamplingConfig(), expected_version=4)
    assert e.value.served == 3 and e.value.url == URL


def test_a_wrong_answer_count_is_an_error():
    s = FakeServer()
    s.fail[p.GENERATE] = httpx.Response(200, json={"version": 0, "samples": [[]]})
    with pytest.raises(RolloutServerError, match=rf"{URL} returned 1 prompts' samples"):
        client(s).generate([[1], [2]], SamplingConfig())
    s.fail[p.GENERATE] = httpx.Response(200, json={"version": 0})
    with pytest.raises(RolloutServerError, match="malformed answer"):
        client(s).generate([[1]], SamplingConfig())


def test_wrong_token_names_the_url_and_the_cause():
    s = FakeServer(token="right")
    assert client(s, "right").check_token() is None
    with pytest.raises(RolloutServerError, match=rf"token check: {URL} answered 401.*token does not match") as e:
        client(s, "wrong").check_token()
    assert e.value.status == 401 and not isinstance(e.value, ServerUnreachable)


def test_unreachable_and_unavailable_are_retryable():
    s = FakeServer()
    s.fail[p.HEALTH] = httpx.ConnectError("connection refused")
    with pytest.raises(ServerUnreachable, match=rf"no answer from {URL} \(ConnectError"):
        client(s).health()
    s.fail[p.GENERATE] = httpx.Response(503, json={"error": p.E_UNAVAILABLE, "message": "weights unknown"})
    with pytest.raises(ServerUnreachable, match="503 unavailable: weights unknown"):
        client(s).generate([[1]], SamplingConfig())
    s.fail[p.GENERATE] = httpx.Response(502, text="<html>bad gateway</html>")
    with pytest.raises(ServerUnreachable, match="502"):
        client(s).generate([[1]], SamplingConfig())


def test_wait_ready_backs_off_then_gives_up_naming_the_url():
    s = FakeServer(version=2)
    s.fail[p.HEALTH] = httpx.ConnectError("refused")
    slept: list[float] = []

    def sleep(x: float) -> None:
        slept.append(x)
        if len(slept) == 4:  # the server comes back
            del s.fail[p.HEALTH]

    assert client(s).wait_ready(60, sleep=sleep).version == 2
    assert slept == [0.5, 1.0, 2.0, 4.0]
    s.fail[p.HEALTH] = httpx.ConnectError("refused")
    with pytest.raises(ServerUnreachable, match=rf"rollout server {URL} did not answer within 0 s \(at start\)"):
        client(s).wait_ready(0.0, sleep=lambda x: None, what="at start")


def test_a_real_closed_port_is_unreachable():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ServerUnreachable, match=f"http://127.0.0.1:{port}"):
        RolloutClient(f"http://127.0.0.1:{port}", timeout=2).health()
    with pytest.raises(ValueError, match="must start with http"):
        RolloutClient("127.0.0.1:8000")


def _weights():
    base = torch.arange(40, dtype=torch.float32)
    # Views into one buffer, as the weight stream emits them (safetensors refuses shared storage as is).
    return [("a.weight", base[:10].view(2, 5)), ("b.weight", base[10:30]), ("c.bias", base[30:])]


def test_push_buckets_commit_and_a_failing_server_is_dropped():
    good, bad = FakeServer(), FakeServer()
    bad.fail[p.WEIGHTS_BUCKET] = httpx.Response(400, json={"error": p.E_BAD_REQUEST, "message": "unknown name"})
    drained = []

    def stream():
        for item in _weights():
            drained.append(item[0])
            yield item

    outs = push_to_servers([client(good), client(bad)], 5, stream(), bucket_bytes=120)  # a + b = 120 bytes, then c
    assert drained == ["a.weight", "b.weight", "c.bias"]  # the whole stream, whatever failed
    ok, failed = outs
    assert ok.ok and ok.version == 5 and (ok.num_buckets, ok.num_tensors, ok.bytes) == (2, 3, 160)
    assert good.buckets == [0, 1] and good.version == 5
    assert torch.equal(good.staged["a.weight"], torch.arange(10.0).view(2, 5))
    assert not failed.ok and not failed.retryable and "400 bad_request: unknown name" in failed.error
    assert bad.requests[-1] == p.WEIGHTS_ABORT and bad.version == 0  # aborted, never committed


def test_push_to_a_vanished_server_is_retryable_and_push_weights_raises():
    s = FakeServer()
    s.fail[p.WEIGHTS_BEGIN] = httpx.ConnectError("refused")
    (out,) = push_to_servers([client(s)], 1, iter(_weights()), 1 << 20)
    assert not out.ok and out.retryable and URL in out.error
    with pytest.raises(ServerUnreachable, match=URL):
        client(s).push_weights(1, iter(_weights()))
    del s.fail[p.WEIGHTS_BEGIN]
    assert client(s).push_weights(1, iter(_weights())).num_buckets == 1 and s.version == 1


def test_token_file_is_read_once_for_server_and_trainer(tmp_path):
    from mindrl.serving.protocol import read_token

    good, empty = tmp_path / "token", tmp_path / "empty"
    good.write_text("  s3cret\n")
    empty.write_text("\n")
    assert read_token(str(good)) == "s3cret"
    with pytest.raises(ValueError, match=f"{empty} is empty"):
        read_token(str(empty))
    with pytest.raises(ValueError, match="cannot read .*missing"):
        read_token(str(tmp_path / "missing"))
