"""mindrl-plan on MindSpeed-RL's DPO recipe (`stage: dpo`) as they ship it: a training-only plan (no engine, no rollout
phase), its terms against megatron's accounting, the CLI, --json and tools/plan_recipes.py. In-process, seconds."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

import mindrl.plan.memory as mem
from mindrl.cli import plan as plan_cli
from mindrl.config import ConfigError
from mindrl.plan import make_plan, stage_params, to_json
from mindrl.preflight import config_from_args, load_dpo_config
from tests.plan.msrl_dpo_recipe import NAME, write_recipe

GIB = 1 << 30


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(write_recipe(tmp_path_factory.mktemp("msrl") / "configs"))


@pytest.fixture(scope="module")
def plan(folder):
    return make_plan(load_dpo_config(NAME, folder, check_paths=False))


def test_the_recipe_fits_an_a3_die_training_only(plan):
    assert plan.device.key == "a3" and plan.device.memory_bytes == 64 * GIB
    assert plan.rollout is None and plan.kv_cache == {}
    assert plan.world == 16 and len(plan.placement) == 16 and all(s.engine is None for s in plan.placement)
    lay = plan.layouts["actor"]
    assert (lay.tp, lay.pp, lay.dp, lay.sequence_parallel) == (2, 8, 1, True)
    # a micro-batch of one pair is two sequences of seq_length; 64 pairs per step at DP 1
    assert lay.update_shape == (4096, 2) and lay.micro_batches_per_step == 64
    assert set(plan.memory) == {"actor", "total"}  # ref_model is load: the reference pass runs on the policy
    assert set(plan.memory["total"]) == {"score_bytes", "train_bytes"}
    v = plan.verdict
    assert v["fits"] and v["peak_phase"] == "train" and v["peak_bytes"] <= 64 * GIB, v
    assert v["largest_term"] == "actor.train.activations_bytes"
    assert "recompute_granularity: full" in v["fix"]


def test_state_terms_are_megatrons(plan, folder):
    """bf16 weights, fp32 main grads and Adam's 12 bytes per parameter (one DP rank: nothing to shard) of the stage's
    parameters: its layers' attention, router and all 128 experts split over TP, plus the embedding on stage 0."""
    cfg = load_dpo_config(NAME, folder, check_paths=False)
    actor = plan.memory["actor"]["train"]
    params = stage_params(cfg.model, "actor", 2, 8, plan.placement[plan.peak_device].actor[1]).total
    assert actor["weights_bytes"] == 2 * params
    assert actor["grads_bytes"] == 4 * params
    assert actor["optimizer_bytes"] == 12 * params
    v, h, layers, a, g, d, experts, f = 151936, 2048, 48, 32, 4, 128, 128, 768
    per_layer = 2 * h + h * (a + 2 * g) * d + 2 * d + a * d * h + experts * h + experts * 3 * h * f  # router, experts
    assert plan.layouts["actor"].params_total == 2 * v * h + layers * per_layer + h == 30_532_122_624


def test_reference_pass_keeps_the_last_stages_logits(folder):
    """The reference log-probabilities: a forward of one pair; only the last stage holds logits (bf16 + the fp32
    log-softmax, the vocabulary split over TP)."""
    cfg = load_dpo_config(NAME, folder, check_paths=False)
    from mindrl.plan.offline import _stage_memory

    plan = make_plan(cfg)
    lay = plan.layouts["actor"]
    last, first = _stage_memory(plan, cfg, lay, 7), _stage_memory(plan, cfg, lay, 0)
    assert last["actor"]["score"]["activations_bytes"] == 4096 * 2 * (151936 // 2) * (4 + 2)
    assert first["actor"]["score"]["activations_bytes"] == 0


def test_micro_batch_and_world_size_overrides(folder):
    base = make_plan(load_dpo_config(NAME, folder, check_paths=False))
    two = make_plan(load_dpo_config(NAME, folder, ["megatron_training.micro_batch_size=2"], check_paths=False))
    assert two.layouts["actor"].update_shape == (4096, 4) and two.layouts["actor"].micro_batches_per_step == 32
    assert two.memory["actor"]["train"]["activations_bytes"] > base.memory["actor"]["train"]["activations_bytes"]
    dp2 = make_plan(load_dpo_config(NAME, folder, ["megatron_training.world_size=32"], check_paths=False))
    assert dp2.layouts["actor"].dp == 2 and len(dp2.placement) == 32
    opt = dp2.memory["actor"]["train"]["optimizer_bytes"]
    assert opt == -(-base.memory["actor"]["train"]["optimizer_bytes"] // 2)  # the distributed optimizer over DP 2
    assert not any("no world_size" in n for n in dp2.notes) and any("no world_size" in n for n in base.notes)


def test_cli_text_and_json(folder, capsys):
    assert plan_cli.main(["--config-name", NAME, "--config-path", folder]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "no rollout engine" in out and "KV cache" not in out
    assert "rollout engine" not in out.split("placement")[0]
    assert plan_cli.main(["--config-name", NAME, "--config-path", folder, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["rollout"] is None and obj["verdict"]["fits"]
    assert obj["memory"]["actor"]["score"]["weights_bytes"] == obj["memory"]["actor"]["train"]["weights_bytes"]
    assert to_json(make_plan(load_dpo_config(NAME, folder, check_paths=False)))["rollout"] is None


def test_cli_reports_a_bad_dpo_config(folder, capsys):
    code = plan_cli.main(["--config-name", NAME, "--config-path", folder, "megatron_training.world_size=24"])
    assert code == 2
    assert "megatron_training.world_size: 24 is not divisible by TP x PP = 2 x 8" in capsys.readouterr().err


def test_mindrl_train_names_the_dpo_command(folder):
    args = Namespace(config_name=NAME, config_path=folder, overrides=[], no_check_paths=True)
    with pytest.raises(ConfigError, match=r"megatron_training.stage: 'dpo' is offline DPO.*mindrl-train-dpo"):
        config_from_args(args)


def test_plan_recipes_tool_finds_and_plans_it(folder):
    from tools import plan_recipes

    assert plan_recipes.recipes(folder) == [NAME]
    row = plan_recipes.plan_recipe(folder, NAME, None)
    assert row.loads and row.fits and row.device == "a3" and row.phase == "train", row
    assert row.largest.startswith("actor.activations ")


def test_update_activations_are_the_formulas(plan, folder):
    """The update's activations are memory.train_activation_bytes of the first stage (PP micro-batches in flight)
    on the A3's kernels: the planner adds no term of its own."""
    cfg = load_dpo_config(NAME, folder, check_paths=False)
    lay = plan.layouts["actor"]
    k = plan.device.kernels
    want = mem.train_activation_bytes(cfg.model, "actor", 4096, 2, 2, 8, True, 2, 0, 64, lay.recompute,
                                      k.norm == "eager_fused", k.gemm_attention_max_len, k)  # fmt: skip
    assert plan.peak_device in (0, 1) and plan.memory["actor"]["train"]["activations_bytes"] == want
