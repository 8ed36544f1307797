#!/usr/bin/env python
"""Benchmark train -> infer resharding (`mindrl.resharding.WeightStreamer`) on a ~30M-parameter Qwen2 model.

For each train layout (TP x PP on a pool of --world ranks) and each bucket size, times one full pass of
the weight stream (PP broadcast, TP all-gather, HF un-fuse; through shared memory between same-host CPU ranks,
or gloo with MINDRL_RESHARD_SHM=0; the consumer copies each tensor into a
preallocated slot, as a rollout engine's load_weights does) against one memcpy of the model's bytes on
the same ranks at the same time, and reports the ratio, plus the peak extra bytes the stream held live.
Medians over --repeats (after one warm-up); the slowest rank counts. Prints a table and a final JSON line.

    python tools/bench_reshard.py --layouts 2x2,1x1 --bucket-mb 8,32,128 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _bench_rank(load_dir: str, tp: int, pp: int, bucket_mbs: list[float], repeats: int) -> dict:
    """On every rank: stream the model `repeats` times per bucket size; memcpy the model's bytes as often."""
    import torch

    from mindrl.checkpoint.loading import build_and_load
    from mindrl.platform import current_platform
    from mindrl.resharding import WeightStreamer

    platform = current_platform()
    spec, _, model = build_and_load(load_dir, tp, pp, None)
    barrier = torch.distributed.barrier
    out: dict = {"buckets": {}}
    slots: dict[str, torch.Tensor] = {}  # the "engine's" weights: copied into, as vLLM's load_weights does

    def consume(it) -> None:
        for name, t in it:
            if name not in slots:
                slots[name] = torch.empty_like(t, device=platform.device())
            slots[name].copy_(t)

    def consume_shards(it) -> None:
        for name, t, _ in it:
            key = "shard:" + name
            if key not in slots:
                slots[key] = torch.empty_like(t, device=platform.device())
            slots[key].copy_(t)

    for mb in bucket_mbs:
        streamer = WeightStreamer(model, spec, mb)
        times, peaks, dev_peaks, shard_times, shard_peaks = [], [], [], [], []
        for r in range(repeats + 1):  # the first pass is a warm-up (allocations of the engine's slots)
            barrier()
            platform.reset_peak_memory_stats()
            base = platform.memory_allocated()
            t0 = time.perf_counter()
            stats = streamer.load_into(consume)
            platform.synchronize()
            dt = time.perf_counter() - t0
            if r:
                times.append(dt)
                peaks.append(stats.peak_extra_bytes)
                dev_peaks.append(platform.max_memory_allocated() - base)
            if tp > 1:  # infer TP == train TP: each rank's own shard, no TP all-gather
                barrier()
                t0 = time.perf_counter()
                consume_shards(streamer.stream_shards())
                platform.synchronize()
                if r:
                    shard_times.append(time.perf_counter() - t0)
                    shard_peaks.append(streamer.stats.peak_extra_bytes)
        out["buckets"][mb] = {
            "seconds": statistics.median(times),
            "peak_extra_bytes": max(peaks),
            "device_peak_extra_bytes": max(dev_peaks),  # allocator view (0 on CPU)
            "num_buckets": stats.num_buckets,
            "largest_param_bytes": stats.largest_param_bytes,
            "shards_seconds": statistics.median(shard_times) if shard_times else None,
            "shards_peak_extra_bytes": max(shard_peaks) if shard_peaks else None,
            "transport": stats.transport,
            "layout": stats.layout,
        }
        out["model_bytes"] = stats.bytes_emitted
    src = torch.randint(0, 255, (out["model_bytes"],), dtype=torch.uint8, device=platform.device())
    dst = torch.empty_like(src)
    times = []
    for r in range(repeats + 1):
        barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        platform.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    out["memcpy_s"] = statistics.median(times)
    return out


