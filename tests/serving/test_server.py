"""The rollout server end to end: one real server subprocess on loopback (tiny model A, with a token) serves
every check; a weight update pushes model B's tensors and is compared with an HF forward of B."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from mindrl.serving import protocol as P
from tests.serving.conftest import REPO, start_server

TOKEN = "test-token-0123"
MAX_BODY_MB = 4  # above the tiny model's whole weights (~2 MiB), so only the body-limit test hits it


@pytest.fixture(scope="module")
def server(serving_models):
    handle = start_server(serving_models["a"], token=TOKEN, extra_args=("--max-body-mb", str(MAX_BODY_MB)))
    yield handle
    assert handle.stop() == 0, handle.output()[-3000:]
    assert "mindrl-rollout-server: stopped" in handle.output()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


def generate(client, prompts, expected_version=None, seeds=None, **sampling) -> P.GenerateResponse:
    req = P.GenerateRequest(prompts, P.SamplingConfig(**sampling), seeds, expected_version)
    r = client.post(P.GENERATE, content=P.dumps(req.to_json()))
    assert r.status_code == 200, r.text
    return P.GenerateResponse.from_json(r.json())


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] and body["message"], body
    return body


PROMPTS = [[5, 17, 300, 42], [7, 8], [100, 200, 300, 400, 500, 600]]


def test_help():
    out = subprocess.run(
        [sys.executable, "-m", "mindrl.cli.rollout_server", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "--token-file" in out.stdout and "--tensor-parallel-size" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host", "0.0.0.0"], "not a loopback address and no token"),
        (["--tensor-parallel-size", "2", "--data-parallel-size", "2"], "is not supported yet"),
        (["--data-parallel-size", "0"], "must be an integer >= 1"),
        (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
        (["--model", "/nonexistent/model"], "has no config.json"),
        (["--token-file", "/nonexistent/token"], "--token-file: cannot read"),
    ],
)
def test_refuses_to_start(args, message, serving_models):
    """Checked before any engine is built: fast, and the message says what to do."""
    cmd = [sys.executable, "-m", "mindrl.cli.rollout_server", "--model", serving_models["a"], *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_health(server):
    r = httpx.get(server.url + P.HEALTH)  # no token needed
    assert r.status_code == 200
    h = P.Health.from_json(r.json())
    assert h.status == "ok" and h.version >= 0 and h.model.endswith("a")
    assert (h.tensor_parallel_size, h.data_parallel_size, h.max_model_len) == (1, 1, 256)
    assert h.max_body_bytes == MAX_BODY_MB << 20


def test_body_limit(server, client):
    """A body over --max-body-mb is refused with 413 naming the limit: a declared Content-Length before a byte of
    it is read, a chunked body once its running total passes the limit; the client refuses such a bucket itself."""
    import socket
    from urllib.parse import urlsplit

    from mindrl.serving.client import RolloutClient, RolloutServerError

    limit = MAX_BODY_MB << 20
    u = urlsplit(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:  # headers only: the body never comes
        s.sendall(
            f"POST {P.GENERATE} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n".encode()
        )
        head = b""
        while b"--max-body-mb" not in head and (chunk := s.recv(65536)):  # until the message or the close
            head += chunk
        head = head.decode()
    assert head.startswith("HTTP/1.1 413") and f"limit of {limit} bytes" in head and "--max-body-mb" in head, head

    def chunks():
        for _ in range(MAX_BODY_MB * 4 + 1):
            yield b" " * (256 << 10)

    tid = client.post(P.WEIGHTS_BEGIN, json={"version": 10**6}).json()["transfer_id"]
    r = client.post(P.WEIGHTS_BUCKET, params={"transfer_id": tid, "index": 0}, content=chunks())
    body = error(r, 413)
    assert body["error"] == P.E_TOO_LARGE and body["limit"] == limit and "more than" in body["message"]
    assert client.post(P.WEIGHTS_ABORT, json={"transfer_id": tid}).json() == {"aborted": True}

    version = client.get(P.HEALTH).json()["version"]
    with RolloutClient(server.url, TOKEN, timeout=60) as c:
        big = torch.zeros(limit // 4 + 1)
        with pytest.raises(RolloutServerError, match="--max-body-mb") as e:
            c.push_weights(version + 1, iter([("model.norm.weight", big)]), bucket_bytes=1 << 20)
        assert "bucket_size_mb" in str(e.value)
    assert client.get(P.HEALTH).json()["version"] == version


def test_generate_shapes_and_seeded_determinism(client):
    sampling = dict(max_tokens=6, temperature=1.0, n=2, ignore_eos=True)
    out = generate(client, PROMPTS, seeds=[1, 2, 3], **sampling)
    assert len(out.samples) == len(PROMPTS) and all(len(ss) == 2 for ss in out.samples)
    for ss in out.samples:
        for s in ss:
            assert len(s.token_ids) == len(s.logprobs) == 6 and s.finish_reason == "length"
            assert all(lp <= 0 for lp in s.logprobs)
    again = generate(client, PROMPTS, seeds=[1, 2, 3], **sampling)
    assert again.samples == out.samples
    # Per-prompt seeds: a prompt's samples do not depend on its batch.
    alone = generate(client, PROMPTS[1:2], seeds=[2], **sampling)
    assert alone.samples[0] == out.samples[1]
    stopped = generate(client, [[1, 2]], max_tokens=8, temperature=0.0, stop_token_ids=list(range(1024)))
    assert stopped.samples[0][0].finish_reason == "stop" and len(stopped.samples[0][0].token_ids) == 1
    assert stopped.samples[0][0].stop_reason == stopped.samples[0][0].token_ids[0]


def test_version_mismatch(client):
    version = client.get(P.HEALTH).json()["version"]
    assert generate(client, [[1, 2]], expected_version=version, max_tokens=2).version == version
    r = client.post(P.GENERATE, json={"prompts": [[1, 2]], "expected_version": version + 7})
    body = error(r, 409)
    assert body["error"] == P.E_VERSION_MISMATCH and body["version"] == version and body["expected"] == version + 7


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for path, body in ((P.GENERATE, {"prompts": [[1]]}), (P.WEIGHTS_BEGIN, {"version": 99}), (P.COMPLETIONS, {})):
            body = error(httpx.post(server.url + path, json=body, headers=headers), 401)
            assert body["error"] == P.E_UNAUTHORIZED and "Bearer" in body["message"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompts": [[1, 2]], "sampling": {"temprature": 1.0}}', 422, "unknown field 'temprature'"),
        (b'{"prompts": [[1, 2]], "sampling": {"top_p": 1.5}}', 422, "top_p must be in (0, 1]"),
        (b'{"prompts": [[1, 2]], "sampling": {"temperature": "hot"}}', 422, "temperature must be a number"),
        (b'{"prompts": [[1, "x"]]}', 422, "prompts[0] must be a list of integers"),
        (b'{"prompts": [[1, 2]], "seeds": [1, 2]}', 422, "seeds has 2 entries for 1 prompts"),
        (b'{"prompt": [[1, 2]]}', 422, "unknown field 'prompt'"),
        (b'{"prompts": [[1, 5000]]}', 400, "outside the vocab"),
        (b'{"prompts": [[1, 2]], "sampling": {"max_tokens": 1000}}', 400, "max_model_len=256"),
    ],
)
def test_malformed_generate(client, body, status, message):
    assert message in error(client.post(P.GENERATE, content=body), status)["message"]


def test_completions(client, server):
    r = client.post(P.COMPLETIONS, json={"prompt": "1+1=", "max_tokens": 4, "n": 2, "seed": 3, "logprobs": 2})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and len(d["choices"]) == 2 and d["mindrl_version"] >= 0
    for c in d["choices"]:
        assert isinstance(c["text"], str) and len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) >= 1
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"])
    assert d["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in d["choices"])
    r = client.post(P.COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    assert (
        "not served here" in error(client.post(P.COMPLETIONS, json={"prompt": "x", "model": "gpt-4"}), 404)["message"]
    )


def _push(client, version: int, buckets: list[dict[str, torch.Tensor]]) -> tuple[httpx.Response, str]:
    r = client.post(P.WEIGHTS_BEGIN, json={"version": version})
    assert r.status_code == 200, r.text
    tid = r.json()["transfer_id"]
    for k, bucket in enumerate(buckets):
        r = client.post(
            P.WEIGHTS_BUCKET,
            params={"transfer_id": tid, "index": k},
            content=P.encode_bucket(bucket),
            headers={"Content-Type": P.BUCKET_CONTENT_TYPE},
        )
        assert r.status_code == 200, r.text
    n = sum(len(b) for b in buckets)
    return client.post(
        P.WEIGHTS_COMMIT, json={"transfer_id": tid, "version": version, "num_buckets": len(buckets), "num_tensors": n}
    ), tid


def test_weight_update(client, serving_models):
    """Half-sent and malformed updates change nothing; a complete one serves model B's weights as version V."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.rollout import helpers

    b_dir = serving_models["b"]
    weights_b = load_file(f"{b_dir}/model.safetensors")
    names = sorted(weights_b)
    buckets = [{n: weights_b[n] for n in names[i : i + 5]} for i in range(0, len(names), 5)]
    v0 = client.get(P.HEALTH).json()["version"]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = generate(client, PROMPTS, **greedy)

    # Half-sent: begin + one bucket, no commit. Still version v0 and its outputs; a commit with counts that
    # do not match what arrived is refused.
    r = client.post(P.WEIGHTS_BEGIN, json={"version": v0 + 1})
    tid = r.json()["transfer_id"]
    r = client.post(P.WEIGHTS_BUCKET, params={"transfer_id": tid, "index": 0}, content=P.encode_bucket(buckets[0]))
    assert r.status_code == 200, r.text
    assert generate(client, PROMPTS, expected_version=v0, **greedy).samples == before.samples
    commit = {"transfer_id": tid, "version": v0 + 1, "num_buckets": len(buckets), "num_tensors": len(names)}
    assert "nothing applied" in error(client.post(P.WEIGHTS_COMMIT, json=commit), 409)["message"]
    one = {"transfer_id": tid, "version": v0 + 1, "num_buckets": 1, "num_tensors": len(buckets[0])}
    assert "lacks" in error(client.post(P.WEIGHTS_COMMIT, json=one), 409)["message"]  # counts fine, model incomplete
    # Bad buckets: an unknown name (with close matches), a wrong shape, a duplicate index, garbage bytes.
    name = names[0]
    bad = [
        ({name + "x": weights_b[name]}, 400, "close matches"),
        ({name: weights_b[name][:1]}, 400, "shape"),
    ]
    for k, (tensors, status, message) in enumerate(bad, start=1):
        r = client.post(P.WEIGHTS_BUCKET, params={"transfer_id": tid, "index": k}, content=P.encode_bucket(tensors))
        assert message in error(r, status)["message"]
    r = client.post(P.WEIGHTS_BUCKET, params={"transfer_id": tid, "index": 0}, content=P.encode_bucket(buckets[0]))
    assert "already received" in error(r, 409)["message"]
    r = client.post(P.WEIGHTS_BUCKET, params={"transfer_id": tid, "index": 9}, content=b"\x00" * 64)
    assert "not valid safetensors" in error(r, 400)["message"]
    assert client.post(P.WEIGHTS_ABORT, json={"transfer_id": tid}).json() == {"aborted": True}
    assert "unknown transfer" in error(client.post(P.WEIGHTS_COMMIT, json=one), 409)["message"]
    assert "not newer" in error(client.post(P.WEIGHTS_BEGIN, json={"version": v0}), 409)["message"]
    assert generate(client, PROMPTS, expected_version=v0, **greedy).samples == before.samples

    # The complete update (a new begin also discards a stale unfinished transfer).
    client.post(P.WEIGHTS_BEGIN, json={"version": v0 + 1})
    r, _ = _push(client, v0 + 1, buckets)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["version"] == v0 + 1 and d["bytes"] == sum(t.numel() * 4 for t in weights_b.values()) and d["seconds"] > 0
    assert client.get(P.HEALTH).json()["version"] == v0 + 1
    assert error(client.post(P.GENERATE, json={"prompts": [[1]], "expected_version": v0}), 409)["version"] == v0 + 1
    after = generate(client, PROMPTS, expected_version=v0 + 1, **greedy)
    assert after.version == v0 + 1 and after.samples != before.samples
    model_b = AutoModelForCausalLM.from_pretrained(b_dir, dtype=torch.float32).eval()
    for prompt, ss in zip(PROMPTS, after.samples):
        assert ss[0].token_ids == helpers.hf_greedy(model_b, prompt, 8)
    sampling = P.SamplingConfig(**greedy)
    assert helpers.max_logprob_diff(model_b, PROMPTS, after.samples, sampling) < 1e-4


