"""A tiny LoRA GRPO run through the trainer (one start) from the quickstart task's SFT start (`sft_assets`): the actor
trains adapters on its frozen backbone, the reference is that backbone with the adapters off (share_backbone: no
reference model is loaded), the rollout engine runs the merged weights each step, so the every-step
rollout-vs-trainer logprob check holds, and the reward rises by a bound measured over seeds. Its checkpoint exports
with mindrl-convert as a merged HF model and, with --adapter-only, as a PEFT directory that peft loads onto the base
model with the merged export's logits. A second start resumes it from its iteration-28 checkpoint: iterations 29-30
give the same metrics and the same final adapters, backbone and optimizer state bit for bit."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from tests.trainer.rl_helpers import LEARN_ITERS, _config, _train, assert_same_checkpoints
from tools.check_learning import BOUNDS, assert_rises

pytestmark = pytest.mark.slow

TARGETS = "[linear_qkv,linear_proj,linear_fc1,linear_fc2]"
# r 8, alpha 16 (MindSpeed-RL's defaults) on every linear; LoRA's learning rate is 10x the full fine-tune's 3e-4.
LORA = [f"+actor_config.lora_target_modules={TARGETS}", "+actor_config.lora_r=8", "+actor_config.lora_alpha=16",
        "actor_config.lr=3e-3", "+rl_config.share_backbone=true", f"megatron_training.train_iters={LEARN_ITERS}",
        f"megatron_training.save_interval={LEARN_ITERS}", "rl_config.use_tensorboard=false"]  # fmt: skip
RESUME_AT = LEARN_ITERS - 2  # the learning run also saves here (save_interval), and the resumed start runs the rest


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
    cfg = _config("grpo_tiny_cpu", assets, run_dir, *LORA, f"megatron_training.save_interval={RESUME_AT}")
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

    # Exact resume through adapters: the run's copy cut back to its iteration-28 checkpoint, resumed to the end.
    from mindrl.checkpoint import mcore_ckpt as ckpts

    split_dir = tmp_path / "split"
    shutil.copytree(run_dir, split_dir)
    shutil.rmtree(split_dir / "ckpt_actor" / ckpts.iteration_dir("", LEARN_ITERS).lstrip("/"))
    ckpts.write_tracker(str(split_dir / "ckpt_actor"), RESUME_AT)
    resume = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]
    cfg = _config("grpo_tiny_cpu", assets, split_dir, *LORA, *resume, actor_load=split_dir / "ckpt_actor")
    _, results, split, _ = _train(cfg)
    assert [r.iteration for r in results] == [RESUME_AT + 1, LEARN_ITERS]  # only the rest ran
    assert [m["iteration"] for m in split] == list(range(1, LEARN_ITERS + 1))  # metrics.jsonl cut back, appended
    for a, b in zip(lines[RESUME_AT:], split[RESUME_AT:]):
        a, b = ({k: v for k, v in m.items() if not k.startswith("timing/") and not k.endswith("_tps")} for m in (a, b))
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}  # bit for bit
    assert_same_checkpoints(ckpt, split_dir / "ckpt_actor", tmp_path)


def _lora_sft_save(assets, d):
    """A mindrl-sft LoRA save of the tiny policy with LORA's adapters (`grpo_smollm2_cpu.sh lora`'s SFT -> RL hand-over
    in small): 2 steps on the task's problems answered in the boxed format, on the shared 4-rank pool (~2 s)."""
    import io

    import yaml

    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig
    from mindrl.preflight import load_sft_config
    from mindrl.trainer import sft
    from tests.conftest import shared_pool

    rows = [
        {"problem": r["problem"], "solution": f"\\boxed{{{r['answer']}}}"}
        for r in json.loads((assets / "task.json").read_text())
    ]
    (d / "sft.json").write_text(json.dumps(rows))
    preprocess(PreprocessConfig(input=str(d / "sft.json"), tokenizer_name_or_path=str(assets / "hf"),
                                output_prefix=str(d / "data" / "sft"), handler_name="AlpacaStyleInstructionHandler",
                                prompt_type="qwen", map_keys={"prompt": "problem", "response": "solution"}),
               log=io.StringIO())  # fmt: skip
    mt = {"stage": "sft", "data_path": str(d / "data" / "sft"), "tokenizer_name_or_path": str(assets / "hf"),
          "load": str(assets / "actor"), "save": str(d / "ckpt"), "run_dir": str(d / "run"), "world_size": 4,
          "micro_batch_size": 1, "global_batch_size": 4, "seq_length": 64, "train_iters": 2, "lr": 1.0e-2,
          "lr_decay_style": "constant", "use_tensorboard": False, "seed": 7,
          "lora_target_modules": TARGETS[1:-1].split(","), "lora_r": 8, "lora_alpha": 16}  # fmt: skip
    (d / "sft_lora.yaml").write_text(yaml.safe_dump({"megatron_training": mt}))
    return sft.train_sft(load_sft_config("sft_lora", str(d)), pool=shared_pool(), log=lambda line: None).save_dir


