"""Tiny Llama checkpoints through the same checks as Qwen2: HF -> megatron -> HF is bit-exact, and megatron's
logits (values for the ORM) equal HF's at TP1 / TP2 / PP2 / TP2xPP2, with plain RoPE and with Llama-3.1
("llama3") RoPE scaling. fp32 on CPU, gloo ranks of the shared pool."""

from __future__ import annotations

import pytest
import torch

import tests.conftest as conftest
from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.models.hf_config import ModelSpec
from tests.checkpoint.test_convert import assert_bit_exact

# name -> make_tiny_model overrides (all Llama: no q/k/v bias, GQA 4/2 heads, head_dim 32).
LLAMA_VARIANTS = {
    "llama": dict(arch="llama", num_layers=2, seed=21),
    "llama_tied_orm": dict(arch="llama", orm=True, tie_word_embeddings=True, num_layers=2, seed=22),
    # Same weights as "llama"; only the RoPE frequencies differ (context 8 x 8192, as Llama-3.1 declares).
    "llama_rope8": dict(arch="llama", num_layers=2, seed=21, rope_scaling_factor=8.0, max_position_embeddings=65536),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SEQ = 96  # long enough that the scaled (low) RoPE frequencies change the logits well above the parity bound


@pytest.fixture(scope="module")
def llama_models(tmp_path_factory) -> dict[str, str]:
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_llama")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in LLAMA_VARIANTS.items()}


@pytest.fixture(scope="module")
def saved_tp2(llama_models, tmp_path_factory) -> dict[str, str]:
    """Each variant converted once at TP2 (PP1); the parity tests load it at every layout."""
    return conftest.tp2_checkpoints(llama_models, tmp_path_factory.mktemp("llama_tp2"))


@pytest.fixture(scope="module")
def hf_reference(llama_models) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 1021, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return ids, {name: convert.hf_outputs(d, ids) for name, d in llama_models.items()}


def test_tiny_llama_config_maps_to_a_bias_free_spec(llama_models):
    plain, scaled = ModelSpec.from_hf_dir(llama_models["llama"]), ModelSpec.from_hf_dir(llama_models["llama_rope8"])
    assert (plain.architecture, plain.family, plain.qkv_bias, plain.rope_scaling_factor) == (
        "LlamaForCausalLM",
        "llama",
        False,
        None,
    )
    assert (scaled.rope_scaling_factor, scaled.rope_theta) == (8.0, 1e6)
    orm = ModelSpec.from_hf_dir(llama_models["llama_tied_orm"])
    assert (orm.architecture, orm.is_value_model, orm.tie_word_embeddings) == (
        "LlamaForSequenceClassification",
        True,
        True,
    )
    from mindrl.checkpoint.hf_io import HFCheckpoint

    names = HFCheckpoint(llama_models["llama"]).keys()
    assert not any(n.endswith(".bias") for n in names), "a Llama checkpoint has no biases"


@pytest.mark.parametrize("variant", ["llama", "llama_tied_orm", "llama_rope8"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_llama_round_trip_is_bit_exact(llama_models, pool, tmp_path, variant, tp, pp):
    orm = "orm" in variant
    convert.hf2mcore(llama_models[variant], str(tmp_path / "mcore"), tp, pp, orm=orm, pool=pool)
    spec, meta = mcore_ckpt.read_model_meta(str(tmp_path / "mcore"))
    assert (meta["tp"], meta["pp"], meta["role"], spec.family) == (tp, pp, "critic" if orm else "actor", "llama")
    convert.mcore2hf(str(tmp_path / "mcore"), str(tmp_path / "hf"), orm=orm, pool=pool)
    assert_bit_exact(llama_models[variant], str(tmp_path / "hf"))


@pytest.mark.parametrize("variant", ["llama", "llama_tied_orm", "llama_rope8"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_llama_megatron_matches_hf(pool, saved_tp2, hf_reference, variant, tp, pp):
    """Saved at TP2, loaded at TP1 / TP2 / PP2 / TP2xPP2: logits (values) equal HF's within 1e-5."""
    ids, ref = hf_reference
    ours = convert.megatron_outputs(pool, saved_tp2[variant], tp, pp, ids)
    assert ours.shape == ref[variant].shape
    assert ref[variant].abs().max() > 0.1  # non-trivial outputs: a mapping error cannot hide
    diff = (ours - ref[variant]).abs().max().item()
    print(f"{variant} tp{tp} pp{pp}: max |megatron - HF| = {diff:.3g}")
    assert diff < 1e-5, f"max abs diff {diff}"


def test_rope_scaling_changes_the_logits(pool, saved_tp2, hf_reference):
    """The scaled and the plain model share every weight: their logits differ only through the llama3 RoPE
    frequencies, by far more than the parity bound, so the parity above really covers the scaling (megatron
    without the scaling would fail it)."""
    ids, ref = hf_reference
    effect = (ref["llama_rope8"] - ref["llama"]).abs().max().item()
    print(f"max |scaled - plain| HF logits = {effect:.3g}")
    assert effect > 1e-3
    # And megatron's plain-RoPE model is as far from HF's scaled one as HF's own plain model is.
    plain = convert.megatron_outputs(pool, saved_tp2["llama"], 2, 1, ids)
    assert (plain - ref["llama_rope8"]).abs().max().item() == pytest.approx(effect, rel=1e-3)
