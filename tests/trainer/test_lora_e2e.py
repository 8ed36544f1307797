"""A tiny LoRA GRPO run through the trainer (one start) from the quickstart task's SFT start (`sft_assets`): the actor
trains adapters on its frozen backbone, the reference is that backbone with the adapters off (share_backbone: no
reference model is loaded), the rollout engine runs the merged weights each step, so the every-step
rollout-vs-trainer logprob check holds, and the reward rises by a bound measured over seeds. Its checkpoint exports
with mindrl-convert as a merged HF model and, with --adapter-only, as a PEFT directory that peft loads onto the base
model with the merged export's logits."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.rl_helpers import LEARN_ITERS, _config, _train
from tools.check_learning import BOUNDS, assert_rises

pytestmark = pytest.mark.slow

TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
# r 8, alpha 16 (MindSpeed-RL's defaults) on every linear; LoRA's learning rate is 10x the full fine-tune's 3e-4.
LORA = [f"+actor_config.lora_target_modules={TARGETS}", "+actor_config.lora_r=8", "+actor_config.lora_alpha=16",
        "actor_config.lr=3e-3", "+rl_config.share_backbone=true", f"megatron_training.train_iters={LEARN_ITERS}",
        f"megatron_training.save_interval={LEARN_ITERS}", "rl_config.use_tensorboard=false"]  # fmt: skip


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def test_lora_grpo_run_learns_shares_the_backbone_and_exports_to_peft(sft_assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mindrl.checkpoint import convert, mcore_ckpt
    from tests.conftest import shared_pool

    run_dir = tmp_path / "run"
    assets = sft_assets
    cfg = _config("grpo_tiny_cpu", assets, run_dir, *LORA)
    _, _, lines, _ = _train(cfg)
    assert len(lines) == LEARN_ITERS
    # The reward rises through the adapters alone, by the bound measured over seeds (tools/check_learning.py).
    assert_rises(lines, BOUNDS["quickstart-grpo-lora"], where=str(run_dir))
    # Iteration 1: B = 0, so the actor is its backbone and the shared-backbone reference's KL is exactly 0. Then the
    # adapters have moved: the reference (adapters off) and the actor differ.
    assert lines[0]["actor/kl_loss"] == 0.0, lines[0]
    assert lines[1]["actor/kl_loss"] > 0.0, lines[1]
    warn = cfg.rl_config.logprob_diff_warn
    for m in lines:  # the engine samples from the merged weights the trainer scores with
        assert m["rollout/logprob_diff_mean"] < warn, m
    diffs = [m["rollout/logprob_diff_max"] for m in lines]
    print(f"rollout-vs-trainer max |logprob diff| per iteration: {diffs}; KL {[m['actor/kl_loss'] for m in lines]}")

    ckpt = run_dir / "ckpt_actor"
    _, meta = mcore_ckpt.read_model_meta(str(ckpt))
    assert meta["lora"] == {"lora_r": 8, "lora_alpha": 16.0, "lora_target_modules": TARGETS[1:-1].split(",")}
    merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
    convert.mcore2hf(str(ckpt), str(merged_dir), pool=shared_pool())
    convert.mcore2hf(str(ckpt), str(peft_dir), adapter_only=True, pool=shared_pool())
    assert sorted(p.name for p in peft_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(assets / "hf", torch_dtype=torch.float32)
    base_logits = _logits(base, ids)
    peft32 = PeftModel.from_pretrained(base, peft_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()
    peft64 = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(assets / "hf", torch_dtype=torch.float64), peft_dir
    ).eval()
    exact = _logits(peft64, ids)
    gap = (_logits(peft32, ids) - exact).abs().max().item()  # HF + peft's own fp32 error on these tokens
    diff = (_logits(merged, ids) - exact).abs().max().item()
    effect = (exact - base_logits).abs().max().item()
    print(f"merged export vs peft fp64: {diff:.3g}; peft fp32-vs-fp64 gap {gap:.3g}; the adapters move logits by "
          f"{effect:.3g}")  # fmt: skip
    assert effect > 100 * max(gap, 1e-12), "the trained adapters change the model"
    assert diff <= 10 * gap


def test_lora_actor_with_one_step_off_and_a_reward_model(assets, tmp_path):
    """A LoRA actor (share_backbone) in PPO with a reward model and async_mode one_step_off, 2 iterations on one
    device (`integrated_rm_run`'s settings): the second batch trains one version after it was sampled (its logprobs
    further from the trainer's than the first's); the KL to the shared-backbone reference is rounding while the
    behaviour policy is the backbone (B = 0); the reward model scores; and the save holds the start's backbone bit for
    bit with the adapters moved."""
    from tests.trainer.rl_helpers import ONE_DEVICE, checkpoint_tensors

    one_device = [x for x in ONE_DEVICE if not x.startswith("megatron_training.train_iters=")]
    cfg = _config("ppo_tiny_cpu_rm", assets, tmp_path / "run", f"reward_config.load={assets / 'critic'}", *one_device,
                  *LORA[:4], "+rl_config.share_backbone=true", "rl_config.async_mode=one_step_off",
                  "megatron_training.train_iters=2", "megatron_training.save_interval=2")  # fmt: skip
    _, _, lines, _ = _train(cfg)
    assert [m["async/staleness/max"] for m in lines] == [0.0, 1.0]
    # one_step_off's reward KL is the behaviour policy's (the rollout's logprobs) to the reference: both batches were
    # sampled at version 0, where B = 0 and the actor is its backbone, so the KL is the engine's rounding alone
    kl = [m["actor/reward_kl_penalty"] for m in lines]
    assert all(abs(k) <= m["rollout/logprob_diff_max"] for k, m in zip(kl, lines)), (kl, lines)
    assert lines[0]["rollout/logprob_diff_max"] < cfg.rl_config.logprob_diff_warn  # version 0 sampled, version 0 scored
    # the second batch is scored by the trainer one update later: the moved adapters are further from the engine
    assert lines[1]["rollout/logprob_diff_mean"] > lines[0]["rollout/logprob_diff_mean"]
    assert all(torch.isfinite(torch.tensor(m["reward_model/score/mean"])) for m in lines)
    (tmp_path / "scratch").mkdir()
    start = checkpoint_tensors(assets / "actor", tmp_path / "scratch")
    saved = checkpoint_tensors(tmp_path / "run" / "ckpt_actor", tmp_path / "scratch")
    backbone = [k for k in start if not k.startswith("optim/")]
    assert backbone and set(backbone) <= set(saved), sorted(set(backbone) - set(saved))[:5]
    assert all(torch.equal(start[k], saved[k]) for k in backbone)
    moved = [k for k in saved if "lora_B" in k and not k.startswith("optim/") and saved[k].abs().max() > 0]
    assert moved, sorted(saved)[:20]
    print(f"one_step_off + reward model through adapters: KL {kl}, {len(moved)} adapter B matrices moved")
