"""rl_config.async_mode bounded in mindrl-train: two `mindrl-sampler` processes feed the tiny GRPO over ZeroMQ on
loopback; the trainer publishes its weights after every update, trains no experience older than max_staleness, and
every prompt exactly once; the prompt ledger is in the checkpoint."""

from __future__ import annotations

import collections
import json

import pytest

from mindrl.data.prompt_dataset import PromptDataset
from mindrl.data.tokenizer import load_tokenizer
from mindrl.launch import free_port
from tests.trainer.rl_helpers import PROFILE, STRAIGHT_EXTRA, _config, _train
from tests.trainer.test_async_samplers import start

pytestmark = pytest.mark.slow

N = 4  # grpo_tiny_cpu's n_samples_per_prompt


def test_bounded_trains_every_prompt_once_from_two_samplers(assets, tmp_path):
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    ports = (free_port(), free_port())
    iters = num_prompts // 8  # one epoch at global_batch_size 8
    cfg = _config(
        "grpo_tiny_cpu", assets, tmp_path, f"megatron_training.train_iters={iters}", "megatron_training.save_interval=0",
        "rl_config.use_tensorboard=false", *[x for x in STRAIGHT_EXTRA["grpo"] if x not in PROFILE],
        "rl_config.async_mode=bounded", "rl_config.max_staleness=1", "rl_config.async_host=127.0.0.1",
        f"rl_config.async_data_port={ports[0]}", f"rl_config.async_sync_port={ports[1]}", "rl_config.async_timeout_s=300",
    )  # fmt: skip
    logs = {k: open(tmp_path / f"sampler-{k}.log", "w") for k in "AB"}  # noqa: SIM115 (closed in finally)
    procs = {k: start(k, assets, ports, logs[k], n=N, max_tokens=16) for k in "AB"}
    try:
        run_dir, _, lines, rollouts = _train(cfg)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        for f in logs.values():
            f.close()
    assert len(lines) == iters
    for m in lines:
        assert 0 <= m["async/staleness/max"] <= 1, m
        assert m["timing/publish_weights"] > 0
    # every prompt trained once: N rows of each of the dataset's prompts (some texts occur twice in the dataset)
    tokenizer = load_tokenizer(str(assets / "hf"))
    rows = PromptDataset(str(assets / "data" / "train"), 64, ("labels",))
    texts = tokenizer.batch_decode([rows[i]["input_ids"].tolist() for i in range(num_prompts)])
    expected = collections.Counter({t: N * c for t, c in collections.Counter(texts).items()})
    assert collections.Counter(r["prompt"] for r in rollouts) == expected
    delivered = {k for m in lines for k in m if k.startswith("async/sampler_tps/")}
    print("samplers:", sorted(delivered), "staleness max per iteration:", [m["async/staleness/max"] for m in lines])
    state = json.loads((tmp_path / "ckpt_actor" / f"iter_{iters:07d}" / "trainer_state.json").read_text())
    ledger = state["async_rollout"]["bounded"]["ledger"]
    assert ledger["epochs_closed"] == 1 and ledger["num_prompts"] == num_prompts
