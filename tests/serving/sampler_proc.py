"""A stand-in sampler process for the transport tests: leases prompts over ZeroMQ, fetches weights, and sends
two fake responses per prompt (tagged with the weight version it holds) until it is stopped."""

from __future__ import annotations

import argparse
import time

import numpy as np

from mindrl.serving.experience import Experience
from mindrl.serving.transport import TransportTimeout, ZmqSamplerEnd


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--id", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--data-port", type=int, required=True)
    p.add_argument("--sync-port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.05, help="seconds per prompt (the 'generation')")
    a = p.parse_args()
    end = ZmqSamplerEnd(a.id, a.host, a.data_port, a.sync_port, hwm=4)
    version = None
    while True:
        try:
            update = end.fetch_weights(version, timeout_s=5)
            if update is not None:
                version = update.version
            leases = end.lease(2, timeout_s=5)
        except TransportTimeout:
            continue
        if not leases:
            time.sleep(0.1)
            continue
        for lease in leases:
            time.sleep(a.delay)
            rng = np.random.default_rng(lease.prompt_index)
            group = [
                Experience(
                    prompt_ids=np.array([lease.prompt_index + 1, 7], dtype=np.int32),
                    response_ids=rng.integers(0, 100, size=3 + k, dtype=np.int32),
                    behaviour_logprobs=-rng.random(3 + k, dtype=np.float32),
                    rewards={},
                    finish_reason="stop",
                    prompt_index=lease.prompt_index,
                    epoch=lease.epoch,
                    sampler_id=a.id,
                    weight_version=version or 0,
                )
                for k in range(2)
            ]
            print(f"{a.id} sent {lease.prompt_index}/{lease.epoch}", flush=True)
            end.send(group, timeout_s=30)


if __name__ == "__main__":
    main()
