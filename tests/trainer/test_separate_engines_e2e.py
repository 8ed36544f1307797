"""Separate placement with the rollout engines on a stand-in device of their own (rl_config.rollout_resource): the
actor's weights reach them over the weight group, bit-equal to its export, and the first iteration equals integrated
mode's for the same seeds (real megatron on gloo, Ray, vLLM); an agent loop's turns (calls within `awake`) sample
from one sync."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.rl_helpers import _config
from tests.trainer.test_separate_placement_e2e import ONE_DEVICE, SEPARATE, VARIES, integrated

pytestmark = pytest.mark.slow

OWN_ENGINES = [*SEPARATE, "+rl_config.rollout_resource.num_npus=1"]
SYNC = ("rollout/weight_sync_bytes", "rollout/weight_version")  # the weight group's own metrics
INTEGRATED_ONLY = ("rollout/weight_loads",)  # loads into the actor's own engine; the group reports SYNC's instead


def test_engines_on_their_own_device_equal_integrated(assets, tmp_path_factory, tmp_path):
    from mindrl.trainer.ppo_trainer import PPOTrainer

    _, integ, integ_rows, _ = integrated(assets, tmp_path_factory)
    integ = {k: v for k, v in integ.items() if not k.startswith(INTEGRATED_ONLY)}
    run_dir = tmp_path / "engines"
    cfg = _config("ppo_tiny_cpu_rm", assets, run_dir, f"reward_config.load={assets / 'critic'}", *ONE_DEVICE,
                  *OWN_ENGINES)  # fmt: skip
    trainer = PPOTrainer(cfg)
    try:
        assert trainer.engines is not None and trainer.placed.first_device["rollout"] == 4
        # What the engine loaded is the actor's export, to the bit.
        trainer.rollout.keep = True
        sync = trainer.rollout.sync()
        trainer.rollout.keep = False
        received = trainer.engines.received_weights()[0]
        exported = trainer.actor.export_weights()[0]
        assert list(received) == list(exported)
        for name, t in exported.items():
            assert received[name].dtype == t.dtype and torch.equal(received[name], t), name
        assert sync["rollout/weight_sync_bytes"] >= sum(t.numel() * t.element_size() for t in exported.values())
        trainer.fit()
        _turns_share_one_sync(trainer)
    finally:
        trainer.shutdown()
    raw = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    rows = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert raw["rollout/weight_version"] == 2  # the iteration's rollout synced again, after the check's version 1
    sep = {k: v for k, v in raw.items() if not k.startswith(VARIES + SYNC)}
    assert sep.keys() == integ.keys()
    diff = {k: (integ[k], sep[k]) for k in integ if integ[k] != sep[k]}
    assert not diff, diff
    for a, b in zip(integ_rows, [r for r in rows if r["iteration"] == 1], strict=True):
        assert (a["response_ids"], a["reward"], a["reward_model_score"]) == (b["response_ids"], b["reward"],
                                                                          b["reward_model_score"])  # fmt: skip


def _turns_share_one_sync(trainer) -> None:
    """Calls within `Engine.awake` (an agent loop's turns, each on the contexts the last one grew) sample from the one
    version streamed on entry, and it is the actor's current weights: the same contexts and seeds outside `awake`,
    after a sync of their own, give the same tokens and logprobs."""
    from mindrl.rollout.base import SamplingConfig

    engine, version = trainer.engine, trainer.rollout.version
    sampling = SamplingConfig(max_tokens=4, temperature=1.0, logprobs=1)
    prompts, timing = [[11, 12, 13, 14], [21, 22, 23]], {}
    with engine.awake(timing):
        first = engine.generate(prompts, sampling, [1, 2], timing)
        contexts = [p + s.token_ids for p, [s] in zip(prompts, first)]
        second = engine.generate(contexts, sampling, [3, 4], timing)
    assert trainer.rollout.version == version + 1 and timing["rollout/weight_version"] == version + 1
    alone = engine.generate(contexts, sampling, [3, 4], {})
    assert trainer.rollout.version == version + 2
    assert [(s.token_ids, s.logprobs) for [s] in second] == [(s.token_ids, s.logprobs) for [s] in alone]