def test_lora_sft_save_into_an_rl_run_with_one_step_off_and_a_reward_model(assets, tmp_path):
    """A mindrl-sft LoRA save (`_lora_sft_save`) is the start of a LoRA actor (share_backbone) in PPO with a reward
    model and async_mode one_step_off, 2 iterations on one device (`integrated_rm_run`'s settings): the run loads the
    SFT's adapters (the KL from the behaviour policy, the SFT model, to the shared reference, its backbone, is well
    above the engine's rounding, where a fresh B = 0 would leave rounding alone), the engine samples from the merged
    SFT adapters (the first batch's rollout-vs-trainer gap under the warning); the second batch trains one version
    after it was sampled (its logprobs further from the trainer's than the first's); the reward model scores; and the
    save holds the base backbone bit for bit with the SFT's adapters trained on."""
    from tests.trainer.rl_helpers import ONE_DEVICE, checkpoint_tensors

    (tmp_path / "sft").mkdir()
    t0 = time.perf_counter()
    sft_save = _lora_sft_save(assets, tmp_path / "sft")
    sft_s = time.perf_counter() - t0
    one_device = [x for x in ONE_DEVICE if not x.startswith("megatron_training.train_iters=")]
    cfg = _config("ppo_tiny_cpu_rm", assets, tmp_path / "run", f"reward_config.load={assets / 'critic'}", *one_device,
                  *LORA[:4], "+rl_config.share_backbone=true", "rl_config.async_mode=one_step_off",
                  "megatron_training.train_iters=2", "megatron_training.save_interval=2",
                  actor_load=sft_save)  # fmt: skip
    _, _, lines, _ = _train(cfg)
    assert [m["async/staleness/max"] for m in lines] == [0.0, 1.0]
    # one_step_off's reward KL is the behaviour policy's (the rollout's logprobs) to the reference: both batches were
    # sampled at version 0, the SFT's adapters, against the backbone with the adapters off
    kl = [m["actor/reward_kl_penalty"] for m in lines]
    rounding = lines[0]["rollout/logprob_diff_max"]  # version 0 sampled, version 0 scored: the engine's rounding
    assert rounding < cfg.rl_config.logprob_diff_warn
    assert all(k > 1000 * rounding for k in kl), (kl, rounding)
    # the second batch is scored by the trainer one update later: the moved adapters are further from the engine
    assert lines[1]["rollout/logprob_diff_mean"] > lines[0]["rollout/logprob_diff_mean"]
    assert all(torch.isfinite(torch.tensor(m["reward_model/score/mean"])) for m in lines)
    (tmp_path / "scratch").mkdir()
    base = checkpoint_tensors(assets / "actor", tmp_path / "scratch")
    start = checkpoint_tensors(sft_save, tmp_path / "scratch")
    saved = checkpoint_tensors(tmp_path / "run" / "ckpt_actor", tmp_path / "scratch")
    backbone = [k for k in base if not k.startswith("optim/")]
    assert backbone and set(backbone) <= set(saved), sorted(set(backbone) - set(saved))[:5]
    assert all(torch.equal(base[k], saved[k]) for k in backbone)
    b = [k for k in start if ".lora.lora_B." in k and not k.startswith("optim/")]
    assert len(b) == 4 and all(start[k].abs().max() > 0 for k in b), b  # the SFT moved B off its zero start
    assert all(not torch.equal(start[k], saved[k]) for k in b), b  # and the RL run trained them on
    print(
        f"LoRA SFT save -> one_step_off + reward model through adapters: KL {kl}, rollout-vs-trainer max |logprob "
        f"diff| {[m['rollout/logprob_diff_max'] for m in lines]}; the SFT save took {sft_s:.1f} s"
    )