def _fmt(x, spec: str, div: float = 1.0) -> str:
    return "-" if x is None else format(x / div, spec)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="2x2,1x1", help="train layouts TPxPP, comma-separated (default 2x2,1x1)")
    p.add_argument("--world", type=int, default=4, help="ranks; TP*PP must divide it (the rest is DP)")
    p.add_argument("--bucket-mb", default="8,32,128", help="bucket sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hf-dir", default=None, help="benchmark this HF checkpoint instead of a generated one")
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    a = p.parse_args(argv)
    layouts = [tuple(int(x) for x in s.lower().split("x")) for s in a.layouts.split(",")]
    buckets = [float(x) for x in a.bucket_mb.split(",")]
    for tp, pp in layouts:
        if a.world % (tp * pp):
            p.error(f"--world {a.world} is not divisible by TP*PP = {tp}*{pp}")

    from mindrl.checkpoint import convert
    from mindrl.checkpoint.hf_io import HFCheckpoint
    from mindrl.launch import RankPool
    from tools.bench_reshard import _bench_rank  # importable by the ranks (not __main__)
    from tools.make_tiny_model import make_tiny_model
    from tools.scratch import scratch_dir

    work = scratch_dir(a.workdir, "bench_reshard_")
    hf = a.hf_dir or os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_tiny_model(hf, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=8, num_kv_heads=4,
                        intermediate_size=1408, vocab_size=a.vocab_size, init_std=0.02)  # fmt: skip
    mib = 2**20
    rows = []
    with RankPool(a.world) as pool:
        mcore = os.path.join(work, "mcore")
        stats = convert.hf2mcore(hf, mcore, max(t for t, _ in layouts), 1, overwrite=True, pool=pool)
        del stats  # its num_params counts every DP replica
        ckpt = HFCheckpoint(hf)
        num_params = sum(ckpt.get(k).numel() for k in ckpt.keys())
        print(f"model: {num_params / 1e6:.1f}M params; world {a.world}; medians of {a.repeats}", flush=True)
        for tp, pp in layouts:
            res = pool.run(_bench_rank, mcore, tp, pp, buckets, a.repeats)
            memcpy_s = max(r["memcpy_s"] for r in res)
            for mb in buckets:
                per = [r["buckets"][mb] for r in res]
                row = {
                    "tp": tp,
                    "pp": pp,
                    "bucket_mb": mb,
                    "reshard_s": max(x["seconds"] for x in per),
                    "memcpy_s": memcpy_s,
                    "peak_extra_bytes": max(x["peak_extra_bytes"] for x in per),
                    "device_peak_extra_bytes": max(x["device_peak_extra_bytes"] for x in per),
                    "num_buckets": per[0]["num_buckets"],
                    "largest_param_bytes": per[0]["largest_param_bytes"],
                    "model_bytes": res[0]["model_bytes"],
                    "transport": per[0]["transport"],
                    "stream_layout": per[0]["layout"],
                    "shards_s": None if per[0]["shards_seconds"] is None else max(x["shards_seconds"] for x in per),
                    "shards_peak_extra_bytes": None
                    if per[0]["shards_peak_extra_bytes"] is None
                    else max(x["shards_peak_extra_bytes"] for x in per),
                }
                row["ratio"] = row["reshard_s"] / row["memcpy_s"]
                rows.append(row)
                print(f"TP{tp}xPP{pp} bucket {mb:g} MiB: reshard {row['reshard_s']:.3f}s "
                      f"({row['ratio']:.1f}x memcpy, {row['transport']}, {row['stream_layout']})", flush=True)  # fmt: skip

    print(f"\n{'layout':<9}{'bucket MiB':>11}{'buckets':>9}{'reshard s':>11}{'memcpy s':>10}{'ratio':>8}"
          f"{'peak extra MiB':>16}{'own-shard s':>13}{'its peak MiB':>14}{'stream':>9}")  # fmt: skip
    for r in rows:
        layout = f"TP{r['tp']}xPP{r['pp']}"
        print(f"{layout:<9}{r['bucket_mb']:>11g}{r['num_buckets']:>9}{r['reshard_s']:>11.3f}"
              f"{r['memcpy_s']:>10.4f}{r['ratio']:>8.1f}{r['peak_extra_bytes'] / mib:>16.1f}"
              f"{_fmt(r['shards_s'], '.3f'):>13}{_fmt(r['shards_peak_extra_bytes'], '.1f', mib):>14}{r['stream_layout']:>9}")  # fmt: skip
    print(f"model {rows[0]['model_bytes'] / mib:.1f} MiB; largest parameter {rows[0]['largest_param_bytes'] / mib:.1f} MiB; "
          "own-shard = stream_shards (infer TP == train TP, no TP all-gather); peak extra = live gathered bucket "
          "+ reassembled parameter + the consumer's previous item (stream hf: the model's one HF-layout copy in shared "
          "memory, used when the model fits in one bucket; buckets: bucket by bucket)")  # fmt: skip
    print(json.dumps({"params": num_params, "world": a.world, "repeats": a.repeats, "results": rows}))


if __name__ == "__main__":
    main()
