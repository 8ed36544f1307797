"""Train -> infer weight stream: bit-exact HF tensors on every rank at every train layout, bounded memory."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert
from mindrl.checkpoint.hf_io import HFCheckpoint
from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import expected_hf_names
from tests.resharding import rank_fns

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def assert_same_tensors(got: dict, want: dict, where: str) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want), f"{where}: names {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{where}: {k} {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}"
        )
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), f"{where}: {k} differs"


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory):
    """untied / tied converted once at TP2 (the tests load them at every layout: dist-ckpt reshards)."""
    from tests.conftest import _POOL

    root = tmp_path_factory.mktemp("reshard_src")
    return {
        v: convert.hf2mcore(tiny_models[v], str(root / v), 2, 1, pool=_POOL) and str(root / v)
        for v in ("untied", "tied")
    }


@pytest.mark.parametrize("variant", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_stream_is_bit_exact_on_every_rank(pool, tiny_models, saved, variant, tp, pp):
    spec = ModelSpec.from_hf_dir(tiny_models[variant])
    want = hf_tensors(tiny_models[variant])
    results = pool.run(rank_fns.stream_checkpoint, saved[variant], tp, pp, 0.05)
    for rank, res in enumerate(results):
        assert res["order"] == expected_hf_names(spec), f"rank {rank}: emitted order"
        assert ("lm_head.weight" in res["order"]) == (not spec.tie_word_embeddings)
        assert_same_tensors(res["tensors"], want, f"TP{tp}xPP{pp} rank {rank}")
