"""The PPO loop as MindSpeed-RL's recipes run it, in bf16: actor, critic and reference in bf16 with fp32 main params
and gradients (the actor on the distributed optimizer over DP2, the critic on the plain one at TP2), vLLM in
bfloat16, the reshard in bf16, from the quickstart task's SFT start (`sft_assets`). One trainer start: it must learn
(the reward rises by the bound measured over seeds, tools/check_learning.py quickstart-ppo-bf16), and its
rollout-vs-trainer logprob gap must stay within what bf16 rounding explains, measured in this test on the same tokens
against an fp64 forward of the same bf16 weights."""

from __future__ import annotations

import json
import math

import pytest

from tests.trainer.rl_helpers import _config, _train
from tools.check_learning import BOUNDS, assert_rises

pytestmark = pytest.mark.slow  # one trainer start: Ray, 2 integrated workers that import vLLM and megatron

ITERATIONS = 30  # the fewest for which quickstart-ppo-bf16's bound was measured (tools/check_learning.py)

BF16 = [
    "megatron_training.bf16=true",
    "generate_config.dtype=bfloat16",
    # the actor (and its reference) at TP1 x DP2 on the distributed optimizer; the critic at TP2 on the plain one:
    # both of megatron's mixed-precision optimizers in one run
    "actor_config.tensor_model_parallel_size=1",
    "actor_config.use_distributed_optimizer=true",
    "critic_config.tensor_model_parallel_size=2",
    "critic_config.use_distributed_optimizer=false",
    "generate_config.infer_tensor_parallel_size=2",
    "rl_config.rollout_is_threshold=2.0",  # TIS on: its truncated share is measured
    "rl_config.log_rollouts_interval=1",
    "rl_config.use_tensorboard=false",
    f"megatron_training.train_iters={ITERATIONS}",
    "megatron_training.save_interval=0",
]


@pytest.fixture(scope="module")
def bf16_run(sft_assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bf16_run")
    cfg = _config("ppo_tiny_cpu", sft_assets, run_dir, *BF16)
    _, _, lines, rollouts = _train(cfg)
    return sft_assets, cfg, lines, rollouts


def test_bf16_loop_learns(bf16_run):
    _, _, lines, _ = bf16_run
    assert [m["iteration"] for m in lines] == list(range(1, ITERATIONS + 1))
    for m in lines:
        assert m["actor/skipped_updates"] == 0 and m["critic/skipped_updates"] == 0, m["iteration"]
    rise = assert_rises(lines, BOUNDS["quickstart-ppo-bf16"], where="the bf16 run")  # the bound measured over seeds
    print(f"reward rose {rise.rise:+.3f}: {[round(m['acc_for_ppo_rewards/mean'], 3) for m in lines]}")


def _logprobs(model, rows) -> list:
    """Per row: the model's log-prob of each response token (temperature 1, as the rollout samples)."""
    import torch

    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logits = model(input_ids=ids).logits[0].double()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(lp[len(r["prompt_ids"]) - 1 :])
    return out


def test_bf16_gap_is_bf16_rounding(bf16_run):
    """Iteration 1 samples with the SFT weights in bf16, and its update's first forward scores the same tokens with
    the same bf16 weights. The gap |rollout - trainer| is the difference of two bf16 forwards; each is |forward -
    fp64| away from the fp64 forward of those weights. Measured here on the same tokens: vLLM's own distance (its
    logprobs against the fp64 forward) and a third bf16 implementation's (HF transformers in bf16). By the triangle
    inequality the gap is at most vLLM's distance plus the trainer's, and the trainer's is taken to be no larger
    than the larger of the two measured ones. The fp32 forward's distance is the floor a precision-independent bug
    would stand out from."""
    import torch
    from transformers import AutoModelForCausalLM

    assets, _, lines, rollouts = bf16_run
    rows = [r for r in rollouts if r["iteration"] == 1 and r["response_length"] > 0]
    for r in rows:
        r["response_ids"] = r["response_ids"][: r["response_length"]]
    base = AutoModelForCausalLM.from_pretrained(str(assets / "hf"), dtype=torch.float32).eval()
    weights = {k: v.to(torch.bfloat16) for k, v in base.state_dict().items()}  # what both engines compute with

    def at(dtype):
        model = AutoModelForCausalLM.from_pretrained(str(assets / "hf"), dtype=torch.float32).eval()
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
        return _logprobs(model.to(dtype), rows)

    fp64, bf16, fp32 = at(torch.float64), at(torch.bfloat16), at(torch.float32)
    rollout = [torch.tensor(r["rollout_log_prob"][: r["response_length"]], dtype=torch.float64) for r in rows]

    def dist(a, b) -> tuple[float, float]:
        d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return d.mean().item(), d.max().item()

    vllm_mean, vllm_max = dist(rollout, fp64)
    hf_mean, hf_max = dist(bf16, fp64)
    fp32_mean, fp32_max = dist(fp32, fp64)
    gap_mean, gap_max = lines[0]["rollout/logprob_diff_mean"], lines[0]["rollout/logprob_diff_max"]
    report = (
        f"gap mean {gap_mean:.3g} max {gap_max:.3g}; vs fp64: vLLM bf16 {vllm_mean:.3g} / {vllm_max:.3g}, HF bf16 "
        f"{hf_mean:.3g} / {hf_max:.3g}, HF fp32 {fp32_mean:.3g} / {fp32_max:.3g}"
    )
    assert gap_mean <= vllm_mean + max(vllm_mean, hf_mean), report
    assert gap_max <= vllm_max + max(vllm_max, hf_max), report
    # the engines ran in bf16: each one's distance from fp64 is above what an fp32 forward of the same weights has
    assert vllm_mean > fp32_mean and hf_mean > fp32_mean, report
    print(report)


def test_bf16_gap_metrics_every_iteration(bf16_run):
    """The gap per token and per response, and TIS's truncated share, on every iteration."""
    _, cfg, lines, _ = bf16_run
    max_tokens = cfg.generate_config.sampling_config.max_tokens
    for m in lines:
        assert 0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"], m
        assert 0 <= m["rollout/seq_logprob_diff_mean"] <= m["rollout/seq_logprob_diff_max"], m
        # a response's |sum of token differences| is at most the sum of its tokens' |differences|
        assert m["rollout/seq_logprob_diff_max"] <= m["rollout/logprob_diff_max"] * max_tokens * (1 + 1e-6), m
        assert 0.0 <= m["actor/is_truncated_frac"] <= 1.0, m
        assert math.isfinite(m["actor/is_weight_mean"]), m
    assert json.dumps(lines)  # every value serialisable (no NaN sneaked in)
