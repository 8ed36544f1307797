#!/usr/bin/env python
"""Benchmark packed rows and token-budget micro-batches (`rl_model.MicroBatching`) against padded row-count ones: the
actor's logprob forward and update on one rank, rows of very different lengths. Reports the best of --iterations.

    python tools/bench_packing.py                 # 32 rows, prompts 16-63 tokens, responses 4-383 (skewed short)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rank(load_dir: str, batch, variants: dict, iterations: int) -> dict:
    from mindrl.workers import rl_model
    from mindrl.workers.rl_model import PPOLossSettings, ppo_update
    from mindrl.workers.train_setup import OptimSettings, build_model_and_optimizer

    _, ddp, optimizer, scheduler = build_model_and_optimizer(
        load_dir, 1, 1, OptimSettings(lr=0.0, clip_grad=1e9), total_steps=1000
    )
    out = {}
    for name, micro in variants.items():
        forward, update = [], []
        for i in range(iterations + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            rl_model.response_logprobs(ddp, batch, micro, 1.0)
            t1 = time.perf_counter()
            result = ppo_update(ddp, optimizer, scheduler, batch, "actor", PPOLossSettings(), micro, 1, 1)
            if i:
                forward.append(t1 - t0)
                update.append(time.perf_counter() - t1)
        out[name] = (min(forward), min(update), result.tokens.computed, result.tokens.real)
    return out


def _batch(rows: int, seed: int):
    import torch

    from mindrl.batch import Batch, pad_rows

    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(16, 64, (rows,), generator=g).tolist()
    response_lens = [int(x) for x in (torch.rand(rows, generator=g) ** 2 * 380 + 4).tolist()]
    prompts = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in response_lens]
    prompt_ids, prompt_mask = pad_rows(prompts, 0, True)
    response_ids, response_mask = pad_rows(responses, 0, False)
    batch = Batch(
        {
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "responses": response_ids,
            "response_mask": response_mask,
        },
        meta={"prompt_length": prompt_ids.shape[1]},
    )
    batch.update(
        {
            "advantages": torch.randn(response_ids.shape, generator=g) * response_mask,
            "rollout_log_prob": torch.zeros(response_ids.shape),
        }
    )
    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--workdir", default=None, help="model folder (default: a temporary one)")
    a = p.parse_args()

    from mindrl.checkpoint import convert
    from mindrl.launch import RankPool
    from mindrl.workers.rl_model import MicroBatching
    from tools.bench_packing import _rank  # importable by the rank (not __main__)
    from tools.make_tiny_model import make_tiny_model

    work = a.workdir or tempfile.mkdtemp(prefix="bench_packing_")
    hf, load = os.path.join(work, "hf"), os.path.join(work, "mcore")
    batch = _batch(a.rows, 0)
    mbs, budget = a.micro_batch_size, a.token_budget
    variants = {
        f"padded, {mbs} rows": MicroBatching(mbs),
        f"packed, {mbs} rows": MicroBatching(mbs, packed=True),
        f"padded, {budget} tokens": MicroBatching(mbs, budget),
        f"packed, {budget} tokens": MicroBatching(mbs, budget, packed=True),
    }
    with RankPool(1, timeout_s=1800) as pool:
        if not os.path.isdir(load):
            make_tiny_model(hf, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768,
                            vocab_size=4096)  # fmt: skip
            convert.hf2mcore(hf, load, 1, 1, pool=pool)
        results = pool.run(_rank, load, batch, variants, a.iterations)[0]
    print(f"{a.rows} rows, {int(batch['attention_mask'].sum())} real tokens, batch width {batch['input_ids'].shape[1]}")
    for name, (forward, update, computed, real) in results.items():
        print(
            f"  {name:<22} forward {forward:.3f} s  update {update:.3f} s  computed {computed:.0f} of {real:.0f} real"
        )


if __name__ == "__main__":
    main()
