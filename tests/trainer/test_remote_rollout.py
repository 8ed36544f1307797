"""Rollout-server mode. Fast: RemoteRollout's split, versions, waits and re-syncs over fake servers. Slow: tiny PPO and
GRPO runs against real mindrl-rollout-server processes on loopback (first iteration equal to integrated mode, a
server killed and restarted mid-run, a server that never comes back, a wrong token)."""

from __future__ import annotations

import json
import socket

import pytest

from mindrl.rollout.base import RolloutSample, SamplingConfig
from mindrl.serving import protocol as p
from mindrl.serving.client import PushOutcome, RolloutServerError, ServerUnreachable, VersionMismatch
from mindrl.trainer.pipeline.engines import RemoteRollout, RemoteRolloutError
from tests.trainer.rl_helpers import _config, _train, straight_run


class FakeClient:
    """A server in memory: `down` answers nothing, `restart()` comes back at version 0."""

    def __init__(self, url: str):
        self.url = url
        self.version = 0
        self.down = False
        self.down_for = 0  # health checks that still fail before it is back
        self.calls: list[list[int]] = []
        self.timeout = 1.0

    def restart(self) -> None:
        self.version = 0
        self.down = False

    def health(self) -> p.Health:
        if self.down or self.down_for > 0:
            self.down_for -= 1
            raise ServerUnreachable(self.url, f"no answer from {self.url}")
        return p.Health("ok", self.version, "m", 1, 1, 64)

    def wait_ready(self, timeout, sleep, what=""):
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except ServerUnreachable as e:
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(self.url, f"rollout server {self.url} did not answer ({what})") from e
                sleep(0.01)

    def generate(self, prompts, sampling, seeds, expected_version):
        if self.down:
            raise ServerUnreachable(self.url, f"generate: no answer from {self.url}")
        if expected_version != self.version:
            raise VersionMismatch(self.url, "mismatch", 409, p.E_VERSION_MISMATCH, version=self.version)
        self.calls.append(list(seeds))
        samples = [[RolloutSample([s, k], [-1.0, -1.0], "length") for k in range(sampling.n)] for s in seeds]
        return p.GenerateResponse(self.version, samples)


class FakePush:
    def __init__(self, clients):
        self.by_url = {c.url: c for c in clients}
        self.log: list[tuple[int, list[str]]] = []
        self.fatal: str | None = None

    def __call__(self, version, urls):
        self.log.append((version, list(urls)))
        outs = []
        for u in urls:
            c = self.by_url[u]
            if self.fatal:
                outs.append(PushOutcome(u, version, False, error=self.fatal))
            elif c.down:
                outs.append(PushOutcome(u, version, False, error=f"no answer from {u}", retryable=True))
            else:
                c.version = version
                outs.append(PushOutcome(u, version, True, bytes=100))
        return outs


def _remote(k: int = 2, timeout: float = 5.0):
    clients = [FakeClient(f"http://127.0.0.1:{9000 + i}") for i in range(k)]
    push = FakePush(clients)
    return RemoteRollout(clients, push, timeout, sleep=lambda s: None), clients, push


def test_prompts_split_contiguously_and_come_back_in_order():
    remote, clients, push = _remote(2)
    seeds = [10, 11, 12, 13, 14]
    res = remote.generate([[1]] * 5, SamplingConfig(n=2), seeds)
    assert [g[0].token_ids[0] for g in res.samples] == seeds and all(len(g) == 2 for g in res.samples)
    assert clients[0].calls == [[10, 11]] and clients[1].calls == [[12, 13, 14]]
    assert push.log == [(1, [c.url for c in clients])]
    assert res.timing["rollout/weight_sync_bytes"] == 200 and res.timing["rollout/weight_version"] == 1
    assert res.timing["timing/weight_sync"] >= 0 and res.timing["timing/rollout"] >= 0
    remote.generate([[1]], SamplingConfig(), [3])  # fewer prompts than servers: the first gets none
    assert clients[0].calls == [[10, 11]] and clients[1].calls[-1] == [3] and remote.version == 2


def test_a_restarted_server_is_resynced_before_it_serves_again():
    remote, clients, push = _remote(2)
    remote.generate([[1]] * 2, SamplingConfig(), [1, 2])
    real_generate = clients[1].generate

    def die_and_restart(*a, **kw):  # killed during the request; back (version 0) after two failed health checks
        clients[1].generate = real_generate
        clients[1].restart()
        clients[1].down_for = 2
        raise ServerUnreachable(clients[1].url, "connection reset")

    clients[1].generate = die_and_restart
    res = remote.generate([[1]] * 2, SamplingConfig(), [5, 6])
    assert [g[0].token_ids[0] for g in res.samples] == [5, 6]
    assert push.log[-2:] == [(2, [c.url for c in clients]), (2, [clients[1].url])] and clients[1].version == 2
    assert res.timing["rollout/server_resyncs"] == 1 and res.timing["rollout/weight_sync_bytes"] == 300
    assert clients[1].calls[-1] == [6]


