"""Partial rollout end to end: grpo_tiny_cpu with partial_rollout_max_split=2 runs to the end with its metrics, every
drawn prompt trained once, and a resume from a checkpoint with responses in flight is exact."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter

import pytest

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.iterations import TrainerState
from tests.trainer.rl_helpers import _config, _train

pytestmark = pytest.mark.slow  # each run starts Ray and worker processes that import vLLM and megatron

ITERS = 4
RESUME = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]


def _overrides(assets) -> list[str]:
    """Split 2 of 24 tokens; responses stop at a digit, so that lengths vary (some end in the first piece)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets / "hf"))
    digits = sorted({tok.convert_tokens_to_ids(str(d)) for d in range(10)} - {tok.unk_token_id})
    return [
        "rl_config.partial_rollout_max_split=2", f"megatron_training.train_iters={ITERS}",
        "megatron_training.save_interval=2", "megatron_training.global_batch_size=4", "rl_config.mini_batch_size=4",
        f"+generate_config.sampling_config.stop_token_ids={digits}", "rl_config.use_tensorboard=false",
    ]  # fmt: skip


def _comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")}


def test_split_run_ends_with_metrics_each_prompt_once_and_resumes_exactly(assets, tmp_path):
    straight_dir = tmp_path / "straight"
    _, _, lines, rollouts = _train(_config("grpo_tiny_cpu", assets, straight_dir, *_overrides(assets)))
    assert [m["iteration"] for m in lines] == list(range(1, ITERS + 1))
    keys = ("split_responses", "continued", "staleness/mean", "staleness/max", "stale_token_fraction",
            "in_flight_prompts", "pieces_per_response")  # fmt: skip
    for m in lines:
        assert all(f"partial_rollout/{k}" in m for k in keys), sorted(m)
        assert m["partial_rollout/staleness/max"] <= 1  # max_split 2: a token is at most one iteration old
    assert sum(m["partial_rollout/split_responses"] for m in lines) > 0, "nothing was split: the test proves nothing"
    assert lines[-1]["partial_rollout/in_flight_prompts"] == 0
    # the train_iters batches drawn are the task's 16 prompts (one epoch): each trained once, with its 4 samples
    per_prompt = Counter(r["prompt"] for r in rollouts)
    assert len(per_prompt) == ITERS * 4 and set(per_prompt.values()) == {4}
    # the mid-run checkpoint holds the responses in flight
    it2 = os.path.join(straight_dir, "ckpt_actor", "iter_0000002")
    state = TrainerState.read(it2).partial_rollout
    assert state is not None and state["drawn_batches"] == 3 and state["pool"]
    # resume from iteration 2: the same metrics as the straight run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(straight_dir, resumed_dir)
    ckpt = resumed_dir / "ckpt_actor"
    shutil.rmtree(ckpt / f"iter_{ITERS:07d}")
    mcore_ckpt.write_tracker(str(ckpt), 2)
    cfg = _config("grpo_tiny_cpu", assets, resumed_dir, *_overrides(assets), *RESUME, actor_load=ckpt)
    _, results, again, _ = _train(cfg)
    assert [r.iteration for r in results] == [3, 4]
    assert [m["iteration"] for m in again] == list(range(1, ITERS + 1))
    for a, b in zip(lines[2:], again[2:]):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}
        assert not bad, bad
    assert json.dumps(TrainerState.read(str(ckpt / f"iter_{ITERS:07d}")).partial_rollout) == json.dumps(
        TrainerState.read(os.path.join(straight_dir, "ckpt_actor", f"iter_{ITERS:07d}")).partial_rollout
    )
