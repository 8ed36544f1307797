"""megatron_training.npu_deterministic through the platform: each device class's switches, the hook that turns them and
torch's deterministic algorithms on in a process, a worker that starts with MINDRL_DETERMINISTIC=1, and the config's
worker environment. (Two identical trainer runs bit for bit: tests/trainer/test_determinism_e2e.py.)"""

from __future__ import annotations

import os

import torch

from mindrl.platform import DETERMINISTIC_ENV, CpuPlatform, CudaPlatform, NpuPlatform
from tests.procs import check_in_fresh_process


def test_each_device_class_names_its_switches():
    cpu, cuda, npu = (
        CpuPlatform().deterministic_env(),
        CudaPlatform().deterministic_env(),
        NpuPlatform().deterministic_env(),
    )
    for env in (cpu, cuda, npu):
        assert env["PYTHONHASHSEED"] == "0"
    assert cpu["OMP_DYNAMIC"] == "false"
    assert cuda["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and cuda["NCCL_ALGO"] == "Ring"
    assert npu["HCCL_DETERMINISTIC"] == "true" and npu["LCCL_DETERMINISTIC"] == "1"


def test_the_hook_sets_torch_flag_and_env_in_process():
    saved_env, saved_flag = dict(os.environ), torch.are_deterministic_algorithms_enabled()
    try:
        os.environ["OMP_DYNAMIC"] = "true"  # the config asked for determinism: the platform's value wins
        os.environ.pop(DETERMINISTIC_ENV, None)
        torch.use_deterministic_algorithms(False)
        CpuPlatform().enable_determinism()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["OMP_DYNAMIC"] == "false" and os.environ["PYTHONHASHSEED"] == "0"
        assert os.environ[DETERMINISTIC_ENV] == "1"  # what the process's children inherit
    finally:
        torch.use_deterministic_algorithms(saved_flag)
        os.environ.clear()
        os.environ.update(saved_env)


def joined_rank_is_deterministic() -> None:
    """A rank started with MINDRL_DETERMINISTIC=1 (as the trainer starts its workers) is deterministic once it joined its
    world, before its first kernel; one started without it is not."""
    from mindrl.launch import free_port, join_world

    assert not torch.are_deterministic_algorithms_enabled()
    join_world(0, 1, "127.0.0.1", free_port(), timeout_s=60, megatron=False)
    assert torch.are_deterministic_algorithms_enabled() and os.environ["OMP_DYNAMIC"] == "false"
    torch.distributed.destroy_process_group()
    print("joined_rank_is_deterministic: ok")


def test_a_worker_started_deterministic_turns_it_on_before_its_first_kernel():
    check_in_fresh_process(
        "tests.platform.test_determinism", "joined_rank_is_deterministic", **{DETERMINISTIC_ENV: "1"}
    )


def test_the_config_key_gives_every_worker_the_switches():
    from mindrl.config import load_config
    from mindrl.platform import current_platform
    from mindrl.workers.from_config import worker_env

    assert worker_env(load_config("ppo_tiny_cpu")) == {}
    env = worker_env(load_config("ppo_tiny_cpu", overrides=["megatron_training.npu_deterministic=true"]))
    assert env == {**current_platform().deterministic_env(), DETERMINISTIC_ENV: "1"}
    # MindSpeed-RL's key is a global one: written in actor_config it reaches the run too
    assert worker_env(load_config("grpo_tiny_cpu", overrides=["actor_config.npu_deterministic=true"]))


def test_hccl_buffersize_reaches_the_workers_on_ascend_only():
    from mindrl.config import load_config
    from mindrl.platform import current_platform
    from mindrl.workers.from_config import worker_env

    assert NpuPlatform().collective_buffer_env(640) == {"HCCL_BUFFSIZE": "640"}
    assert CpuPlatform().collective_buffer_env(640) == CudaPlatform().collective_buffer_env(640) == {}
    cfg = load_config("grpo_tiny_cpu", overrides=["rl_config.hccl_buffersize=640"])
    assert worker_env(cfg) == current_platform().collective_buffer_env(640)
