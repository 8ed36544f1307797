"""TR-DPO reference sync through the trainer (rl_config.sync_ref_model, K=1, alpha=0.5, tiny GRPO with the KL in the
loss): every iteration reports the sync, each checkpoint holds the synced reference (ref/), and a run resumed from
iteration 2 computes iteration 3 exactly as the uninterrupted run did, KL loss included, so the reference it
restored is the synced one, not ref_model_load_path's original."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.trainer.rl_helpers import _config, _train
from tests.trainer.test_resume import RESUME, _comparable

pytestmark = pytest.mark.slow

# The tiny policy scores 0 on the task (zero advantages): the entropy bonus is what moves it, hence the KL.
SYNC = ["rl_config.entropy_coeff=0.01", "rl_config.sync_ref_model=true", "rl_config.ref_model_sync_steps=1", "rl_config.ref_model_mixup_alpha=0.5",
        "megatron_training.save_interval=2", "rl_config.use_tensorboard=false"]  # fmt: skip


def _dcp_tensors(it_dir, out) -> dict:
    """The float tensors of a dist-checkpoint directory, read offline (no process group) through the file out."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(it_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_synced_reference_is_saved_and_resumed_exactly(assets, tmp_path):
    from mindrl.checkpoint.resume import find_resume

    base = tmp_path / "straight"
    _, _, straight, _ = _train(_config("grpo_tiny_cpu", assets, base, "megatron_training.train_iters=3", *SYNC))
    assert [m["actor/ref_synced"] for m in straight] == [1.0, 1.0, 1.0]
    assert all(m["timing/ref_sync"] > 0 and m["actor/kl_loss"] > 0 for m in straight[1:])
    it2 = base / "ckpt_actor" / "iter_0000002"
    assert json.loads((it2 / "trainer_state.json").read_text())["reference_saved"] is True
    # The saved reference is the mix, not the initial policy it started from.
    ref = _dcp_tensors(it2 / "ref" / "release", tmp_path / "ref.pt")
    original = _dcp_tensors(assets / "actor" / "release", tmp_path / "original.pt")
    assert ref.keys() == original.keys() and any(not ref[k].equal(original[k]) for k in ref)

    # Stopped after iteration 2: the copy's newest checkpoint is iteration 2.
    split = tmp_path / "split"
    shutil.copytree(base, split)
    shutil.rmtree(split / "ckpt_actor" / "iter_0000003")
    (split / "ckpt_actor" / "latest_checkpointed_iteration.txt").write_text("2")
    cfg = _config("grpo_tiny_cpu", assets, split, "megatron_training.train_iters=3", *SYNC,
                  *[f"actor_config.{k}" for k in RESUME], actor_load=split / "ckpt_actor")  # fmt: skip
    point = find_resume(cfg)
    assert point.iteration == 2 and point.ref_dir == str(split / "ckpt_actor" / "iter_0000002" / "ref")
    _, results, resumed, _ = _train(cfg)
    assert [r.iteration for r in results] == [3]
    a, b = _comparable(straight[2]), _comparable(resumed[2])
    assert a.keys() == b.keys()
    bad = {k: (a[k], b[k]) for k in a if not math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6)}
    assert not bad, bad
