"""`mindrl-comm check`: before an asynchronous run, verify both directions between a trainer host and a sampler
host over the ZeroMQ channels (docs/async.md), e.g. `mindrl-comm check --role sampler --host TRAINER_IP`."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mindrl.serving.transport import DATA_PORT, SYNC_PORT, TransportTimeout

CHECK_VERSION = 1


def check_blob(megabytes: float) -> dict[str, torch.Tensor]:
    """The weight blob both sides agree on: float32 values that are exact in binary, so equality is bit-exact."""
    n = max(1, int(megabytes * (1 << 20)) // 4)
    return {"check.weight": (torch.arange(n, dtype=torch.float32) % 4096) * 0.5}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-comm",
        description="Check the ZeroMQ channels of asynchronous RL between two hosts: an experience from the sampler "
        "to the trainer on the data port, a weight blob (and a prompt lease) from the trainer to the sampler on "
        "the sync port. Start the trainer side first, then the sampler side; both exit 0 on success, 1 naming "
        "the direction and port that failed.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="verify both directions between a trainer host and a sampler host")
    c.add_argument("--role", choices=("trainer", "sampler"), required=True)
    c.add_argument(
        "--host",
        default=None,
        help="trainer: the address to bind (default 0.0.0.0, all interfaces); sampler: the trainer's address "
        "(required)",
    )
    c.add_argument(
        "--data-port", type=int, default=DATA_PORT, help=f"experiences, sampler -> trainer (default {DATA_PORT})"
    )
    c.add_argument(
        "--sync-port", type=int, default=SYNC_PORT, help=f"weights and leases, trainer -> sampler (default {SYNC_PORT})"
    )
    c.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the peer (default 60)")
    c.add_argument("--blob-mb", type=float, default=4.0, help="size of the test weight blob in MiB (default 4)")
    c.add_argument("--sampler-id", default="comm-check", help="the sampler's name in the trainer's log")
    return p


def run_trainer(a: argparse.Namespace) -> int:
    from mindrl.data.prompt_ledger import PromptLedger
    from mindrl.serving.transport import ZmqTrainerEnd

    host = a.host or "0.0.0.0"
    try:
        end = ZmqTrainerEnd(PromptLedger(1, shuffle=False), host, a.data_port, a.sync_port)
    except OSError as e:
        print(f"mindrl-comm: FAILED: {e}", file=sys.stderr)
        return 1
    try:
        end.publish_weights(CHECK_VERSION, check_blob(a.blob_mb))
        print(f"mindrl-comm: trainer listening: data {end.data_address}, sync {end.sync_address}; waiting up to "
              f"{a.timeout:g}s for a sampler", flush=True)  # fmt: skip
        got = end.receive(1, timeout_s=a.timeout)
        if not got:
            if not end.stats.last_seen:
                print(f"mindrl-comm: FAILED: no sampler reached the sync channel (trainer -> sampler) on port "
                      f"{a.sync_port} within {a.timeout:g}s; is `mindrl-comm check --role sampler --host <this host>` "
                      f"running, and is port {a.sync_port} open to it?", file=sys.stderr)  # fmt: skip
            else:
                who = ", ".join(sorted(end.stats.last_seen))
                print(f"mindrl-comm: FAILED: sampler {who} reached the sync channel on port {a.sync_port}, but no "
                      f"experience arrived on the data channel (sampler -> trainer) port {a.data_port} within "
                      f"{a.timeout:g}s; is port {a.data_port} open to it, and did it use the same --data-port?"
                      + (f" (last dropped message: {end.stats.last_reason})" if end.stats.last_reason else ""),
                      file=sys.stderr)  # fmt: skip
            return 1
        e = got[0][0]
        ok = e.meta.get("weights_ok") is True
        print(f"mindrl-comm: data channel sampler -> trainer OK (port {a.data_port}, from {e.sampler_id}); sync "
              f"channel trainer -> sampler {'OK' if ok else 'FAILED'} (port {a.sync_port}, "
              f"{e.meta.get('weights_detail', '')})", flush=True)  # fmt: skip
        return 0 if ok else 1
    finally:
        time.sleep(0.2)  # let the sampler's last request drain before the sockets go away
        end.close()


def run_sampler(a: argparse.Namespace) -> int:
    from mindrl.serving.experience import Experience
    from mindrl.serving.transport import ZmqSamplerEnd

    if not a.host:
        print("mindrl-comm: --host (the trainer's address) is required for --role sampler", file=sys.stderr)
        return 2
    end = ZmqSamplerEnd(a.sampler_id, a.host, a.data_port, a.sync_port, linger_s=a.timeout)
    sync = f"sync channel (trainer -> sampler) {end.sync_address}"
    try:
        t0 = time.monotonic()
        try:
            leases = end.lease(1, timeout_s=a.timeout)
            update = end.fetch_weights(None, timeout_s=a.timeout)
            while update is None and time.monotonic() - t0 < a.timeout:  # the trainer binds, then publishes
                time.sleep(0.1)
                update = end.fetch_weights(None, timeout_s=a.timeout)
        except TransportTimeout:
            print(f"mindrl-comm: FAILED: {sync}: no answer within {a.timeout:g}s; is `mindrl-comm check --role "
                  f"trainer` running on {a.host}, and is port {a.sync_port} open from here?", file=sys.stderr)  # fmt: skip
            return 1
        seconds = time.monotonic() - t0
        expected = check_blob(a.blob_mb)
        ok = (
            update is not None
            and update.version == CHECK_VERSION
            and update.tensors.keys() == expected.keys()
            and all(torch.equal(update.tensors[k], v) for k, v in expected.items())
        )
        nbytes = sum(t.numel() * t.element_size() for t in expected.values())
        detail = f"{nbytes} bytes in {seconds:.2f}s, {'bit-exact' if ok else 'MISMATCH (different --blob-mb?)'}"
        print(f"mindrl-comm: {sync}: weights {detail}; lease {[(x.prompt_index, x.epoch) for x in leases]}", flush=True)
        lease = leases[0] if leases else None
        exp = Experience(
            prompt_ids=[1],
            response_ids=[2, 3],
            behaviour_logprobs=[-0.5, -0.25],
            rewards={"check": 1.0},
            finish_reason="stop",
            prompt_index=lease.prompt_index if lease else 0,
            epoch=lease.epoch if lease else 0,
            sampler_id=a.sampler_id,
            weight_version=CHECK_VERSION,
            meta={"weights_ok": ok, "weights_detail": detail},
        )
        try:
            end.send([exp], timeout_s=a.timeout)
        except TransportTimeout:
            print(f"mindrl-comm: FAILED: data channel (sampler -> trainer) {end.data_address}: could not deliver "
                  f"within {a.timeout:g}s; is port {a.data_port} open from here, and does the trainer use the same "
                  f"--data-port?", file=sys.stderr)  # fmt: skip
            return 1
        print(f"mindrl-comm: data channel (sampler -> trainer) {end.data_address}: experience sent", flush=True)
        return 0 if ok else 1
    finally:
        end.close()  # lingers until the experience is flushed (at most --timeout)


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    a = build_parser().parse_args(argv)
    return run_trainer(a) if a.role == "trainer" else run_sampler(a)


if __name__ == "__main__":
    sys.exit(main())