def test_an_agent_loops_turns_share_one_push():
    """Within `awake` (an agent loop's rollout: a call per turn) the weights are pushed once on entry and every call
    samples with that version; a server restarted meanwhile is re-synced to it. The next rollout pushes the next."""
    from mindrl.trainer.pipeline.engines import Engine

    remote, clients, push = _remote(2)
    engine, timing = Engine(remote, lambda phase, t: None, replicas=1), {}
    with engine.awake(timing):
        engine.generate([[1]] * 2, SamplingConfig(), [1, 2], timing)
        clients[1].restart()  # between two turns: back with version 0
        engine.generate([[1]] * 2, SamplingConfig(), [3, 4], timing)
        engine.generate([[1]] * 2, SamplingConfig(), [5, 6], timing)
    assert push.log == [(1, [c.url for c in clients]), (1, [clients[1].url])]
    assert clients[0].calls == [[1], [3], [5]] and clients[1].calls == [[2], [4], [6]]
    assert timing["rollout/weight_version"] == 1 and timing["rollout/weight_sync_bytes"] == 200
    assert timing["rollout/server_resyncs"] == 1 and timing["timing/weight_sync"] >= 0
    engine.generate([[1]] * 2, SamplingConfig(), [7, 8], {})
    assert push.log[-1] == (2, [c.url for c in clients]) and remote.version == 2


def test_a_server_down_at_push_time_is_waited_for_then_pushed_again():
    remote, clients, push = _remote(1)
    clients[0].down, clients[0].down_for = True, 0
    calls = {"n": 0}
    orig = clients[0].health

    def health():
        calls["n"] += 1
        if calls["n"] == 3:
            clients[0].restart()
        return orig()

    clients[0].health = health
    res = remote.generate([[1]], SamplingConfig(), [9])
    assert push.log == [(1, [clients[0].url]), (1, [clients[0].url])] and res.timing["rollout/server_resyncs"] == 1


def test_a_server_that_never_comes_back_stops_the_run_naming_it():
    remote, clients, _ = _remote(2, timeout=0.2)
    remote.generate([[1]] * 2, SamplingConfig(), [1, 2])
    clients[1].down = True
    with pytest.raises(RemoteRolloutError, match=rf"rollout server {clients[1].url} is gone.*server_timeout=0.2"):
        remote.generate([[1]] * 2, SamplingConfig(), [1, 2])


def test_refusals_are_not_retried_and_a_server_ahead_is_an_error():
    remote, clients, push = _remote(1)
    push.fatal = "400 bad_request: unknown weight 'x'"
    with pytest.raises(RemoteRolloutError, match=rf"weight update of rollout server {clients[0].url}.*unknown weight"):
        remote.generate([[1]], SamplingConfig(), [1])
    remote, clients, push = _remote(1)

    def refuse(*a, **kw):
        raise RolloutServerError(clients[0].url, "generate: 422 bad_request: seeds", 422)

    clients[0].generate = refuse
    with pytest.raises(RemoteRolloutError, match="422 bad_request"):
        remote.generate([[1]], SamplingConfig(), [1])
    remote, clients, push = _remote(1)

    def other_trainer(*a, **kw):
        clients[0].version = 7  # someone else pushed version 7 between our push and our generate
        raise VersionMismatch(clients[0].url, "mismatch", 409, p.E_VERSION_MISMATCH, version=7)

    clients[0].generate = other_trainer
    with pytest.raises(RemoteRolloutError, match="serves weight version 7, ahead of this trainer's 1"):
        remote.generate([[1]], SamplingConfig(), [1])


def test_group_pusher_deals_servers_over_the_ranks():
    from types import SimpleNamespace as NS

    from mindrl.trainer.pipeline.engines import group_pusher

    calls = []

    class Group:
        world_size = 2

        def push_weights(self, args):
            calls.append(("push_weights", args))
            return [[PushOutcome(u, a[0], True) for u in a[1]] for a in args]

    clients = [NS(url=u, timeout=5.0) for u in ("http://a:1", "http://b:1", "http://c:1")]
    push = group_pusher(Group(), clients, "tok", 123, "dist")
    assert [o.url for o in push(3, ["http://c:1", "http://a:1", "http://b:1"])] == ["http://c:1", "http://a:1",
                                                                                    "http://b:1"]  # fmt: skip
    # every rank streams (a collective); rank 0 sends to the 1st and 3rd server, rank 1 to the 2nd
    assert calls == [("push_weights", [(3, ["http://c:1", "http://b:1"], "tok", 123, 5.0, "dist"),
                                       (3, ["http://a:1"], "tok", 123, 5.0, "dist")])]  # fmt: skip


