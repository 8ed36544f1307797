"""Config checks of asynchronous RL (rl_config.async_mode, max_staleness, weight_sync_interval): defaults, the
importance threshold an asynchronous mode implies, and clear errors at load."""

from __future__ import annotations

import pytest

from mindrl.config import load_config
from tests.config.test_errors import errors, issue


def test_defaults_are_synchronous():
    rl = load_config("grpo_tiny_cpu").rl_config
    assert (rl.async_mode, rl.max_staleness, rl.weight_sync_interval) == ("sync", 1, 1)
    assert rl.importance_threshold is None  # rollout_is_threshold: off


def test_one_step_off_truncates_the_importance_ratio():
    rl = load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=one_step_off"]).rl_config
    assert rl.async_mode == "one_step_off" and rl.importance_threshold == 2.0
    rl = load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=one_step_off",
                                                 "rl_config.rollout_is_threshold=5.0"]).rl_config  # fmt: skip
    assert rl.importance_threshold == 5.0
    # max_staleness 0: the synchronous order, nothing stale to correct
    rl = load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=one_step_off",
                                                 "rl_config.max_staleness=0"]).rl_config  # fmt: skip
    assert rl.importance_threshold is None


@pytest.mark.parametrize(
    "overrides, key, fragments",
    [
        (["rl_config.async_mode=one_step"], "rl_config.async_mode", ["'one_step' is not one of", "one_step_off"]),
        (["rl_config.async_mode=bounded", "rl_config.weight_sync_interval=2"], "rl_config.max_staleness",
         ["weight_sync_interval=2", "got 1"]),
        (["rl_config.async_mode=bounded", "rl_config.val_data_path=x"], "rl_config.val_data_path", ["evaluation"]),
        (["rl_config.async_mode=bounded", "rl_config.async_sync_port=5555"], "rl_config.async_sync_port",
         ["must differ"]),
        (["rl_config.async_mode=bounded", "rl_config.async_data_port=0"], "rl_config.async_data_port",
         ["TCP port"]),
        (["rl_config.async_mode=one_step_off", "rl_config.max_staleness=2"], "rl_config.max_staleness",
         ["at most one version old", "got 2"]),
        (["rl_config.async_mode=one_step_off", "rl_config.weight_sync_interval=2"], "rl_config.weight_sync_interval",
         ["after every update", "got 2"]),
        (["rl_config.async_mode=bounded", "rl_config.async_samplers=0"], "rl_config.async_samplers",
         ["needs >= 1 sampler actor", "async_transport: zmq"]),
        (["rl_config.async_mode=bounded", "rl_config.async_transport=zmq", "rl_config.async_samplers=2"],
         "rl_config.async_samplers", ["external mindrl-sampler processes", "got 2"]),
        (["rl_config.async_mode=bounded", "rl_config.async_transport=grpc"], "rl_config.async_transport",
         ["'grpc' is not one of ray, zmq"]),
        (["rl_config.async_mode=bounded", "rl_config.async_sampler_engine=sglang"], "rl_config.async_sampler_engine",
         ["hf or vllm", "'sglang'"]),
        (["rl_config.async_sampler_ref=true"], "rl_config.async_sampler_ref", ["needs async_mode bounded", "sync"]),
        (["rl_config.async_mode=bounded", "rl_config.async_transport=zmq", "rl_config.async_sampler_ref=true"],
         "rl_config.async_sampler_ref", ["--ref-model"]),
        (["rl_config.async_mode=bounded", "rl_config.async_sampler_ref=true", "rl_config.init_kl_coef=0"],
         "rl_config.async_sampler_ref", ["no reference model"]),
        (["rl_config.async_mode=bounded", "rl_config.async_sampler_cpus=-1"], "rl_config.async_sampler_cpus",
         ["must be >= 0"]),
        (["rl_config.async_mode=bounded", "rl_config.async_transport=zmq", "rl_config.async_sampler_devices=1"],
         "rl_config.async_sampler_devices", ["outside Ray"]),
        (["rl_config.async_mode=bounded", "generate_config.rollout_mode=server",
          "generate_config.server_urls=[http://127.0.0.1:8000]"], "generate_config.rollout_mode",
         ["does not combine with rl_config.async_mode bounded", "never to the rollout servers"]),
        (["rl_config.async_mode=one_step_off", "rl_config.filter_groups_enable=true",
          "rl_config.filter_groups_metric=seq_reward"], "rl_config.async_mode",
         ["dynamic sampling", "only once it has scored them"]),
        (["rl_config.max_staleness=-1"], "rl_config.max_staleness", ["must be >= 0"]),
        (["rl_config.weight_sync_interval=0"], "rl_config.weight_sync_interval", ["must be >= 1"]),
    ],
)  # fmt: skip
def test_errors(overrides, key, fragments):
    issue(errors("grpo_tiny_cpu", *overrides), key, *fragments)


def test_bounded_loads():
    rl = load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=bounded", "rl_config.max_staleness=2"]).rl_config
    assert (rl.async_mode, rl.async_data_port, rl.async_sync_port) == ("bounded", 5555, 5556)
    assert rl.importance_threshold == 2.0
    rl = load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=bounded", "rl_config.filter_groups_enable=true",
                                                 "rl_config.filter_groups_metric=seq_reward"]).rl_config  # fmt: skip
    assert rl.filter_groups_enable  # dynamic sampling over the samplers' batches (test_async_intake)


def test_bounded_defaults_to_one_sampler_actor_on_ray():
    """Without external samplers, bounded runs on the Ray transport with one sampler actor; ZeroMQ is a choice."""

    def bounded(*overrides):
        return load_config("grpo_tiny_cpu", overrides=["rl_config.async_mode=bounded", *overrides]).rl_config

    rl = bounded()
    assert (rl.async_transport, rl.async_samplers, rl.async_sampler_engine) == ("ray", 1, "hf")
    assert bounded("rl_config.async_samplers=2").async_samplers == 2
    rl = bounded("rl_config.async_transport=zmq")
    assert (rl.async_transport, rl.async_samplers) == ("zmq", 0)


def test_bounded_composes_with_dapos_dynamic_sampling():
    rl = load_config("dapo_tiny_cpu", overrides=["rl_config.async_mode=bounded"]).rl_config
    assert (rl.async_mode, rl.filter_groups_enable) == ("bounded", True)


def test_one_step_off_refuses_dynamic_sampling():
    issue(errors("dapo_tiny_cpu", "rl_config.async_mode=one_step_off"), "rl_config.async_mode", "dynamic sampling")
