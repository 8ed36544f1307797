#!/usr/bin/env python
"""Benchmark the actor update alone (`mindrl.workers.rl_model.ppo_update`, real megatron-core on gloo ranks).

One GRPO-shaped batch (prompts x n rows of prompt + response tokens, no padding) goes through one optimizer
step per iteration at each TP layout on a --world-rank pool (TP1 runs as one rank with all the threads,
TP2 as two ranks with a thread each, so every layout uses the same cores). Reports medians after a warm-up
iteration: seconds, tokens/s, FLOPs (6*N*T + attention), MFU against the measured fp32 matmul peak at the
model's GEMM shapes, HFU (the FLOPs mindrl computes, each prompt once for its n samples, against the same peak),
and a torch.profiler breakdown of one more iteration (GEMMs, elementwise, optimizer, communication, Python /
framework) as a table; `--json PATH` writes the numbers.

    python tools/bench_update.py                              # the ~32M model, 16 x 4 rows of 30 + 64 tokens
    python tools/bench_update.py --tp 1 --iterations 5 --json /tmp/update.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ------------------------------------------------------------------------------------------- model shape
@dataclass
class ModelShape:
    """The Qwen2 shape the benchmarks build (tools/make_tiny_model.py); defaults: the ~32M model of issue 16."""

    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 8192

    @classmethod
    def from_hf(cls, hf_dir: str) -> ModelShape:
        with open(os.path.join(hf_dir, "config.json")) as f:
            c = json.load(f)
        return cls(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                   c["intermediate_size"], c["vocab_size"])  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def gemm_shapes(self) -> list[tuple[int, int]]:
        """(K, N) of every weight matmul: fused QKV, attention output, fused gate+up, down, LM head."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return [
            (h, h + 2 * kv),
            (h, h),
            (h, 2 * self.intermediate_size),
            (self.intermediate_size, h),
            (h, self.vocab_size),
        ]

    @property
    def matmul_params(self) -> int:
        """N: the parameters that sit in matmuls (layers' linear weights + the untied LM head)."""
        per_layer = sum(k * n for k, n in self.gemm_shapes()[:4])
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size

    def attention_flops(self, seq_len: int, causal: bool, keys: int | None = None) -> float:
        """Forward attention-score FLOPs of one sequence: QK^T and AV, 2 * 2 * s^2 * hidden per layer (full
        square: a masked dense implementation computes it all); causal (a KV-cached decode): half of it. keys:
        seq_len queries over this many keys (a rectangle) instead of the square."""
        full = 4.0 * self.num_layers * self.hidden_size * seq_len * (seq_len if keys is None else keys)
        return full / 2 if causal else full


def make_model(hf_dir: str, shape: ModelShape) -> str:
    """Write the benchmark's HF checkpoint (random weights + the local tokenizer) unless it is there."""
    from tools.make_tiny_model import make_tiny_model

    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        make_tiny_model(
            hf_dir,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            intermediate_size=shape.intermediate_size,
            vocab_size=shape.vocab_size,
            init_std=0.02,
            seed=0,
        )
    return hf_dir


# ------------------------------------------------------------------------------------------- matmul peak
def matmul_peak(
    shape: ModelShape, threads: int, tokens: tuple[int, ...] = (512, 2048), seconds: float = 0.3, device: str = "cpu"
) -> dict:
    """Best fp32 GEMM rate (GFLOP/s) over [tokens x K] @ [K x N] at the model's GEMM shapes, with `threads` torch
    threads (restored afterwards), on `device` (an accelerator: each product timed to its completion, TF32 as torch's
    default: off), by each kernel torch offers there: torch.matmul; on an x86 CPU also oneDNN's linear
    (`mindrl.kernels.cpu_linear`, which mindrl's megatron layers use there; MKL's torch.matmul reaches half of it on
    some AMD CPUs); and where mindrl preloads its MKL vendor shim into workers (`mindrl.kernels.mkl_vendor`, AMD CPUs)
    torch.matmul once more in a process with the shim ("torch.matmul+shim"). The peak is the best of them, so that a
    bound computed from it is the machine's, whichever kernel a side uses. Returns {"peak_gflops", "threads",
    "device", "kernels": {kernel: its best}, "shapes": {...}}."""
    import subprocess

    from mindrl.kernels import current_kernels

    fast = current_kernels()
    names = ["torch.matmul"] + (["onednn"] if device == "cpu" and fast.onednn_available else [])
    per_shape, best_by_kernel = gemm_rates(names, shape, threads, tokens, seconds, device)
    shim = fast.mkl_vendor_shim if device == "cpu" else None
    if shim and os.environ.get("LD_PRELOAD") != shim:  # the shim works from process start only
        args = json.dumps([["torch.matmul"], asdict(shape), threads, list(tokens), seconds, device])
        code = f"import json, sys; from tools.bench_update import *; print(json.dumps(gemm_rates_json({args!r})))"
        env = {**os.environ, "LD_PRELOAD": shim}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"matmul peak with the MKL vendor shim failed:\n{out.stderr[-3000:]}")
        shim_shapes, shim_best = json.loads(out.stdout.strip().splitlines()[-1])
        per_shape.update({k.replace("torch.matmul", "torch.matmul+shim", 1): v for k, v in shim_shapes.items()})
        best_by_kernel["torch.matmul+shim"] = shim_best["torch.matmul"]
    return {
        "peak_gflops": max(best_by_kernel.values()),
        "threads": threads,
        "device": device,
        "kernels": best_by_kernel,
        "shapes": per_shape,
    }


