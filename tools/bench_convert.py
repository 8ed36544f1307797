#!/usr/bin/env python
"""Benchmark HF <-> megatron conversion on a ~30M-parameter Qwen2 model (CPU, gloo ranks).

Times hf2mcore at TP x PP, mcore2hf, and the logits check, with peak RSS per rank; the peer is
transformers' own load + save of the same checkpoint (from_pretrained + save_pretrained) in a fresh
process. Prints a table of medians over --repeats and a final JSON line.

    python tools/bench_convert.py --tp 2 --pp 2 --repeats 3
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

PEER = """
import resource, sys, time, torch, transformers
t = time.perf_counter()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
m.save_pretrained(sys.argv[2], safe_serialization=True)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    a = p.parse_args(argv)

    from mindrl.checkpoint import convert
    from tools.make_tiny_model import make_tiny_model
    from tools.scratch import scratch_dir

    work = scratch_dir(a.workdir, "bench_convert_")
    hf = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_tiny_model(hf, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=8, num_kv_heads=4,
                        intermediate_size=1408, vocab_size=a.vocab_size, init_std=0.02)  # fmt: skip
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    rows: dict[str, list[float]] = {k: [] for k in ("hf2mcore_s", "mcore2hf_s", "check_s", "peer_s",
                                                     "hf2mcore_rss", "hf2mcore_rss_base", "mcore2hf_rss", "peer_rss")}  # fmt: skip
    diff = None
    for r in range(a.repeats):
        m, h2, h3 = (os.path.join(work, f"{x}{r}") for x in ("m", "h2_", "h3_"))
        s1 = convert.hf2mcore(hf, m, a.tp, a.pp, overwrite=True)
        s2 = convert.mcore2hf(m, h2, overwrite=True)
        t = time.perf_counter()
        diff = convert.check(hf, m, a.tp, a.pp).max_abs_diff
        rows["check_s"].append(time.perf_counter() - t)
        peer = subprocess.run([sys.executable, "-c", PEER, hf, h3], capture_output=True, text=True, check=True)
        peer_s, peer_rss = map(float, peer.stdout.split())
        rows["hf2mcore_s"].append(s1.seconds)
        rows["mcore2hf_s"].append(s2.seconds)
        rows["peer_s"].append(peer_s)
        rows["hf2mcore_rss"].append(max(s1.peak_rss_bytes))
        rows["hf2mcore_rss_base"].append(max(s1.base_rss_bytes))
        rows["mcore2hf_rss"].append(max(s2.peak_rss_bytes))
        rows["peer_rss"].append(peer_rss)
        print(
            f"repeat {r + 1}/{a.repeats}: hf2mcore {s1.seconds:.1f}s mcore2hf {s2.seconds:.1f}s peer {peer_s:.1f}s",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in rows.items()}
    mib = 2**20
    print(f"\nmodel: {s1.num_params / 1e6:.1f}M params, {size / mib:.0f} MiB fp32 safetensors; TP{a.tp} PP{a.pp}; "
          f"medians of {a.repeats}")  # fmt: skip
    print(f"{'step':<34}{'seconds':>10}{'peak RSS/rank MiB':>20}")
    print(f"{'hf2mcore (incl. rank start-up)':<34}{med['hf2mcore_s']:>10.1f}{med['hf2mcore_rss'] / mib:>20.0f}")
    print(f"{'  rank baseline before weights':<34}{'':>10}{med['hf2mcore_rss_base'] / mib:>20.0f}")
    print(f"{'mcore2hf (incl. rank start-up)':<34}{med['mcore2hf_s']:>10.1f}{med['mcore2hf_rss'] / mib:>20.0f}")
    print(f"{'check (logits vs HF)':<34}{med['check_s']:>10.1f}")
    print(f"{'peer: HF from_pretrained+save':<34}{med['peer_s']:>10.1f}{med['peer_rss'] / mib:>20.0f}")
    print(f"ratios vs peer: hf2mcore {med['hf2mcore_s'] / med['peer_s']:.2f}x, mcore2hf {med['mcore2hf_s'] / med['peer_s']:.2f}x; "
          f"max |logit diff| {diff:.2e}")  # fmt: skip
    print(json.dumps({"params": s1.num_params, "tp": a.tp, "pp": a.pp, **{k: round(v, 3) for k, v in med.items()},
                      "max_abs_logit_diff": diff}))  # fmt: skip


if __name__ == "__main__":
    main()
