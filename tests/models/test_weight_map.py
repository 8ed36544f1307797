"""The HF <-> megatron layouts: fused QKV by query group, gate/up, and TP shard rules."""

from __future__ import annotations

import pytest
import torch

from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import (
    expected_hf_names,
    full_to_hf,
    full_to_local,
    global_name,
    hf_to_full,
    local_to_full,
    mcore_param_names,
    param_mapping,
    shards_to_hf,
)

CFG = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "intermediate_size": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 10, "head_dim": 2,
}  # fmt: skip
SPEC = ModelSpec.from_hf_config(CFG)


def test_qkv_is_fused_by_query_group():
    """Group g holds [q heads of g..., k_g, v_g]; hand-built with row labels."""
    hd, h = 2, 8
    q = torch.arange(4 * hd).float().view(-1, 1).expand(-1, h) + 100  # heads 0..3
    k = torch.arange(2 * hd).float().view(-1, 1).expand(-1, h) + 200
    v = torch.arange(2 * hd).float().view(-1, 1).expand(-1, h) + 300
    m = param_mapping(SPEC, "decoder.layers.1.self_attention.linear_qkv.weight")
    assert m.hf_names == tuple(f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    fused = hf_to_full(SPEC, m, [q, k, v])
    rows = fused[:, 0].tolist()
    assert rows == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    back = dict(full_to_hf(SPEC, m, fused))
    assert all(torch.equal(back[n], t) for n, t in zip(m.hf_names, (q, k, v)))
    # TP2: each rank gets whole query groups.
    assert full_to_local(m, fused, 1, 2)[:, 0].tolist() == rows[8:]


def test_qkv_bias_and_gate_up_round_trip():
    mb = param_mapping(SPEC, "decoder.layers.0.self_attention.linear_qkv.bias")
    qb, kb, vb = torch.randn(8), torch.randn(4), torch.randn(4)
    out = dict(full_to_hf(SPEC, mb, hf_to_full(SPEC, mb, [qb, kb, vb])))
    assert torch.equal(out[mb.hf_names[0]], qb) and torch.equal(out[mb.hf_names[2]], vb)
    mf = param_mapping(SPEC, "decoder.layers.0.mlp.linear_fc1.weight")
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    full = hf_to_full(SPEC, mf, [gate, up])
    assert torch.equal(full[:6], gate) and torch.equal(full[6:], up)
    # Each TP rank holds [its gate rows; its up rows] (megatron's SwiGLU chunks the local output in two).
    local1 = full_to_local(mf, full, 1, 2)
    assert torch.equal(local1, torch.cat([gate[3:], up[3:]]))


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
                                  "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                                  "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"])  # fmt: skip
@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_reassemble_exactly(name, tp):
    m = param_mapping(SPEC, name)
    full = torch.randn(16, 8) if "qkv" in name else torch.randn(12, 8) if "fc1" in name else torch.randn(8, 6)
    shards = [full_to_local(m, full, r, tp) for r in range(tp)]
    assert torch.equal(local_to_full(m, shards), full)
    if m.tp_split == "row" and tp == 2:
        assert shards[0].shape == (8, 3)


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_to_hf_writes_each_tensor_once(tp):
    """The streamer's form equals reassemble-then-un-fuse; at TP2 every HF tensor of a fused parameter is one
    fresh contiguous tensor (written once, no intermediate TP=1 tensor), at TP1 a contiguous piece stays a view."""
    for name, shape in [("decoder.layers.0.self_attention.linear_qkv.weight", (16, 8)),
                        ("decoder.layers.0.self_attention.linear_qkv.bias", (16,)),
                        ("decoder.layers.0.mlp.linear_fc1.weight", (12, 8)),
                        ("decoder.layers.0.mlp.linear_fc2.weight", (8, 6))]:  # fmt: skip
        m = param_mapping(SPEC, name)
        full = torch.randn(shape)
        shards = [full_to_local(m, full, r, tp) for r in range(tp)]
        got, want = shards_to_hf(SPEC, m, shards), full_to_hf(SPEC, m, full)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert torch.equal(a, b) and a.is_contiguous(), name
            if tp == 2:
                assert all(a.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in shards)
    fc1 = param_mapping(SPEC, "decoder.layers.0.mlp.linear_fc1.weight")
    (_, gate), _ = shards_to_hf(SPEC, fc1, [torch.randn(12, 8)])
    assert gate._base is not None  # TP1: gate is a view of the shard


def test_names_cover_the_hf_checkpoint():
    names = expected_hf_names(SPEC)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert len(names) == 2 + 2 * 12 + 1  # embed + lm_head + 2 layers x (2 norms, q/k/v w+b, o, gate, up, down) + norm
    tied = ModelSpec.from_hf_config(dict(CFG, tie_word_embeddings=True))
    assert "lm_head.weight" not in expected_hf_names(tied) and "output_layer.weight" not in mcore_param_names(tied)
    orm = ModelSpec.from_hf_config(
        dict(CFG, architectures=["Qwen2ForSequenceClassification"], num_labels=1, tie_word_embeddings=True)
    )
    assert expected_hf_names(orm)[-1] == "score.weight"
    assert param_mapping(orm, "output_layer.weight").tp_split == "replicated"
    llama = ModelSpec.from_hf_config(dict(CFG, architectures=["LlamaForCausalLM"]))
    assert not any(n.endswith("bias") for n in expected_hf_names(llama))


def test_pipeline_stage_layer_numbers_are_made_global():
    assert global_name("decoder.layers.1.mlp.linear_fc2.weight", 4) == "decoder.layers.5.mlp.linear_fc2.weight"
    assert global_name("embedding.word_embeddings.weight", 4) == "embedding.word_embeddings.weight"
    with pytest.raises(KeyError, match="no HF mapping"):
        param_mapping(SPEC, "decoder.layers.0.self_attention.q_layernorm.weight")
