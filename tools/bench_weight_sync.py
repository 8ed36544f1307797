#!/usr/bin/env python
"""Benchmark rollout-server weight sync: one full push of a ~32M-parameter Qwen2 actor (the model of
tools/bench_reshard.py) from a megatron rank (TP1) to a real `mindrl-rollout-server` over loopback, by HTTP bodies and
by the torch.distributed channel (generate_config.weight_transfer http / dist), against the in-process reshard of the
same weights (the stream copied into preallocated slots: bench_reshard's TP1xPP1 figure).

Per bucket size and transfer, medians over --repeats (after one warm-up) of: the in-process reshard; the push
(stream -> buckets -> HTTP bodies, or HTTP metadata + one broadcast per bucket -> the server stages them -> commit,
which loads them into vLLM); the server's own commit time (its load_weights). GB/s = model bytes / seconds. Prints a
table and a final JSON line.

    python tools/bench_weight_sync.py --bucket-mb 8,64,512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


TRANSFERS = ("http", "dist")


def _bench_rank(load_dir: str, url: str, bucket_mbs: list[float], repeats: int) -> dict:
    """On the (single) rank: in-process reshard vs push to the server (each transfer), per bucket size."""
    import torch

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.resharding import WeightStreamer
    from mindrl.serving.client import RolloutClient

    spec, _, model = build_and_load(load_dir, 1, 1, None)
    slots: dict[str, torch.Tensor] = {}

    def consume(it) -> None:
        for name, t in it:
            if name not in slots:
                slots[name] = torch.empty_like(t)
            slots[name].copy_(t)

    client = RolloutClient(url, timeout=600)
    version = client.health().version
    out: dict = {"buckets": {}}
    for mb in bucket_mbs:
        streamer = WeightStreamer(model, spec, mb)
        local, nbuckets = [], 0
        push: dict[str, list[float]] = {t: [] for t in TRANSFERS}
        commit: dict[str, list[float]] = {t: [] for t in TRANSFERS}
        for r in range(repeats + 1):  # the first pass is a warm-up
            t0 = time.perf_counter()
            stats = streamer.load_into(consume)
            dt = time.perf_counter() - t0
            if r:
                local.append(dt)
            for transfer in TRANSFERS:
                version += 1
                t0 = time.perf_counter()
                res = client.push_weights(version, streamer.stream(), int(mb * 2**20), transfer)
                dp = time.perf_counter() - t0
                if r:
                    push[transfer].append(dp)
                    commit[transfer].append(res.commit_seconds)
                nbuckets = res.num_buckets
        out["buckets"][mb] = {
            "local_s": statistics.median(local),
            **{f"push_{t}_s": statistics.median(push[t]) for t in TRANSFERS},
            "commit_s": statistics.median(commit["http"] + commit["dist"]),
            "buckets": nbuckets,
        }
        out["model_bytes"] = stats.bytes_emitted
    client.close()
    return out


def _start_server(hf: str, port: int, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mindrl.cli.rollout_server", "--model", hf, "--port", str(port), "--dtype",
           "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-mb", default="8,64,512", help="bucket sizes in MiB, comma-separated (default 8,64,512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hf-dir", default=None, help="benchmark this HF checkpoint instead of a generated one")
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    a = p.parse_args(argv)
    buckets = [float(x) for x in a.bucket_mb.split(",")]

    from mindrl.checkpoint import convert
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from mindrl.launch import RankPool, free_port
    from mindrl.serving.client import RolloutClient
    from tools.bench_weight_sync import _bench_rank  # importable by the rank (not __main__)
    from tools.make_tiny_model import make_tiny_model
    from tools.scratch import scratch_dir

    work = scratch_dir(a.workdir, "bench_weight_sync_")
    hf = a.hf_dir or os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_tiny_model(hf, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=8, num_kv_heads=4,
                        intermediate_size=1408, vocab_size=a.vocab_size, init_std=0.02)  # fmt: skip
    ckpt = HFCheckpoint(hf)
    num_params = sum(ckpt.get(k).numel() for k in ckpt.keys())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(work, "server.log")
    print(f"model: {num_params / 1e6:.1f}M params; starting a rollout server at {url} (log {log}) ...", flush=True)
    server = _start_server(hf, port, log)
    try:
        with RolloutClient(url, timeout=300) as c:
            c.wait_ready(what="to start")
        with RankPool(1) as pool:
            mcore = os.path.join(work, "mcore")
            convert.hf2mcore(hf, mcore, 1, 1, overwrite=True, pool=pool)
            (res,) = pool.run(_bench_rank, mcore, url, buckets, a.repeats)
    finally:
        server.terminate()
        server.wait(120)
    gb = res["model_bytes"] / 1e9
    rows = []
    print(f"\nmodel {res['model_bytes'] / 2**20:.1f} MiB; loopback, TP1 actor -> 1 server; medians of {a.repeats}")
    print(f"{'bucket MiB':>10}{'buckets':>9}{'in-process s':>14}{'GB/s':>7}{'http s':>9}{'GB/s':>7}{'dist s':>9}"
          f"{'GB/s':>7}{'commit s':>10}{'http/dist':>11}")  # fmt: skip
    for mb in buckets:
        r = res["buckets"][mb]
        row = {"bucket_mb": mb, **r, "local_gbps": gb / r["local_s"]}
        row.update({f"push_{t}_gbps": gb / r[f"push_{t}_s"] for t in ("http", "dist")})
        rows.append(row)
        print(f"{mb:>10g}{r['buckets']:>9}{r['local_s']:>14.3f}{row['local_gbps']:>7.2f}{r['push_http_s']:>9.3f}"
              f"{row['push_http_gbps']:>7.2f}{r['push_dist_s']:>9.3f}{row['push_dist_gbps']:>7.2f}"
              f"{r['commit_s']:>10.3f}{r['push_http_s'] / r['push_dist_s']:>11.1f}")  # fmt: skip
    print(
        "http = stream + safetensors + HTTP bodies + commit; dist = stream + HTTP metadata + one broadcast per bucket "
        "(the platform's backend) + commit; commit = the server's load into vLLM; in-process = the stream copied "
        "into preallocated slots (bench_reshard TP1xPP1)"
    )
    print(json.dumps({"params": num_params, "model_bytes": res["model_bytes"], "repeats": a.repeats, "results": rows}))


if __name__ == "__main__":
    main()
