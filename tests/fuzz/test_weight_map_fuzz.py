"""Property-based fuzzing of the HF <-> megatron weight map: for random layer counts, head layouts,
TP/PP, tied or untied embeddings and value (--orm) models, every name and every tensor round-trips."""

from __future__ import annotations

import re
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

BOUNDED = dict(derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """(spec, tp, pp) with TP dividing heads, kv heads, ffn and vocab, and PP dividing the layers."""
    tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    kv_heads = tp * draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 2, 4]))
    orm = draw(st.booleans())
    family = draw(st.sampled_from(["Qwen2", "Llama"]))
    arch = f"{family}ForSequenceClassification" if orm else f"{family}ForCausalLM"
    cfg = {
        "architectures": [arch],
        "hidden_size": draw(st.integers(2, 6)),
        "intermediate_size": tp * draw(st.integers(1, 3)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": pp * draw(st.integers(1, 3)),
        "vocab_size": tp * draw(st.integers(1, 4)),
        "tie_word_embeddings": draw(st.booleans()),
    }
    if orm:
        cfg["num_labels"] = 1
    spec = ModelSpec.from_hf_config(cfg)
    spec.validate_layout(tp, pp)
    return spec, tp, pp


def _hf_shape(spec: ModelSpec, hf_name: str) -> tuple[int, ...]:
    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    rows = {"q_proj": spec.num_heads * hd, "k_proj": spec.num_kv_heads * hd, "v_proj": spec.num_kv_heads * hd}
    for proj, n in rows.items():
        if f".{proj}." in hf_name:
            return (n,) if hf_name.endswith("bias") else (n, h)
    if "o_proj" in hf_name:
        return (h, spec.num_heads * hd)
    if "gate_proj" in hf_name or "up_proj" in hf_name:
        return (ffn, h)
    if "down_proj" in hf_name:
        return (h, ffn)
    if hf_name.endswith("norm.weight"):
        return (h,)
    if hf_name == "score.weight":
        return (1, h)
    return (spec.vocab_size, h)  # embed_tokens, lm_head


@settings(max_examples=60, deadline=None, **BOUNDED)
@given(layouts())
def test_every_name_maps_once_and_back(layout):
    spec, _, pp = layout
    names = mcore_param_names(spec)
    assert len(set(names)) == len(names)
    hf_names = [hf for n in names for hf in param_mapping(spec, n).hf_names]
    expected = expected_hf_names(spec)
    # every HF tensor comes from exactly one megatron parameter (tied: the embedding only)
    assert Counter(hf_names) == Counter(expected), Counter(hf_names) - Counter(expected)
    assert ("lm_head.weight" in expected) == (not spec.is_value_model and not spec.tie_word_embeddings)
    assert ("score.weight" in expected) == spec.is_value_model
    assert any(n.endswith("bias") for n in expected) == spec.qkv_bias
    # HF name -> the megatron parameter it belongs to, and the layer number survives both ways
    owner = {hf: n for n in names for hf in param_mapping(spec, n).hf_names}
    for hf, mcore in owner.items():
        assert param_mapping(spec, mcore).mcore_name == mcore
        hf_layer, mcore_layer = re.search(r"layers\.(\d+)\.", hf), re.search(r"layers\.(\d+)\.", mcore)
        assert (hf_layer and hf_layer.group(1)) == (mcore_layer and mcore_layer.group(1)), (hf, mcore)
    # pipeline stages number layers from 0; made global they cover each layer exactly once
    per_stage = spec.num_layers // pp
    stage_names = []
    for name in names:
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
        if m:
            stage, local_layer = divmod(int(m.group(1)), per_stage)
            stage_names.append(global_name(f"decoder.layers.{local_layer}.{m.group(2)}", stage * per_stage))
    assert sorted(stage_names) == sorted(n for n in names if ".layers." in n)


@settings(max_examples=40, deadline=None, **BOUNDED)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_every_tensor_round_trips_through_full_and_tp_shards(layout, seed):
    spec, tp, _ = layout
    gen = torch.Generator().manual_seed(seed)
    for name in mcore_param_names(spec):
        mapping = param_mapping(spec, name)
        hf = [torch.randn(_hf_shape(spec, n), generator=gen) for n in mapping.hf_names]
        full = hf_to_full(spec, mapping, hf)
        shards = [full_to_local(mapping, full, rank, tp) for rank in range(tp)]
        if mapping.tp_split != "replicated" and tp > 1:
            assert len({s.shape for s in shards}) == 1 and sum(s.numel() for s in shards) == full.numel(), name
        back = full_to_hf(spec, mapping, local_to_full(mapping, shards))
        assert [n for n, _ in back] == list(mapping.hf_names)
        for (hf_name, t), original in zip(back, hf):
            assert torch.equal(t, original), (name, hf_name, tp)
        direct = shards_to_hf(spec, mapping, shards)  # the streamer's one-copy form: the same tensors
        assert [n for n, _ in direct] == list(mapping.hf_names)
        for (hf_name, t), original in zip(direct, hf):
            assert torch.equal(t, original), (name, hf_name, tp)
