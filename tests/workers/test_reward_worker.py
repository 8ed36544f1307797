"""RuleRewardWorker as the trainer runs it (a Ray actor with 2 threads): it scores, and its shutdown leaves nothing
behind: no process and no multiprocessing folder (the verifier forkserver's socket) in its temporary directory."""

from __future__ import annotations

import sys
import time

import pytest

from tests.procs import alive


def test_reward_worker_scores_then_shuts_down_without_leftovers(tmp_path):
    import ray

    from mindrl.workers.group import start_ray, stop_ray
    from mindrl.workers.reward_worker import RewardSettings, RuleRewardWorker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    assert start_ray(None, 1)
    try:
        actor = (
            ray.remote(num_cpus=0, max_concurrency=2)(RuleRewardWorker)
            .options(runtime_env={"env_vars": {"TMPDIR": str(scratch)}})
            .remote(RewardSettings(verifier_function=("format",)))
        )
        pid = ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=300)
        good = "<think>t</think><answer>a</answer>"
        out = ray.get(actor.score.remote([good, "no tags"], ["a", "b"]), timeout=300)
        assert out.rewards == [1.0, 0.0] and out.texts == [good, "no tags"] and out.labels == ["a", "b"]
        # strings in: the driver decodes, so the worker's process never loads torch nor transformers
        loaded = ray.get(actor.__ray_call__.remote(lambda self: sorted({"torch", "transformers"} & set(sys.modules))))
        assert loaded == []
        assert list(scratch.glob("pymp-*")), "the verifier pool's forkserver keeps its socket in a pymp-* folder"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.shutdown.remote(), timeout=60)
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pid), "the reward actor's process outlived its shutdown"
        assert not list(scratch.glob("pymp-*")), sorted(p.name for p in scratch.iterdir())
    finally:
        stop_ray()
