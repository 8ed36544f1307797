"""mindrl-train-dpo's config reads MindSpeed-RL's DPO recipe unchanged: every key it sets is read with its effect,
ignored with its reason or accepted only at its neutral value; the model file gives the planner the architecture."""

from __future__ import annotations

import pytest

from mindrl.config import ConfigError
from mindrl.preflight import load_dpo_config
from tests.plan.msrl_dpo_recipe import NAME, RECIPE, write_recipe


def _load(tmp_path, overrides=(), recipe=RECIPE):
    return load_dpo_config(NAME, str(write_recipe(tmp_path, recipe)), list(overrides), check_paths=False)


def test_the_recipe_loads_with_every_key_accounted_for(tmp_path):
    cfg = _load(tmp_path)
    mt, arch = cfg.megatron_training, cfg.model
    # the architecture: the model file, with megatron_training's architecture keys over it
    assert (arch.name, arch.num_layers, arch.num_experts, arch.moe_router_topk) == ("qwen3_30b_a3b", 48, 128, 8)
    assert arch.norm_epsilon == 1e-6 and arch.qk_layernorm
    # read with their effect
    assert mt.no_shuffle and mt.seed == 42 and mt.min_lr == 0 and mt.dpo_loss_type == "sigmoid"
    assert (mt.world_size, mt.dp, mt.world_size_from_layout) == (16, 1, True)  # no device count: TP x PP
    assert mt.eval_interval == 0  # eval_iters 0: megatron runs no evaluation
    assert not mt.separate_reference  # ref_model is load: the reference pass runs on the policy's start
    ignored = set(cfg.ignored_keys)
    for key in ("eval_interval", "initial_loss_scale", "moe_grouped_gemm", "overlap_grad_reduce", "swap_attention",
                "attention_mask_type", "init_method_std", "attention_dropout", "hidden_dropout", "refer_model_iter",
                "attention_softmax_in_fp32", "use_mcore_models", "reuse_fp32_param"):  # fmt: skip
        assert f"megatron_training.{key}" in ignored, key
    assert "model.qwen3_30b_a3b.moe_token_dispatcher_type" in ignored


def test_the_rl_side_refusals_do_not_apply(tmp_path):
    """No engine: seq_length 4096 needs no max_model_len, and no inference TP meets the 4 KV heads."""
    cfg = _load(tmp_path, ["megatron_training.seq_length=40960"])
    assert cfg.megatron_training.seq_length == 40960


@pytest.mark.parametrize(
    "override, message",
    [
        ("megatron_training.attention_dropout=0.1", r"attention_dropout: 0.1 is not supported by mindrl \(dropout"),
        ("megatron_training.fp16=true", r"initial_loss_scale: is not applied by mindrl-train-dpo"),
        ("megatron_training.eval_iters=2", r"eval_interval: 5000 needs a validation split, but split is '100,0,0'"),
        ("megatron_training.world_size=24", r"world_size: 24 is not divisible by TP x PP = 2 x 8"),
        ("megatron_training.model=qwen3_30b", r"no model 'qwen3_30b'.*did you mean 'qwen3_30b_a3b'"),
        ("megatron_training.qk_layernorm=1", r"megatron_training.qk_layernorm: expected true or false, got 1"),
    ],
)
def test_what_it_refuses_says_why(tmp_path, override, message):
    overrides = [override, "megatron_training.bf16=false"] if "fp16" in override else [override]
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, overrides)


def test_unknown_and_misplaced_keys_stay_errors(tmp_path):
    recipe = RECIPE.replace("  seed: 42\n", "  seed: 42\n  moe_grouped_gem: true\n")
    with pytest.raises(
        ConfigError, match=r"megatron_training.moe_grouped_gem: unknown key; did you mean 'moe_grouped_gemm'"
    ):
        _load(tmp_path, recipe=recipe)


def test_a_dpo_config_without_a_model_still_loads(tmp_path):
    """The run builds what `load` holds; only mindrl-plan needs the architecture, and says so."""
    from mindrl.plan import PlanError, make_plan

    recipe = RECIPE.replace("  model: qwen3_30b_a3b\n", "").replace("  qk_layernorm: true\n", "", 1)
    cfg = _load(tmp_path, recipe=recipe)
    assert cfg.model is None
    with pytest.raises(PlanError, match="megatron_training.model is not set"):
        make_plan(cfg)