def test_server_keys_are_validated_at_load():
    from mindrl.config import ConfigError, load_config

    urls = "[http://127.0.0.1:8000,'ftp://h:1',http://h:1/v1,http://h,http://127.0.0.1:8000/]"
    with pytest.raises(ConfigError) as e:
        load_config("ppo_tiny_cpu_server", overrides=[f"generate_config.server_urls={urls}",
                    "generate_config.server_timeout=0", "generate_config.weight_transfer=tcp"])  # fmt: skip
    text = str(e.value)
    for fragment in (
        "server_urls[1]: 'ftp://h:1' must look like http://HOST:PORT",
        "server_urls[2]: 'http://h:1/v1' must be the server's base URL, without a path",
        "server_urls[3]: 'http://h' names no port",
        "server_urls[4]: 'http://127.0.0.1:8000/' is listed twice",
        "generate_config.server_timeout: must be > 0 seconds",
        "generate_config.weight_transfer: 'tcp' is not one of auto, http, dist",
    ):
        assert fragment in text, (fragment, text)
    cfg = load_config("ppo_tiny_cpu_server")
    assert cfg.generate_config.server_urls == ["http://127.0.0.1:8000"] and cfg.generate_config.server_timeout == 300
    assert cfg.generate_config.weight_transfer == "auto"


# ---- real servers, real trainer ---------------------------------------------------------------------------------
# Server engine settings as the tiny configs' integrated engine (fp32, no prefix caching, same batch budget), so the
# same seeds sample the same tokens.
ENGINE_ARGS = ("--max-model-len", "128", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
               "--no-prefix-caching", "--dtype", "float32")  # fmt: skip
TOKEN = "tiny-secret"
REF_SYNC = ("rl_config.sync_ref_model=true", "rl_config.ref_model_sync_steps=1", "rl_config.ref_model_mixup_alpha=0.5")


