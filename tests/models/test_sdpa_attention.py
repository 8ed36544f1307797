"""SDPA core attention equals megatron's DotProductAttention: fp32 logits and grads of a tiny GQA model with
left-padded rows, at TP1 and TP2, the same loaded model run through both attention classes."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert


def _parity_rank(load_dir: str, tp: int, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mindrl.checkpoint import mcore_ckpt
    from mindrl.models.attention import SDPAttention
    from mindrl.models.forward import attention_inputs, forward_outputs

    _, _, model = mcore_ckpt.build_and_load(load_dir, tp, 1, "float32")
    cores = [m for m in model.modules() if isinstance(m, SDPAttention)]
    assert cores, "the layer spec must use SDPAttention"

    def run():
        logits = forward_outputs(model, ids, mask)
        model.zero_grad(set_to_none=True)
        pos, m = attention_inputs(ids, mask)
        model(ids, pos, m).float().pow(2).mean().backward()
        return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    new_logits, new_grads = run()
    for core in cores:
        core.__class__ = DotProductAttention
    old_logits, old_grads = run()
    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank():
        return None
    valid = mask.bool()
    logit_diff = (new_logits - old_logits)[valid].abs().max().item()
    grad_diff = max(
        ((new_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in old_grads.items()
    )
    return logit_diff, grad_diff, old_logits[valid].abs().max().item()


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory) -> str:
    import tests.conftest as conftest
    from mindrl.platform.launch import RankPool
    from tools.make_tiny_model import make_tiny_model

    if conftest._POOL is None or conftest._POOL.closed:
        conftest._POOL = RankPool(4, timeout_s=600)
    root = tmp_path_factory.mktemp("sdpa")
    hf = make_tiny_model(str(root / "hf"), arch="llama", num_layers=2, seed=31)
    convert.hf2mcore(hf, str(root / "mcore"), 2, 1, pool=conftest._POOL)
    return str(root / "mcore")


@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_matches_dot_product_attention(pool, tiny_tp2, tp):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (4, 40), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 17, 39)):  # left padding, down to a single real token
        mask[row, :pad] = 0
    results = [r for r in pool.run(_parity_rank, tiny_tp2, tp, ids, mask) if r is not None]
    logit_diff, grad_diff, scale = results[0]
    print(f"tp{tp}: max |sdpa - dpa| logits {logit_diff:.3g} (|logits| {scale:.3g}), grads rel {grad_diff:.3g}")
    assert scale > 0.1
    assert logit_diff < 1e-5
    assert grad_diff < 1e-4


def _dropout_rank(load_dir: str, ids: torch.Tensor, mask: torch.Tensor):
    from megatron.core import tensor_parallel

    from mindrl.checkpoint import mcore_ckpt
    from mindrl.models.attention import SDPAttention
    from mindrl.models.forward import attention_inputs

    _, _, model = mcore_ckpt.build_and_load(load_dir, 2, 1, "float32")
    for core in (m for m in model.modules() if isinstance(m, SDPAttention)):
        core.attention_dropout.p = 0.5
    model.train()
    pos, m = attention_inputs(ids, mask)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved, default = tracker.get_states(), torch.get_rng_state()
    first = model(ids, pos, m).detach()
    default_untouched = torch.equal(default, torch.get_rng_state())
    tracker.set_states(saved)
    again = model(ids, pos, m).detach()
    model.eval()
    plain = model(ids, pos, m).detach()
    return default_untouched, torch.equal(first, again), (first - plain).abs().max().item()


def test_attention_dropout_draws_from_the_tp_ranks_own_stream(pool, tiny_tp2):
    """As in DotProductAttention, dropout masks come from megatron's model-parallel RNG tracker (each TP rank its own
    stream), so the default generator, seeded alike on every TP rank, is left untouched; replaying the tracker
    replays the masks."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    for default_untouched, replayed, dropout_effect in pool.run(_dropout_rank, tiny_tp2, ids, mask)[:2]:
        assert default_untouched and replayed
        assert dropout_effect > 1e-3