def gemm_rates_json(args: str) -> tuple[dict, dict]:
    """`gemm_rates` with its arguments as a JSON list (the shape as a dict): how `matmul_peak` calls it in a
    process with the MKL vendor shim preloaded."""
    names, shape, threads, tokens, seconds, device = json.loads(args)
    return gemm_rates(names, ModelShape(**shape), threads, tuple(tokens), seconds, device)


def gemm_rates(
    names: list[str], shape: ModelShape, threads: int, tokens: tuple[int, ...], seconds: float, device: str
) -> tuple[dict, dict]:
    """({"<kernel> MxKxN": GFLOP/s}, {kernel: its best}) for the named kernels ("torch.matmul", "onednn")."""
    import torch

    from mindrl.platform.detect import current_platform

    sync = current_platform().synchronize  # a no-op on the CPU
    kernels = {"torch.matmul": lambda a, w: torch.matmul(a, w.t())}
    if "onednn" in names:
        from mindrl.kernels.cpu_linear import onednn_linear

        kernels["onednn"] = onednn_linear
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    per_shape, best_by_kernel = {}, {}
    try:
        for kernel in names:
            fn = kernels[kernel]
            for m in tokens:
                for k, n in shape.gemm_shapes():
                    a, w = torch.randn(m, k, device=device), torch.randn(n, k, device=device)  # w: a linear's [out, in]
                    fn(a, w)  # warm-up (packing, page faults; kernel selection)
                    sync()
                    reps, t0 = 0, time.perf_counter()
                    best = float("inf")
                    while reps < 3 or time.perf_counter() - t0 < seconds:
                        t1 = time.perf_counter()
                        fn(a, w)
                        sync()
                        best = min(best, time.perf_counter() - t1)
                        reps += 1
                    rate = per_shape[f"{kernel} {m}x{k}x{n}"] = 2.0 * m * k * n / best / 1e9
                    best_by_kernel[kernel] = max(rate, best_by_kernel.get(kernel, 0.0))
    finally:
        torch.set_num_threads(old)
    return per_shape, best_by_kernel


def read_bandwidth(threads: int, nbytes: int | None = None, seconds: float = 0.3) -> float:
    """Best streaming read rate (GB/s) of this host's memory with `threads` torch threads: torch.sum over an fp32
    buffer of `nbytes` (default: four times the last-level cache, 512 MiB to 2 GiB, so the reads come from DRAM).
    The best rate KV-cached generation can read its cache at (`bench_vs_trl`'s floor)."""
    import torch

    if nbytes is None:
        nbytes = min(2 << 30, max(512 << 20, 4 * last_level_cache_bytes()))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        buf.sum()  # warm-up: the pages are faulted in by ones(); this one settles the threads
        reps, best, t0 = 0, float("inf"), time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < seconds:
            t1 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t1)
            reps += 1
    finally:
        torch.set_num_threads(old)
    return buf.numel() * 4 / best / 1e9


def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 in bytes, from sysfs (0 where sysfs does not say)."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def describe_peak(peak: dict) -> str:
    """'338.1 GFLOP/s (torch.matmul 212.0, onednn 338.1)': the peak and each kernel's best."""
    kernels = ", ".join(f"{k} {v:.1f}" for k, v in peak["kernels"].items())
    return f"{peak['peak_gflops']:.1f} GFLOP/s ({kernels})"


