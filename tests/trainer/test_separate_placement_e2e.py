"""Separate placement runs (real megatron on gloo, Ray, vLLM): PPO with a reward model, reference, critic and reward
model each on its own bundle, gives the same first iteration as integrated mode for the same seeds."""

from __future__ import annotations

import pytest

from tests.trainer.rl_helpers import ONE_DEVICE, _config, _train, integrated_rm_run

pytestmark = pytest.mark.slow

SEPARATE = ["rl_config.use_integrated_worker=false", "+rl_config.reference_resource.num_npus=1"]
# What differs by construction: wall times and throughput, and the device ledger (each model alone on its device
# holds its state in every phase; integrated mode offloads it outside its phases).
VARIES = ("timing/", "memory/", "e2e_tps", "update_tps", "vllm_tps", "perf/")


def _first_iteration(assets, run_dir, *overrides):
    cfg = _config("ppo_tiny_cpu_rm", assets, run_dir, f"reward_config.load={assets / 'critic'}", *ONE_DEVICE,
                  *overrides)  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    return _comparable(cfg, lines, rollouts)


def _comparable(cfg, lines, rollouts):
    """(config, iteration 1's metrics but those that vary by construction, its rollouts, its raw metrics)."""
    metrics = {k: v for k, v in lines[0].items() if not k.startswith(VARIES)}
    return cfg, metrics, [r for r in rollouts if r["iteration"] == 1], lines[0]


def integrated(assets, tmp_path_factory):
    """_first_iteration's tuple of the integrated run (rl_helpers.integrated_rm_run, shared)."""
    run = integrated_rm_run(assets, tmp_path_factory)
    return _comparable(run.cfg, run.lines, run.rollouts)


def test_separate_placement_equals_integrated(assets, tmp_path_factory, tmp_path):
    _, integ, integ_rows, _ = integrated(assets, tmp_path_factory)
    cfg, sep, sep_rows, raw = _first_iteration(assets, tmp_path / "separate", *SEPARATE)
    from mindrl.plan import make_plan

    plan = make_plan(cfg, device="host")
    assert [(g.roles, g.devices) for g in plan.groups] == [
        (("actor", "rollout"), [0]), (("reference",), [1]), (("critic",), [2]), (("reward",), [3])
    ]  # fmt: skip
    # Each model alone on its bundle keeps its state there: the critic's weights stay while the engine runs (integrated
    # mode offloads them then), and that device holds the most in the rollout phase.
    assert raw["memory/device_bytes/rollout/critic.weights"] > 0
    # Same layouts, same seeds, the same forward passes on other processes: equal to the bit.
    for key in ("reward/mean", "reward_model/score/mean", "actor/reward_kl_penalty", "actor/pg_loss",
                "critic/vf_loss"):  # fmt: skip
        assert key in sep, key
    assert sep.keys() == integ.keys()
    diff = {k: (integ[k], sep[k]) for k in integ if integ[k] != sep[k]}
    assert not diff, diff
    for a, b in zip(integ_rows, sep_rows, strict=True):
        assert (a["response_ids"], a["reward"], a["reward_model_score"]) == (b["response_ids"], b["reward"],
                                                                          b["reward_model_score"])  # fmt: skip
