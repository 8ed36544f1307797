"""The Ray transport in a private Ray on loopback: a sampler task sends experiences and fetches weights through
the hub actor, the queue is bounded (a sender blocks, then times out), malformed messages are dropped."""

import numpy as np
import pytest
import ray
import torch

from mindrl.serving.experience import Experience, encode
from mindrl.serving.transport import RaySamplerEnd, RayTrainerEnd, TransportTimeout
from mindrl.workers.group import start_ray, stop_ray


@pytest.fixture(scope="module")
def cluster():
    started = start_ray(None, 1)
    yield
    if started:
        stop_ray()


def group(prompt_index, epoch, sampler_id, version=0, n=2):
    return [
        Experience(
            [prompt_index + 1, 2],
            np.arange(3) + k,
            np.array([-0.1, -0.2, -0.3], np.float32),
            {"acc": 1.0},
            "length",
            prompt_index,
            epoch,
            sampler_id,
            version,
        )  # fmt: skip
        for k in range(n)
    ]


@ray.remote(num_cpus=0)
def sampler_task(hub, sampler_id, count):
    end = RaySamplerEnd(sampler_id, hub)
    update = end.fetch_weights(None)
    leases = end.lease(count)
    for x in leases:
        end.send(group(x.prompt_index, x.epoch, sampler_id, update.version), timeout_s=30)
    return update.version, float(update.tensors["w"].sum()), [[x.prompt_index, x.epoch] for x in leases]


def test_ray_round_trip(cluster):
    trainer = RayTrainerEnd({"num_prompts": 6, "seed": 1}, maxsize=8)
    try:
        trainer.publish_weights(2, {"w": torch.arange(4.0)})
        version, total, leases = ray.get(sampler_task.remote(trainer.hub, "r0", 4), timeout=120)
        assert version == 2 and total == 6.0 and len(leases) == 4
        got = []
        while len(got) < 4:
            got += trainer.receive(8, timeout_s=30)
        for g, (p, e) in zip(got, leases):
            assert encode(g) == encode(group(p, e, "r0", 2))  # bit-exact
        assert trainer.stats.received == 4 and trainer.ledger.in_flight() == []
        assert trainer.ledger.duplicates == 0
    finally:
        trainer.close()


def test_ray_backpressure_and_malformed(cluster):
    trainer = RayTrainerEnd({"num_prompts": 6, "seed": 1}, maxsize=2)
    sampler = RaySamplerEnd("r1", trainer.hub)
    try:
        leases = sampler.lease(3)
        for x in leases[:2]:
            sampler.send(group(x.prompt_index, x.epoch, "r1"), timeout_s=10)
        assert trainer.queue_depth() == 2
        with pytest.raises(TransportTimeout, match="no room after 0.3s"):
            sampler.send(group(leases[2].prompt_index, leases[2].epoch, "r1"), timeout_s=0.3)
        assert len(trainer.receive(2, timeout_s=10)) == 2
        sampler.send(group(leases[2].prompt_index, leases[2].epoch, "r1"), timeout_s=10)
        ray.get(trainer.hub.put.remote(b"\x92\x01", 10))  # malformed bytes straight into the queue
        got = trainer.receive(4, timeout_s=10)
        got += trainer.receive(4, timeout_s=2)
        assert len(got) == 1 and trainer.stats.dropped_malformed == 1
        assert "truncated" in trainer.stats.last_reason
    finally:
        trainer.close()
