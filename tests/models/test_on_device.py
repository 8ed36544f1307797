"""The model path on the platform's accelerator (CUDA, or an NPU through torch_npu) against HF and against the CPU.

Skipped on a CPU-only host (CI, laptops; see tests/device.py): there the whole suite already runs this path on the
CPU. On a host with a device, one rank computes on it: the mcore model built from a converted checkpoint matches the HF model's logits
(actor, tied embeddings, critic values), and the actor's logprobs and one PPO update (KL loss on) give the same
numbers as the same computation on CPU ranks. Run it there with `pytest tests/models/test_on_device.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mindrl.platform.detect import current_platform
from tests.device import convert_on_cpu, needs_device, rank_pool

pytestmark = needs_device


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    """TP1 mcore checkpoints of the tiny HF models, converted on a CPU rank."""
    return convert_on_cpu(tiny_models, str(tmp_path_factory.mktemp("on_device")))


def _device_rank() -> str:
    from mindrl.platform.detect import current_platform

    return str(current_platform().device())


@pytest.mark.parametrize("variant", ["untied", "tied", "orm"])
def test_megatron_on_the_device_matches_hf(tiny_models, converted, monkeypatch, variant):
    from mindrl.checkpoint import convert

    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with rank_pool(monkeypatch, on_cpu=False) as pool:
        assert pool.run(_device_rank)[0].startswith(current_platform().name)
        ours = convert.megatron_outputs(pool, converted[variant], 1, 1, ids)
    ref = convert.hf_outputs(tiny_models[variant], ids)
    assert ours.device.type == "cpu" and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    print(f"{variant}: max |megatron on {current_platform().name} - HF on CPU| = {diff:.2e}")
    assert diff < 1e-4


def _logprobs_and_update_rank(load_dir: str, batch) -> dict:
    """Logprobs, one PPO update (KL loss against given reference logprobs) and the logprobs after it."""
    from mindrl.models.forward import model_device
    from mindrl.workers.rl_model import PPOLossSettings, ppo_update, response_logprobs
    from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer

    _, ddp, optimizer, scheduler = build_model_and_optimizer(load_dir, 1, 1, OptimSettings(lr=1e-3), total_steps=1)
    before = response_logprobs(ddp, batch, 4, 1.0)
    result = ppo_update(ddp, optimizer, scheduler, batch, "actor", PPOLossSettings(kl_loss_coef=0.04), 4, 1, 1)
    after = response_logprobs(ddp, batch, 4, 1.0)
    return {
        "device": str(model_device(ddp)),
        "before": before,
        "after": after,
        "metrics": result.metrics,
        "tokens": dataclasses.astuple(result.tokens),
    }


def test_logprobs_and_update_on_the_device_match_the_cpu(tiny_models, converted, monkeypatch):
    from tools.bench_update import make_batch

    batch = make_batch(prompts=4, n=2, prompt_len=12, response_len=10, vocab=512, kl=True)
    batch["response_mask"][::3, 6:] = 0  # ragged responses: the micro-batches are trimmed to their own widths
    batch["attention_mask"][::3, 12 + 6 :] = 0
    runs = {}
    for on_cpu in (True, False):
        with rank_pool(monkeypatch, on_cpu) as pool:
            runs["cpu" if on_cpu else "device"] = pool.run(_logprobs_and_update_rank, converted["untied"], batch)[0]
    cpu, dev = runs["cpu"], runs["device"]
    assert cpu["device"] == "cpu" and dev["device"].startswith(current_platform().name)
    assert dev["before"].device.type == "cpu" and dev["tokens"] == cpu["tokens"]
    before = (dev["before"] - cpu["before"]).abs().max().item()
    moved = (cpu["after"] - cpu["before"]).abs().max().item()
    after = (dev["after"] - cpu["after"]).abs().max().item()
    print(f"logprobs: max |device - cpu| {before:.2e} before the update, {after:.2e} after it (the update moved them "
          f"by up to {moved:.2e}); metrics cpu {cpu['metrics']} device {dev['metrics']}")  # fmt: skip
    assert before < 1e-4
    assert moved > 1e-3  # the update did change the policy, so `after` compares two updates
    assert after < 1e-2 * moved + 1e-4
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert dev["metrics"][key] == pytest.approx(cpu["metrics"][key], rel=1e-4, abs=1e-6), key
