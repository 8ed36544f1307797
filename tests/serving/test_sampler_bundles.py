"""Sampler actors on bundles of their own (rl_config.async_sampler_cpus / async_sampler_devices): the bundle each one
asks for, the Ray options that claim it, its torch threads (on this host's platform, CPU)."""

from __future__ import annotations

from mindrl.serving import sampler_actor


def test_bundle_claim_and_threads_on_a_cpu_host():
    assert sampler_actor.bundle(0, 0) == {}  # nothing asked: no placement group, the actors claim nothing
    assert sampler_actor.bundle(2, 0) == {"CPU": 2.0}
    assert sampler_actor.bundle(0.5, 1) == {"CPU": 1.5}  # a device is a CPU stand-in here
    assert sampler_actor._claim_options({"CPU": 1.5}) == {"num_cpus": 1.5}
    assert sampler_actor.threads_of(0, 0) == 1 and sampler_actor.threads_of(2.5, 1) == 3


def test_claim_options_of_device_bundles():
    assert sampler_actor._claim_options({"CPU": 2.0, "GPU": 1.0}) == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert sampler_actor._claim_options({"NPU": 1.0}) == {"num_cpus": 0, "resources": {"NPU": 1.0}}