def test_bucket_encoding_of_views():
    """Tensors that are views into one buffer (as megatron's flat parameter buffers) encode as separate tensors."""
    flat = torch.arange(24, dtype=torch.float32)
    tensors = {"a": flat[:12].view(3, 4), "b": flat[12:].view(4, 3).t()}
    decoded = P.decode_bucket(P.encode_bucket(tensors))
    assert all(torch.equal(decoded[k], tensors[k]) for k in tensors)


def test_data_parallel(serving_models):
    """Two engine replicas: a batch is split across them and comes back in prompt order, with the samples
    each prompt gets alone (per-prompt seeds); a weight update reaches both."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.rollout import helpers

    handle = start_server(serving_models["a"], extra_args=("--data-parallel-size", "2"))
    try:
        with httpx.Client(base_url=handle.url, timeout=120) as c:
            assert c.get(P.HEALTH).json()["data_parallel_size"] == 2
            sampling = dict(max_tokens=5, temperature=1.0, n=2, ignore_eos=True)
            batch = generate(c, PROMPTS, seeds=[4, 5, 6], **sampling)
            for i, prompt in enumerate(PROMPTS):  # alone, every prompt runs on replica 0
                assert generate(c, [prompt], seeds=[4 + i], **sampling).samples[0] == batch.samples[i]
            body = error(c.post(P.GENERATE, json={"prompts": [[1], [1, 9999]]}), 400)  # checked before the split
            assert "prompt 1 has token id 9999 outside the vocab" in body["message"]
            b_dir = serving_models["b"]
            weights_b = load_file(f"{b_dir}/model.safetensors")
            r, _ = _push(c, 1, [weights_b])
            assert r.status_code == 200, r.text
            after = generate(c, PROMPTS, expected_version=1, max_tokens=6, temperature=0.0, ignore_eos=True)
            model_b = AutoModelForCausalLM.from_pretrained(b_dir, dtype=torch.float32).eval()
            assert [ss[0].token_ids for ss in after.samples] == [helpers.hf_greedy(model_b, p, 6) for p in PROMPTS]
    finally:
        assert handle.stop() == 0, handle.output()[-3000:]


DYING_SENDER = """
import os, sys, torch
from mindrl.serving.client import RolloutClient
from mindrl.serving.channel import bucket_meta, meta_to_json
url, token, version = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = RolloutClient(url, token, timeout=30)
tid = c.begin(version)
sender = c.channel_sender(tid)
bucket = {"model.norm.weight": torch.ones(128)}
c.announce_bucket(tid, 0, meta_to_json(bucket_meta(bucket)))
print(tid, flush=True)
os._exit(3)  # dies with the broadcast announced and never sent
"""


def test_dist_channel(server, client, serving_models):
    """Weights by the torch.distributed channel: a complete update commits and serves model A's greedy tokens; a
    sender that dies mid-transfer, and one that stops sending, make the server discard the staged version (after
    the channel timeout at most) and keep serving the old one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mindrl.serving.channel import bucket_meta, meta_to_json
    from mindrl.serving.client import RolloutClient, RolloutServerError
    from tests.rollout import helpers

    v = client.get(P.HEALTH).json()["version"]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = generate(client, PROMPTS, **greedy)

    # A sender process that dies after announcing a bucket: the server sees the peer gone and discards the transfer.
    out = subprocess.run([sys.executable, "-c", DYING_SENDER, server.url, TOKEN, str(v + 1)], capture_output=True,
                         text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 3, out.stderr
    tid = out.stdout.split()[-1]
    commit = {"transfer_id": tid, "version": v + 1, "num_buckets": 1, "num_tensors": 1}
    r = client.post(P.WEIGHTS_COMMIT, json=commit)
    assert "nothing applied" in error(r, 409)["message"] or "discarded" in r.json()["message"]
    discarded = f"weight transfer {tid} (version {v + 1}) discarded"
    assert discarded in server.wait_output(discarded)
    assert generate(client, PROMPTS, expected_version=v, **greedy).samples == before.samples

    # A sender that stays connected but never broadcasts: the receive times out (3 s) and the transfer is discarded.
    with RolloutClient(server.url, TOKEN, timeout=3) as c:
        tid = c.begin(v + 1)
        sender = c.channel_sender(tid)
        bucket = {"model.norm.weight": torch.ones(128)}
        c.announce_bucket(tid, 0, meta_to_json(bucket_meta(bucket)))
        with pytest.raises(RolloutServerError, match="discarded|nothing applied"):
            c.commit(tid, v + 1, 1, 1)
        sender.close()
    assert client.get(P.HEALTH).json()["version"] == v

    # Another platform's backend is refused, naming the way out; so is a channel for an unknown transfer.
    tid = client.post(P.WEIGHTS_BEGIN, json={"version": v + 1}).json()["transfer_id"]
    req = {"transfer_id": tid, "master_addr": "127.0.0.1", "master_port": 1, "backend": "nope", "timeout_s": 1}
    assert "weight_transfer: http" in error(client.post(P.WEIGHTS_DIST_OPEN, json=req), 409)["message"]
    r = client.post(P.WEIGHTS_DIST_BUCKET, json={"transfer_id": tid, "index": 0, "tensors": [["x", "float32", [1]]]})
    assert "has no channel" in error(r, 409)["message"]
    client.post(P.WEIGHTS_ABORT, json={"transfer_id": tid})

    # A complete update by the channel (model A's weights, in several buckets).
    weights_a = load_file(f"{serving_models['a']}/model.safetensors")
    with RolloutClient(server.url, TOKEN, timeout=60) as c:
        out = c.push_weights(v + 1, iter(sorted(weights_a.items())), bucket_bytes=256 << 10, transfer="dist")
    assert out.ok and out.num_buckets > 2 and out.bytes == sum(t.numel() * 4 for t in weights_a.values())
    after = generate(client, PROMPTS, expected_version=v + 1, **greedy)
    model_a = AutoModelForCausalLM.from_pretrained(serving_models["a"], dtype=torch.float32).eval()
    for prompt, ss in zip(PROMPTS, after.samples):
        assert ss[0].token_ids == helpers.hf_greedy(model_a, prompt, 8)


@pytest.mark.slow
def test_tensor_parallel(serving_models):
    """--tensor-parallel-size 2: one engine over a world of two ranks; greedy tokens equal HF's for model A, and
    after a push (by the dist channel) for model B."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mindrl.serving.client import RolloutClient
    from tests.rollout import helpers

    handle = start_server(serving_models["a"], extra_args=("--tensor-parallel-size", "2", "--dtype", "float32"))
    try:
        with httpx.Client(base_url=handle.url, timeout=120) as c:
            assert c.get(P.HEALTH).json()["tensor_parallel_size"] == 2
            greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
            for key, version in (("a", 0), ("b", 1)):
                if version:
                    weights = load_file(f"{serving_models[key]}/model.safetensors")
                    with RolloutClient(handle.url, timeout=60) as rc:
                        assert rc.push_weights(version, iter(weights.items()), transfer="dist").ok
                out = generate(c, PROMPTS, expected_version=version, **greedy)
                model = AutoModelForCausalLM.from_pretrained(serving_models[key], dtype=torch.float32).eval()
                assert [ss[0].token_ids for ss in out.samples] == [helpers.hf_greedy(model, p, 6) for p in PROMPTS]
                assert helpers.max_logprob_diff(model, PROMPTS, out.samples, P.SamplingConfig(**greedy)) < 1e-4
    finally:
        assert handle.stop() == 0, handle.output()[-3000:]