@pytest.fixture(scope="module")
def servers(assets):
    """Two rollout servers on the tiny policy's HF dir, with a token; tests that kill one put its replacement (or
    None) in the dict, and whatever is there at the end is stopped."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.serving.conftest import start_server

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: start_server(str(assets / "hf"), token=TOKEN, extra_args=ENGINE_ARGS), "ab"))
    handles = dict(zip("ab", started))
    yield handles
    for h in handles.values():
        if h is not None:
            h.stop()


def _server_config(name, assets, run_dir, urls, *overrides, token=TOKEN):
    token_file = run_dir / "token"
    token_file.write_text(token + "\n")
    return _config(name, assets, run_dir, "generate_config.rollout_mode=server",
                   f"generate_config.server_urls=[{','.join(urls)}]", f"generate_config.server_token_file={token_file}",
                   "rl_config.use_tensorboard=false", *overrides)  # fmt: skip


def _kill_during(monkeypatch, url: str, then) -> list:
    """Patch RolloutClient.generate: the run's second request to `url` (iteration 2's) first calls `then()` (which
    stops the server). Returns the versions the requests to `url` expected."""
    from mindrl.serving.client import RolloutClient

    real = RolloutClient.generate
    hits: list = []

    def generate(self, prompts, sampling, seeds=None, expected_version=None):
        if self.url == url:
            hits.append(expected_version)
            if len(hits) == 2:
                then()
        return real(self, prompts, sampling, seeds, expected_version)

    monkeypatch.setattr(RolloutClient, "generate", generate)
    return hits


def _same_first_iteration(lines, rollouts, integrated) -> None:
    """Iteration 1 sampled the same tokens, with the same rewards, as the integrated run (same seeds)."""
    first = [r for r in rollouts if r["iteration"] == 1]
    ref = [r for r in integrated.rollouts if r["iteration"] == 1]
    assert len(first) == len(ref) == 8 * integrated.cfg.rl_config.n_samples_per_prompt
    assert [r["response"] for r in first] == [r["response"] for r in ref]
    assert [r["reward"] for r in first] == [r["reward"] for r in ref]
    assert lines[0]["reward/mean"] == integrated.lines[0]["reward/mean"]


@pytest.mark.slow
def test_ppo_one_server_killed_and_restarted_mid_run(assets, servers, tmp_path, tmp_path_factory, monkeypatch):
    """PPO against one server: its first iteration is the integrated run's (the session's shared straight run). The
    server is stopped as iteration 2 is about to sample and restarted on the same port: the run waits for it,
    re-syncs it, and finishes. The run also syncs its reference every iteration (TR-DPO, alpha 0.5; the GRPO side
    is tests/trainer/test_ref_sync_e2e.py): after iteration 1 the reference is halfway to the actor, so iteration
    2's reward KL is well below the straight run's, whose reference stays the initial policy."""
    import threading

    from mindrl.serving.client import RolloutClient
    from tests.serving.conftest import start_server

    old = servers["a"]
    port = int(old.url.rsplit(":", 1)[1])
    restarted = threading.Thread(
        target=lambda: servers.__setitem__(
            "a", start_server(str(assets / "hf"), port=port, token=TOKEN, extra_args=ENGINE_ARGS)
        )
    )

    def kill_and_restart():
        old.stop()
        restarted.start()

    hits = _kill_during(monkeypatch, old.url, kill_and_restart)
    cfg = _server_config("ppo_tiny_cpu", assets, tmp_path, [old.url], "megatron_training.train_iters=2",
                         "generate_config.server_timeout=120", *REF_SYNC)  # fmt: skip
    _, results, lines, rollouts = _train(cfg)
    restarted.join()
    assert len(hits) == 3 and hits[1] == hits[2] and len(results) == 2  # iteration 2's request went out twice
    straight = straight_run("ppo", assets, tmp_path_factory)
    _same_first_iteration(lines, rollouts, straight)
    assert [m["actor/ref_synced"] for m in lines] == [1.0, 1.0] and all(m["timing/ref_sync"] > 0 for m in lines)
    # KL(actor || (actor + initial) / 2) is about a quarter of KL(actor || initial) (quadratic near 0).
    kl, kl_straight = lines[1]["actor/reward_kl_penalty"], straight.lines[1]["actor/reward_kl_penalty"]
    assert 0 < kl < 0.5 * kl_straight, (kl, kl_straight)
    assert lines[0]["rollout/server_resyncs"] == 0 and lines[1]["rollout/server_resyncs"] == 1
    for m in lines:
        assert m["rollout/weight_sync_bytes"] > 0 and m["timing/weight_sync"] > 0 and m["timing/rollout"] > 0
        assert m["rollout/logprob_diff_mean"] < 1e-3  # the server samples from the policy being trained
    # the re-synced server serves the trainer's last version (one push per iteration)
    assert RolloutClient(servers["a"].url).health().version == hits[2] == lines[1]["rollout/weight_version"]
    assert "timing/reshard_to_infer" not in lines[0]


@pytest.mark.slow
def test_grpo_two_servers_then_one_never_comes_back(assets, servers, tmp_path, tmp_path_factory, monkeypatch):
    """GRPO split over two servers: its first iteration equals integrated mode. Then server b dies for good as
    iteration 2 samples: after server_timeout the run stops with an error naming it, iteration 1's checkpoint
    intact."""
    from mindrl.trainer.ppo_trainer import TrainingAborted

    b = servers["b"]
    _kill_during(monkeypatch, b.url, lambda: (b.stop(), servers.__setitem__("b", None)))
    cfg = _server_config("grpo_tiny_cpu", assets, tmp_path, [servers["a"].url, b.url], "megatron_training.train_iters=2",
                         "megatron_training.save_interval=1", "generate_config.server_timeout=10")  # fmt: skip
    with pytest.raises(TrainingAborted, match=rf"iteration 2: rollout server {b.url} is gone.*server_timeout=10") as e:
        _train(cfg)
    assert "the last complete checkpoint is iteration 1" in str(e.value)
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    rollouts = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    assert len(lines) == 1
    _same_first_iteration(lines, rollouts, straight_run("grpo", assets, tmp_path_factory))
    assert (tmp_path / "ckpt_actor" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.slow
def test_wrong_token_and_absent_server_stop_before_any_worker(assets, servers, tmp_path):
    import ray

    from mindrl.trainer.pipeline.engines import RemoteRolloutError
    from mindrl.trainer.ppo_trainer import PPOTrainer

    url = servers["a"].url if servers["a"] is not None else None
    if url is not None:
        cfg = _server_config("grpo_tiny_cpu", assets, tmp_path, [url], token="wrong")
        with pytest.raises(RemoteRolloutError, match=rf"server_token_file: token check: {url} answered 401"):
            PPOTrainer(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    absent = f"http://127.0.0.1:{port}"
    cfg = _server_config("grpo_tiny_cpu", assets, tmp_path, [absent], "generate_config.server_timeout=1")
    with pytest.raises(RemoteRolloutError, match=rf"server_urls: rollout server {absent} did not answer within 1 s"):
        PPOTrainer(cfg)
    assert not ray.is_initialized()
