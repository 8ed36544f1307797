"""Bad input to the rollout engines, through their public entry points: each case names the key or value
at fault, and leaves the host (os.environ, the process group) as it was. Nothing here starts vLLM: every
error is raised before the engine would. (Calls after shutdown on a real VllmEngine, and stop_token_ids on
one: tests/rollout/test_vllm_engine.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from mindrl.rollout import RolloutConfig, SamplingConfig
from mindrl.rollout.base import TOKENIZER_FILES
from mindrl.rollout.hf_engine import HFEngine
from tests.rollout.helpers import PROMPTS


@pytest.fixture
def hf_engine(rollout_models):
    engine = HFEngine(RolloutConfig(model=rollout_models["a"], dtype="float32", max_model_len=64))
    yield engine
    engine.shutdown()


@pytest.fixture
def one_rank_world(tmp_path):
    """A 1-rank gloo world in this process, destroyed afterwards."""
    assert not torch.distributed.is_initialized(), "a process group leaked from an earlier test"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_hf_engine_calls_after_shutdown(hf_engine):
    hf_engine.shutdown()
    hf_engine.shutdown()  # idempotent
    calls = {
        "generate": lambda: hf_engine.generate(PROMPTS, SamplingConfig(max_tokens=2)),
        "load_weights": lambda: hf_engine.load_weights([]),
        "sleep": hf_engine.sleep,
        "wake": hf_engine.wake,
    }
    for method, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"HFEngine\.{method}\(\) called after shutdown\(\)"):
            call()


def test_hf_engine_stop_token_ids_outside_the_vocab(hf_engine):
    with pytest.raises(ValueError, match=r"stop_token_ids \[3, 1024\] has ids outside the vocab \[0, 1024\)"):
        hf_engine.generate(PROMPTS, SamplingConfig(max_tokens=2, stop_token_ids=[3, 1024]))
    assert hf_engine.vocab_size == 1024  # the bound in the message is the model's


def test_hf_engine_sleep_wake_are_documented_no_ops(hf_engine):
    """HFEngine has no sleep mode: sleep()/wake() change nothing (the engine keeps generating the same
    tokens) and say so; unknown wake tags are still an error."""
    assert not hf_engine.supports_sleep
    assert "no-op" in HFEngine.sleep.__doc__ and "no-op" in HFEngine.wake.__doc__
    greedy = SamplingConfig(max_tokens=4, temperature=0.0)
    before = hf_engine.generate(PROMPTS, greedy)
    hf_engine.sleep()
    hf_engine.wake(["weights"])
    hf_engine.wake()
    assert hf_engine.generate(PROMPTS, greedy) == before
    with pytest.raises(ValueError, match=r"wake tags must be among \('kv_cache', 'weights'\), got \['kv'\]"):
        hf_engine.wake(["kv"])


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_load_tokenizer_without_tokenizer_files(rollout_models, engine):
    from mindrl.rollout.vllm_engine import VllmEngine

    cls = {"hf": HFEngine, "vllm": VllmEngine}[engine]
    notok = rollout_models["a_notok"]
    files = ", ".join(TOKENIZER_FILES)
    with pytest.raises(ValueError, match=f"load_tokenizer=True but {notok} has none of {files}"):
        cls(RolloutConfig(model=notok, dtype="float32", load_tokenizer=True))
    # An explicit tokenizer dir is the one checked.
    with pytest.raises(ValueError, match=f"load_tokenizer=True but {notok} has none of"):
        cls(RolloutConfig(model=rollout_models["a"], tokenizer=notok, dtype="float32", load_tokenizer=True))


def test_hf_engine_has_no_tensor_parallelism(rollout_models):
    with pytest.raises(ValueError, match="HFEngine .* infer_tensor_parallel_size must be 1, got 2"):
        HFEngine(RolloutConfig(model=rollout_models["a"], infer_tensor_parallel_size=2))


def test_vllm_infer_tp_must_divide_the_world(rollout_models, one_rank_world):
    from mindrl.rollout.vllm_engine import VllmEngine

    environ = dict(os.environ)
    with pytest.raises(
        ValueError, match="infer_tensor_parallel_size=2 does not divide the torch.distributed world size 1"
    ):
        VllmEngine(RolloutConfig(model=rollout_models["a"], infer_tensor_parallel_size=2))
    assert dict(os.environ) == environ


@pytest.mark.parametrize("env_rank", ["3", "rank0"])
def test_vllm_env_rank_must_match_the_world(rollout_models, one_rank_world, monkeypatch, env_rank):
    from mindrl.rollout.vllm_engine import VllmEngine

    monkeypatch.setenv("RANK", env_rank)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    environ = dict(os.environ)
    with pytest.raises(
        ValueError, match=f"environment variable RANK='{env_rank}' differs from the torch.distributed rank 0"
    ):
        VllmEngine(RolloutConfig(model=rollout_models["a"]))
    assert dict(os.environ) == environ  # LOCAL_RANK was not set on the way


def test_vllm_infer_tp_needs_a_world(rollout_models):
    from mindrl.rollout.vllm_engine import VllmEngine

    assert not torch.distributed.is_initialized(), "a process group leaked from an earlier test"
    with pytest.raises(ValueError, match="infer_tensor_parallel_size=2 needs an initialised torch.distributed world"):
        VllmEngine(RolloutConfig(model=rollout_models["a"], infer_tensor_parallel_size=2))
