"""Bad arguments to the streamer and the offloader fail at once, name the value, and move nothing.

All in this process: each check runs before any collective (the critic case, which needs ranks, is in
test_reshard_stream.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from mindrl.models.hf_config import ModelSpec
from mindrl.resharding import OffloadConfig, TrainStateOffloader, WeightStreamer, stream_weights

SPEC = ModelSpec.from_hf_config(
    {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
    }
)


@pytest.mark.parametrize("bucket_size_mb", [0, -1, -0.5, math.nan, math.inf])
def test_bucket_size_must_be_positive_and_finite(bucket_size_mb):
    spec = SPEC
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=f"bucket_size_mb must be > 0 and finite, got {bucket_size_mb}"):
        WeightStreamer(model, spec, bucket_size_mb)
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        stream_weights(model, spec, bucket_size_mb)


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kinds", [["params"], ["param", "optimiser"], ("grads",)])
def test_unknown_offload_kinds_move_nothing(kinds):
    model, optimizer = _model_and_optimizer()
    offloader = TrainStateOffloader([model], optimizer, OffloadConfig(True, True, True))
    before = offloader.device_bytes()
    values = [p.detach().clone() for p in model.parameters()]
    unknown = [k for k in kinds if k not in ("param", "grad", "optimizer")]
    with pytest.raises(ValueError) as e:
        offloader.offload(kinds)
    assert str(e.value) == f"unknown offload kinds {unknown}; expected some of ('param', 'grad', 'optimizer')"
    assert offloader.device_bytes() == before and offloader.host_bytes() == 0 and not offloader.offloaded_kinds
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))


def test_one_kind_given_as_a_string():
    """offload("param") means the kind, not the letters p, a, r, a, m."""
    model, optimizer = _model_and_optimizer()
    offloader = TrainStateOffloader([model], optimizer)
    offloader.offload("param")
    assert offloader.offloaded_kinds == {"param"} and offloader.device_bytes()["param"] == 0
    offloader.onload()


class _Wrapper:
    """Looks like a megatron optimizer (it has .optimizer) but wraps something that is not one."""

    def __init__(self, inner):
        self.optimizer = inner


@pytest.mark.parametrize(
    "optimizer, name", [(object(), "object"), (_Wrapper("adam"), "str"), (_Wrapper(_Wrapper(3)), "int")]
)
def test_optimizer_it_cannot_unwrap_fails_at_construction(optimizer, name):
    """Before this failed at the first offload, i.e. after the first rollout of a run."""
    model, _ = _model_and_optimizer()
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=f"cannot find the torch optimizer inside {name}: expected a torch.optim"):
        TrainStateOffloader([model], optimizer, OffloadConfig(True, True, True))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))
