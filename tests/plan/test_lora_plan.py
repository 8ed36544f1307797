"""The planner with LoRA: the adapters alone carry gradients and optimizer state, and under share_backbone the reference
holds no weights of its own. MindSpeed-RL's grpo_lora_qwen25_32b_A2 loads unchanged and plans as FITS; the full
fine-tuning it is compared with is the same recipe without its LoRA keys."""

from __future__ import annotations

from mindrl.config import load_config
from mindrl.config.settings import LORA_TARGETS
from mindrl.plan import adapter_params, make_plan
from mindrl.plan import memory as mem

NAME = "grpo_lora_qwen25_32b_A2"


def _recipe(lora: bool):
    if lora:
        cfg = load_config(NAME)
        assert cfg.actor_config.lora_target_modules == list(LORA_TARGETS) and cfg.rl_config.share_backbone
        return cfg
    return load_config(NAME, overrides=["megatron_training.lora_target_modules=[]", "rl_config.share_backbone=false"])


def test_lora_recipe_plans_adapters_and_one_backbone():
    lora, full = _recipe(True), _recipe(False)
    a = lora.actor_config
    assert (a.lora_r, a.lora_alpha, a.tp, a.pp) == (128, 128.0, 4, 4)
    plan, full_plan = make_plan(lora), make_plan(full)
    assert plan.device.key == "910b" and plan.verdict["fits"], plan.verdict
    adapters = adapter_params(lora.model, a.lora_target_modules, a.lora_r, a.tp, a.pp)
    # Qwen2.5-32B, r 128, every linear: 5.67 M adapter parameters per layer per TP4 rank, 16 layers per stage.
    assert adapters == 16 * (128 * 5120 + 56 * 128 // 4 * 128 + 128 * 1280 + 5120 * 128 + 128 * 5120
                             + 2 * 27648 // 4 * 128 + 128 * 6912 + 5120 * 128)  # fmt: skip
    dev = plan.memory["actor"]["train"]
    assert dev["grads_bytes"] == adapters * mem.GRAD_BYTES
    assert dev["optimizer_bytes"] == mem.optimizer_bytes(adapters, "bfloat16", True, 1)
    assert all(v == 0 for phase in ("rollout", "score", "train")
               for k, v in plan.memory["reference"][phase].items() if k == "weights_bytes")  # fmt: skip
    assert full_plan.memory["reference"]["score"]["weights_bytes"] > 0
    assert plan.memory["actor"]["score"]["weights_bytes"] > 0, "the shared reference pass needs the actor's weights"
    # The reshard's merge of the largest adapted linear, linear_fc1's TP4 shard (n = 2 x 27648 / 4 x 5120): its fp32
    # copy with B A added (4n), then the bf16 result (2n); counted with the rollout, not at all without LoRA.
    assert plan.memory["actor"]["rollout"]["merge_buffer_bytes"] == 6 * (2 * 27648 // 4 * 5120)
    assert "merge_buffer_bytes" not in full_plan.memory["actor"]["rollout"]
    train, full_train = plan.memory["total"]["train_bytes"], full_plan.memory["total"]["train_bytes"]
    print(f"{NAME} per device: train {train / 2**30:.2f} GiB with LoRA, {full_train / 2**30:.2f} GiB full; "
          f"peak {plan.verdict['peak_bytes'] / 2**30:.2f} GiB in {plan.verdict['peak_phase']}")  # fmt: skip
    assert train < full_train