# ------------------------------------------------------------------------------------------- on the ranks
def make_batch(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, kl: bool, seed: int = 0):
    """A GRPO batch in the trainer's layout: prompts*n rows, every prompt and response full length (no padding), its
    group size n as the trainer's batches carry it (the update computes each prompt once for its n samples)."""
    import torch

    from mindrl.batch import Batch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * n
    prompt_ids = torch.randint(300, vocab, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    responses = torch.randint(300, vocab, (rows, response_len), generator=g)
    data = {
        "input_ids": torch.cat([prompt_ids, responses], 1),
        "attention_mask": torch.ones(rows, prompt_len + response_len, dtype=torch.long),
        "responses": responses,
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "rollout_log_prob": -torch.rand(rows, response_len, generator=g) * 8,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous(),
    }
    if kl:
        data["ref_log_prob"] = data["rollout_log_prob"] + 0.1 * torch.randn(rows, response_len, generator=g)
    return Batch(data, meta={"prompt_length": prompt_len}, group_size=n)  # n samples of each prompt, consecutive


def _update_rank(load_dir: str, tp: int, batch, iterations: int, micro_batch_size: int, lr: float, kl: bool,
                 profile: bool, top: int = 12, dtype: str = "float32", lora_r: int = 0,
                 lora_alpha: float = 0.0) -> dict:  # fmt: skip
    """On every rank: `iterations`+1 actor updates of the whole batch (the first a warm-up), then one profiled.
    lora_r > 0: a second actor from the same checkpoint with LoRA adapters (rank lora_r, on every linear) takes an
    update after each of the full model's, so that both see the same load; its times are `lora_times`."""
    import torch
    from megatron.core import parallel_state as ps

    from mindrl.batch import shard_rows
    from mindrl.config.settings import LORA_TARGETS, LoRASettings
    from mindrl.platform.detect import current_platform
    from mindrl.workers.profiling import time_breakdown
    from mindrl.workers.rl_model import PPOLossSettings, ppo_update
    from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer

    total = iterations + 1 + int(profile)
    _, ddp, optimizer, scheduler = build_model_and_optimizer(load_dir, tp, 1, OptimSettings(lr=lr), total_steps=total,
                                                             dtype=dtype)  # fmt: skip
    adapted = None
    if lora_r:
        lora = LoRASettings(lora_target_modules=list(LORA_TARGETS), lora_r=lora_r, lora_alpha=lora_alpha)
        adapted = build_model_and_optimizer(load_dir, tp, 1, OptimSettings(lr=lr), total_steps=total, dtype=dtype,
                                            lora=lora)[1:]  # fmt: skip
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    shard = batch.index(shard_rows(len(batch), dp, 1)[dp_rank])
    loss = PPOLossSettings(kl_loss_coef=0.04 if kl else 0.0)
    sync = current_platform().synchronize
    times, cpu, lora_times, lora_cpu = [], [], [], []

    def timed(model, opt, sched) -> tuple[float, float]:
        sync()
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        ppo_update(model, opt, sched, shard, "actor", loss, micro_batch_size, 1, 1)
        sync()
        torch.distributed.barrier()
        return time.perf_counter() - t0, time.process_time() - c0

    for i in range(iterations + 1):
        t, c = timed(ddp, optimizer, scheduler)
        if adapted is not None:
            lt, lc = timed(*adapted)
        if i:
            times.append(t)
            cpu.append(c)
            if adapted is not None:
                lora_times.append(lt)
                lora_cpu.append(lc)
    breakdown = None
    if profile:
        torch.distributed.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            with torch.profiler.record_function("mindrl::actor_update"):  # the thread the breakdown counts
                ppo_update(ddp, optimizer, scheduler, shard, "actor", loss, micro_batch_size, 1, 1)
            wall = time.perf_counter() - t0
        breakdown = time_breakdown(prof.events(), wall)  # the optimizer's ops: ppo_update's optimizer range
        breakdown["wall"] = wall
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        breakdown["_top_ops"] = table if torch.distributed.get_rank() == 0 else ""
    return {
        "times": times,
        "cpu": cpu,
        "lora_times": lora_times,
        "lora_cpu": lora_cpu,
        "breakdown": breakdown,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------------- driver
def update_flops(shape: ModelShape, rows: int, seq_len: int) -> float:
    """Forward + backward: 6 * N * tokens + 3 * the (full-square) attention forward. Issue 16's model FLOPs: every
    row's prompt counted (what MFU and the roofline bound are charged, on either side)."""
    return 6.0 * shape.matmul_params * rows * seq_len + 3 * rows * shape.attention_flops(seq_len, causal=False)


def computed_forward_flops(shape: ModelShape, prompts: int, n: int, prompt_len: int, response_len: int) -> float:
    """One forward of prompts x n rows as mindrl computes it: with n > 1 as prefix groups
    (`mindrl.models.attention.PrefixGroups`), 2 * N per packed position (each prompt once, then its n responses) and
    attention the prompt's square once and each response over [prompt, itself]; with n = 1 row by row (the full
    square)."""
    seq = prompt_len + response_len
    if n < 2:
        return 2.0 * shape.matmul_params * prompts * seq + prompts * shape.attention_flops(seq, causal=False)
    positions = prompts * (prompt_len + n * response_len)
    attention = shape.attention_flops(prompt_len, False) + n * shape.attention_flops(response_len, False, keys=seq)
    return 2.0 * shape.matmul_params * positions + prompts * attention


def computed_update_flops(shape: ModelShape, prompts: int, n: int, prompt_len: int, response_len: int) -> float:
    """Forward + backward (3x the forward) as mindrl computes them (`computed_forward_flops`); `update_flops` where
    n = 1. What the hardware utilisation (HFU) is charged."""
    return 3 * computed_forward_flops(shape, prompts, n, prompt_len, response_len)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (default 1,2)")
    p.add_argument("--cores", type=int, default=2, help="cores shared by the ranks: a TPk layout runs k ranks "
                   "of cores/k threads (default 2)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=30)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--iterations", type=int, default=3, help="timed updates per layout (after one warm-up)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype (bfloat16: megatron bf16 with fp32 main params and gradients)")  # fmt: skip
    p.add_argument("--kl", action="store_true", help="a k3 KL term (coef 0.04) against given reference logprobs")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="also time a LoRA actor (rank R on every linear, "
        "the backbone frozen) from the same checkpoint, its updates alternating with the full model's",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="the LoRA scale's alpha (default 2R)")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler breakdown")
    p.add_argument("--top", type=int, default=12, help="rows of the profile's table of ops (default 12)")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hf-dir", default=None, help="benchmark this HF Qwen2 checkpoint (its config.json sets the "
                   "shape) instead of generating one")  # fmt: skip
    p.add_argument("--workdir", default=None, help="model and checkpoint folder (default: a temporary one)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    a = p.parse_args(argv)
    tps = [int(x) for x in a.tp.split(",")]
    for tp in tps:
        if a.cores % tp:
            p.error(f"--tp {tp} does not divide --cores {a.cores}")
        if a.num_heads % tp or a.num_kv_heads % tp:
            p.error(f"--tp {tp} must divide the heads ({a.num_heads}) and KV heads ({a.num_kv_heads})")

    from mindrl.checkpoint import convert
    from mindrl.launch import RankPool
    from mindrl.platform.detect import current_platform

    platform = current_platform()
    device = str(platform.device(0))  # the ranks' device: TPk runs on devices 0..k-1 (on CPU: the cores)
    where = device if platform.name != "cpu" else f"{a.cores} threads"
    if platform.name != "cpu" and max(tps) > platform.device_count():
        p.error(f"--tp {max(tps)} needs {max(tps)} {platform.name} devices, this host has {platform.device_count()}")
    from tools.scratch import scratch_dir

    work = scratch_dir(a.workdir, "bench_update_")
    if a.hf_dir:
        shape, hf = ModelShape.from_hf(a.hf_dir), a.hf_dir
    else:
        shape = ModelShape(a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.ffn, a.vocab_size)
        hf = make_model(os.path.join(work, "hf"), shape)
    seq = a.prompt_len + a.response_len
    rows = a.prompts * a.n
    tokens = rows * seq
    flops = update_flops(shape, rows, seq)
    group = math.gcd(a.n, a.micro_batch_size)  # the rows of a prompt that share a micro-batch (rl_model._plan)
    computed = computed_update_flops(shape, rows // group, group, a.prompt_len, a.response_len)
    peak = matmul_peak(shape, a.cores, tokens=(a.micro_batch_size * seq, 2048), device=device)
    print(f"model: N = {shape.matmul_params / 1e6:.1f}M matmul params; batch {rows} rows x {seq} tokens = {tokens}; "
          f"{flops / 1e12:.3f} TFLOP per update ({computed / 1e12:.3f} computed: prompts shared by their {a.n} "
          f"samples); matmul peak {describe_peak(peak)} "
          f"({where})", flush=True)  # fmt: skip
    batch = make_batch(a.prompts, a.n, a.prompt_len, a.response_len, shape.vocab_size, a.kl)
    from tools.bench_update import _update_rank  # importable by the ranks (not __main__)

    results = []
    for tp in tps:
        ckpt = os.path.join(work, f"mcore_tp{tp}")
        with RankPool(tp, threads=a.cores // tp, timeout_s=3600) as pool:
            if not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
                convert.hf2mcore(hf, ckpt, tp, 1, overwrite=True, pool=pool)
            print(f"TP{tp}: {tp} rank(s) x {a.cores // tp} thread(s), {a.iterations} timed updates ...", flush=True)
            res = pool.run(_update_rank, ckpt, tp, batch, a.iterations, a.micro_batch_size, a.lr, a.kl,
                           not a.no_profile, a.top, a.dtype, a.lora, a.lora_alpha or 2.0 * a.lora)  # fmt: skip
        per_iter = [max(r["times"][i] for r in res) for i in range(a.iterations)]  # the slowest rank counts
        step_s = statistics.median(per_iter)
        cpu_s = statistics.median(sum(r["cpu"][i] for r in res) for i in range(a.iterations))  # all ranks' CPU
        row = {
            "tp": tp,
            "ranks": tp,
            "threads_per_rank": res[0]["threads"],
            "step_s": step_s,
            "times": per_iter,
            "cpu_s": cpu_s,
            "tokens_per_s": tokens / step_s,
            "flops": flops,
            "gflops": flops / step_s / 1e9,
            "mfu": flops / step_s / 1e9 / peak["peak_gflops"],
            "computed_flops": computed,
            "hfu": computed / step_s / 1e9 / peak["peak_gflops"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in res),
            "profile": None,
        }
        if res[0]["breakdown"] is not None:
            b = dict(res[0]["breakdown"])
            top = b.pop("_top_ops")
            row["profile"] = b
            if top:
                print(top, flush=True)
        results.append(row)
        print(f"TP{tp}: {step_s:.3f} s/update, {row['tokens_per_s']:.0f} tokens/s, MFU {row['mfu']:.1%}, "
              f"HFU {row['hfu']:.1%}", flush=True)  # fmt: skip
        if a.lora:
            lora_iter = [max(r["lora_times"][i] for r in res) for i in range(a.iterations)]
            row["lora"] = {
                "r": a.lora,
                "step_s": statistics.median(lora_iter),
                "times": lora_iter,
                "cpu_s": statistics.median(sum(r["lora_cpu"][i] for r in res) for i in range(a.iterations)),
            }
            lr_ = row["lora"]
            print(f"TP{tp}: full update {step_s:.3f} s ({cpu_s:.2f} CPU s), LoRA r {a.lora} update "
                  f"{lr_['step_s']:.3f} s ({lr_['cpu_s']:.2f} CPU s): LoRA / full {lr_['step_s'] / step_s:.2f} "
                  f"wall, {lr_['cpu_s'] / cpu_s:.2f} CPU (medians, alternating)", flush=True)  # fmt: skip

    cats = ("gemm", "elementwise", "optimizer", "communication", "python")
    print(f"\n{'layout':<8}{'ranks x thr':>12}{'update s':>10}{'tokens/s':>10}{'GFLOP/s':>9}{'MFU':>7}{'HFU':>7}"
          f"{'RSS MiB':>9}  profile (rank 0, one update): " + ", ".join(cats))  # fmt: skip
    for r in results:
        prof = r["profile"]
        split = "-" if prof is None else "  ".join(
            f"{c} {prof[c]:.2f}s ({prof[c] / prof['wall']:.0%})" for c in cats)  # fmt: skip
        print(f"TP{r['tp']:<6}{r['ranks']:>6} x {r['threads_per_rank']:<4}{r['step_s']:>10.3f}"
              f"{r['tokens_per_s']:>10.0f}{r['gflops']:>9.1f}{r['mfu']:>7.1%}{r['hfu']:>7.1%}{r['peak_rss_mb']:>9.0f}"
              f"  {split}")  # fmt: skip
    print(
        f"FLOPs per update = 6*N*T + attention = {flops:.3e}; MFU = those FLOPs / s / matmul peak "
        f"{describe_peak(peak)} (best fp32 GEMM at the model's GEMM shapes, {where}); HFU = the FLOPs computed "
        f"({computed:.3e}: each prompt once for its {a.n} samples) / s / peak"
    )
    out = {
        "peak_gflops": peak["peak_gflops"],
        "matmul": peak,
        "model": asdict(shape) | {"matmul_params": shape.matmul_params},
        "batch": {"rows": rows, "seq_len": seq, "tokens": tokens, "micro_batch_size": a.micro_batch_size},
        "kl": a.kl,
        "iterations": a.iterations,
        "results": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
