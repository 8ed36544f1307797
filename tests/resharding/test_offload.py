"""Offload / onload of params, grads and optimizer state around a rollout: the device bytes really drop,
everything comes back bit-identical, and training continues exactly as without offload."""

from __future__ import annotations

import pytest

from mindrl.checkpoint import convert
from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import expected_hf_names
from mindrl.resharding import OffloadConfig
from tests.resharding import rank_fns


@pytest.fixture(scope="module")
def saved_untied(tiny_models, tmp_path_factory, get_pool):
    out = str(tmp_path_factory.mktemp("offload_src") / "untied")
    convert.hf2mcore(tiny_models["untied"], out, 2, 1, pool=get_pool())
    return out


def test_offload_config_from_generate_config():
    cfg = OffloadConfig.from_generate_config({"offload_train_optimizer": True, "offload_train_param": True})
    assert cfg.kinds == ("param", "optimizer")
    assert OffloadConfig().kinds == ()


@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1)])
def test_offload_round_trip_is_exact(pool, tiny_models, saved_untied, tp, pp):
    results = pool.run(rank_fns.offload_round_trip, saved_untied, tp, pp)
    n_names = len(expected_hf_names(ModelSpec.from_hf_dir(tiny_models["untied"])))
    for rank, r in enumerate(results):
        where = f"TP{tp}xPP{pp} rank {rank}"
        # The device side of the trainer (params, grad buffers, optimizer state) drops to ~0 ...
        assert r["bytes_offloaded"] < 0.01 * r["bytes_before"], (where, r["bytes_offloaded"], r["bytes_before"])
        assert r["kinds_offloaded"] == {"param": 0, "grad": 0, "optimizer": 0}, where
        assert all(r["kinds_before"][k] > 0 for k in ("param", "grad", "optimizer")), (where, r["kinds_before"])
        assert r["host_bytes"] == sum(r["kinds_before"].values()) == sum(r["moved"].values()), where
        # ... comes back bit-identical ...
        assert r["bytes_after"] == r["bytes_before"] and r["restored_identical"], where
        assert sum(r["onloaded"].values()) == r["host_bytes"], where
        # ... the engine got the weights in between, and training continues exactly as without offload.
        assert r["received"] == n_names, where
        assert r["losses"] == r["ref_losses"] and r["final_equal"], (where, r["losses"], r["ref_losses"])
        # the steps after it ran with swap_optimizer's schedule: the state on the device in each step only
        sw = r["swapped"]
        assert sw["between"] == [0, 0] and sw["in_step"] == [r["kinds_before"]["optimizer"]] * 2, (where, sw)


def test_plain_module_offload_round_trip():
    """A module without megatron DDP (e.g. a reference model) offloads too: its `buffers` is a method."""
    import torch

    from mindrl.resharding import OffloadConfig, TrainStateOffloader

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    before = [p.detach().clone() for p in model.parameters()]
    offloader = TrainStateOffloader([model], None, OffloadConfig(False, False, True))
    total = offloader.device_bytes()["param"]
    assert total == sum(p.numel() * 4 for p in model.parameters())
    offloader.offload()
    assert offloader.device_bytes()["param"] == 0
    offloader.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
