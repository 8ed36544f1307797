"""HF config -> ModelSpec -> TransformerConfig mapping, and the errors for what is not supported."""

from __future__ import annotations

import json

import pytest
import torch

from mindrl.models.hf_config import ModelConfigError, ModelSpec

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": 131072,
}  # fmt: skip
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip


def test_qwen25_maps_every_field():
    s = ModelSpec.from_hf_config(QWEN25_7B)
    assert (s.family, s.is_value_model, s.qkv_bias, s.tie_word_embeddings) == ("qwen2", False, True, False)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.ffn_hidden_size) == (28, 4, 128, 18944)
    assert (s.rope_theta, s.norm_eps, s.dtype, s.rope_scaling_factor) == (1e6, 1e-6, "bfloat16", None)
    c = s.transformer_config(tp=4, pp=2)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (
        28,
        3584,
        28,
        4,
        128,
    )
    assert c.normalization == "RMSNorm" and c.gated_linear_unit and c.add_qkv_bias and not c.add_bias_linear
    assert c.activation_func is torch.nn.functional.silu and c.layernorm_epsilon == 1e-6
    assert c.params_dtype == torch.bfloat16 and c.bf16 and c.pipeline_dtype == torch.bfloat16
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size) == (4, 2)
    assert s.transformer_config(dtype="float32").params_dtype == torch.float32


def test_llama31_rope_scaling_and_no_bias():
    s = ModelSpec.from_hf_config(LLAMA31_8B)
    assert (s.family, s.qkv_bias, s.rope_scaling_factor, s.rope_theta) == ("llama", False, 8.0, 500000.0)
    assert not s.transformer_config().add_qkv_bias


def test_transformers5_rope_parameters_and_dtype_keys():
    cfg = dict(QWEN25_7B)
    del cfg["rope_theta"], cfg["torch_dtype"]
    cfg.update(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, dtype="float32")
    s = ModelSpec.from_hf_config(cfg)
    assert (s.rope_theta, s.dtype) == (5000.0, "float32")


def test_sequence_classification_is_a_value_model():
    cfg = dict(QWEN25_7B, architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    assert ModelSpec.from_hf_config(cfg).is_value_model
    with pytest.raises(ModelConfigError, match="needs num_labels=1, got 2"):
        ModelSpec.from_hf_config(dict(cfg, num_labels=2))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"architectures": ["MixtralForCausalLM"]},
            "architecture 'MixtralForCausalLM' is not supported; supported: Qwen2ForCausalLM",
        ),
        ({"architectures": []}, "'architectures' must name exactly one class"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
        ({"rope_scaling": dict(LLAMA31_8B["rope_scaling"], high_freq_factor=2.0)}, "rope_scaling llama3 with"),
        ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads=5"),
        ({"hidden_size": None}, "required field 'hidden_size' is missing"),
        ({"torch_dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"quantization_config": {"bits": 4}}, "quantization_config="),
    ],
)
def test_unsupported_fields_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelSpec.from_hf_config(dict(QWEN25_7B, **change), source="cfg.json")


def test_layout_errors_name_each_dimension():
    s = ModelSpec.from_hf_config(QWEN25_7B)  # 28 heads, 4 kv heads, ffn 18944, 28 layers
    with pytest.raises(ModelConfigError) as e:
        s.validate_layout(tp=8, pp=3)
    msg = str(e.value)
    assert "TP=8 does not divide num_attention_heads=28" in msg and "num_key_value_heads=4" in msg
    assert "PP=3 does not divide num_hidden_layers=28" in msg and "vocab_size" not in msg
    with pytest.raises(ModelConfigError, match=r"TP=3 does not divide intermediate_size \(ffn\)=18944"):
        s.validate_layout(tp=3, pp=1)
    s.validate_layout(tp=4, pp=4)


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelSpec.from_hf_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelConfigError, match="has no config.json"):
        ModelSpec.from_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": [\n  "Qwen2ForCausalLM",,\n]}')
    with pytest.raises(ModelConfigError, match="invalid JSON at line 2"):
        ModelSpec.from_hf_dir(str(tmp_path))


def test_spec_round_trips_through_json():
    s = ModelSpec.from_hf_config(LLAMA31_8B)
    assert ModelSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
