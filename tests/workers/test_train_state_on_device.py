"""The trainer's state around the model, on the platform's accelerator (CUDA, or an NPU through torch_npu): offload
and onload around a rollout, the weight stream to the rollout engine, and exact resume from a checkpoint.

Skipped on a CPU-only host (see tests/device.py). On a device, one rank runs each check with torch's deterministic
algorithms on, so that "exact" can mean bit for bit there as it does on the CPU:
- offload of params, grads and optimizer state frees the device allocator's bytes, onload restores them bit for
  bit, and training then continues exactly as a run without the offload;
- the weights streamed from the device rank equal (bit for bit, in name and order) those streamed from a CPU rank;
- N optimizer steps straight equal N/2 steps, a checkpoint, a fresh model + optimizer loading it, and N/2 more
  (weights, main params, Adam moments and steps), with megatron's plain optimizer and its distributed one, in fp32
  and bf16.
"""

from __future__ import annotations

import os

import pytest

from mindrl.checkpoint.mcore_ckpt import iteration_dir
from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import expected_hf_names
from mindrl.platform.detect import current_platform
from mindrl.workers.train_setup import OptimSettings
from tests.device import convert_on_cpu, deterministic_run, needs_device, rank_pool
from tests.resharding import rank_fns
from tests.workers import distopt_rank_fns
from tests.workers.test_distopt_resume import compare_runs

pytestmark = needs_device

STEPS = 4


@pytest.fixture(scope="module")
def actor(tiny_models, tmp_path_factory) -> str:
    return convert_on_cpu({"untied": tiny_models["untied"]}, str(tmp_path_factory.mktemp("state_on_device")))["untied"]


def _device_type() -> str:
    return current_platform().name


def test_offload_frees_the_device_and_restores_it_exactly(tiny_models, actor, monkeypatch):
    with rank_pool(monkeypatch, on_cpu=False) as pool:
        run = pool.run(deterministic_run, rank_fns.offload_round_trip, actor, 1, 1)[0]
    r, alloc = run["result"], run["result"]["allocated"]
    mib = 1 << 20
    print(
        f"offload on {_device_type()}: moved {r['moved']} bytes; allocator {alloc['before'] / mib:.1f} MiB before, "
        f"{alloc['offloaded'] / mib:.1f} offloaded, {alloc['onloaded'] / mib:.1f} onloaded; losses {r['losses']} vs "
        f"{r['ref_losses']} without offload; ops without a deterministic kernel: {run['nondeterministic']}"
    )
    assert r["kinds_offloaded"] == {"param": 0, "grad": 0, "optimizer": 0}
    assert all(r["kinds_before"][k] > 0 for k in ("param", "grad", "optimizer")), r["kinds_before"]
    assert r["host_bytes"] == sum(r["kinds_before"].values()) == sum(r["moved"].values())
    assert r["bytes_after"] == r["bytes_before"] and r["restored_identical"]
    assert r["received"] == len(expected_hf_names(ModelSpec.from_hf_dir(tiny_models["untied"])))
    if _device_type() != "cpu":  # the allocator itself gives the bytes back (the CPU has no device allocator)
        assert alloc["before"] - alloc["offloaded"] >= 0.99 * r["host_bytes"], (alloc, r["host_bytes"])
        assert abs(alloc["onloaded"] - alloc["before"]) <= mib, alloc
    assert r["losses"] == r["ref_losses"] and r["final_equal"], (r["losses"], r["ref_losses"])


def test_weight_stream_from_the_device_matches_the_cpu(actor, monkeypatch):
    runs = {}
    for on_cpu in (True, False):
        with rank_pool(monkeypatch, on_cpu) as pool:
            runs[on_cpu] = pool.run(deterministic_run, rank_fns.stream_checkpoint, actor, 1, 1, 64.0)[0]
    cpu, dev = runs[True], runs[False]
    assert cpu["devices"] == ["cpu"] and dev["devices"] == [_device_type()]  # where the streamed tensors were
    assert dev["result"]["order"] == cpu["result"]["order"]
    unequal = [n for n, t in cpu["result"]["tensors"].items() if not t.equal(dev["result"]["tensors"][n])]
    print(f"stream from {_device_type()}: {len(dev['result']['order'])} tensors, {len(unequal)} unequal to the CPU's")
    assert not unequal


@pytest.mark.parametrize(
    "distributed,dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")], ids=["adam", "distopt", "bf16"]
)
def test_resume_on_the_device_is_exact(actor, monkeypatch, tmp_path, distributed, dtype):
    optim = OptimSettings(lr=1e-3, clip_grad=1.0, weight_decay=0.01, use_distributed_optimizer=distributed)
    with rank_pool(monkeypatch, on_cpu=False) as pool:
        straight = pool.run(deterministic_run, distopt_rank_fns.train_straight, actor, 1, optim, dtype, STEPS, 0)[0]
        resumed = pool.run(
            deterministic_run, distopt_rank_fns.train_resumed, actor, 1, optim, dtype, STEPS, 0, str(tmp_path / "ck")
        )[0]
    assert _device_type() in straight["devices"] and _device_type() in resumed["devices"]  # (Adam's step: host)
    diff = compare_runs([straight["result"]], [resumed["result"]])
    losses = straight["result"]["losses"]
    print(
        f"resume on {_device_type()} ({'distributed' if distributed else 'plain'} optimizer, {dtype}): straight vs "
        f"resumed max abs diffs {diff}; losses {losses}; ops without a deterministic kernel: "
        f"{sorted(set(straight['nondeterministic']) | set(resumed['nondeterministic']))}"
    )
    assert losses[0] != losses[-1]  # the steps really trained
    assert all(v == 0.0 for v in diff.values()), diff
    assert {e["step"].item() for e in resumed["result"]["optim"]} == {float(STEPS)}
    assert os.path.isdir(iteration_dir(str(tmp_path / "ck"), STEPS // 2))  # the resume went through a checkpoint
