#!/usr/bin/env python
"""Benchmark mindrl-preprocess: rows/s for 1 and 2 workers on a synthetic DeepScaleR-style JSON list.

Each configuration runs --repeats times and the median is reported, next to a peer in the same run: a plain
single-process loop of tokenizer.apply_chat_template + megatron's IndexedDatasetBuilder (how such scripts are
usually written). Wall time covers the whole call (tokenizer load, worker start, reading, writing).

    python tools/bench_preprocess.py                       # tiny tokenizer, 20000 rows, 3 repeats
    python tools/bench_preprocess.py --tokenizer ./model_from_hf/qwen25-7b --rows 100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

R1 = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> "
    "reasoning process here </think><answer> answer here </answer>. Put your final answer within \\boxed{}."
)


def synthetic_deepscaler(path: str, rows: int, seed: int = 0) -> None:
    """DeepScaleR-like rows: a LaTeX word problem of a few hundred characters, a short answer, a solution."""
    rng = random.Random(seed)
    words = "let find the number of real solutions integer triangle area probability sum product such that".split()
    with open(path, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(rows):
            body = " ".join(rng.choice(words) for _ in range(rng.randint(20, 90)))
            a, b = rng.randint(1, 999), rng.randint(2, 99)
            row = {
                "problem": f"Let $x = \\frac{{{a}}}{{{b}}}$ and $y^2 = {a * b}$. {body.capitalize()}?",
                "answer": f"\\frac{{{a + b}}}{{{b}}}",
                "solution": f"By the given, {body[:200]} so the answer is $\\boxed{{\\frac{{{a + b}}}{{{b}}}}}$.",
            }
            f.write(("," if i else "") + json.dumps(row) + "\n")
        f.write("]\n")


def run_mindrl(inp: str, tok: str, prefix: str, workers: int) -> float:
    import io

    from mindrl.data.preprocess import preprocess
    from mindrl.data.preprocess_config import PreprocessConfig

    cfg = PreprocessConfig(
        input=inp,
        tokenizer_name_or_path=tok,
        output_prefix=prefix,
        handler_name="R1AlpacaStyleInstructionHandler",
        prompt_type="qwen_r1",
        map_keys={"prompt": "problem", "query": "", "response": "answer", "system": ""},
        dataset_additional_keys=["labels"],
        workers=workers,
        log_interval=10**9,
    )
    t = time.perf_counter()
    preprocess(cfg, log=io.StringIO())
    return time.perf_counter() - t


def run_peer(inp: str, tok: str, prefix: str) -> float:
    """The usual hand-written loop: one apply_chat_template call and one builder item per row."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    t = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tok)
    with open(inp, encoding="utf-8") as f:
        rows = json.load(f)
    keys = ("input_ids", "attention_mask", "labels")
    builders = {k: IndexedDatasetBuilder(f"{prefix}_packed_{k}_document.bin", dtype=np.int32) for k in keys}
    for row in rows:
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": R1 + "\n" + row["problem"]},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        labels = tokenizer(row["answer"].strip(), add_special_tokens=False)["input_ids"]
        for k, v in (("input_ids", ids), ("attention_mask", [1] * len(ids)), ("labels", labels)):
            builders[k].add_item(torch.tensor(v, dtype=torch.int32))
            builders[k].end_document()
    for k in keys:
        builders[k].finalize(f"{prefix}_packed_{k}_document.idx")
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20000, help="synthetic rows (default 20000)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median is reported")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    p.add_argument("--tokenizer", default="", help="HF tokenizer dir (default: the tiny ChatML tokenizer, built here)")
    p.add_argument("--no-peer", action="store_true", help="skip the apply_chat_template + builder peer loop")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (import cost kept out of the timings)

    with tempfile.TemporaryDirectory() as tmp:
        tok = args.tokenizer
        if not tok:
            from tools.make_tiny_model import make_tokenizer

            tok = os.path.join(tmp, "tok")
            make_tokenizer(tok, vocab_size=1024)
        inp = os.path.join(tmp, "deepscaler.json")
        synthetic_deepscaler(inp, args.rows)
        results: dict[str, list[float]] = {}
        for r in range(args.repeats):
            if not args.no_peer:
                results.setdefault("peer: apply_chat_template loop", []).append(
                    run_peer(inp, tok, os.path.join(tmp, f"peer{r}"))
                )
            for w in (int(x) for x in args.workers.split(",")):
                results.setdefault(f"mindrl workers={w}", []).append(
                    run_mindrl(inp, tok, os.path.join(tmp, f"w{w}_{r}"), w)
                )
        same = None
        if not args.no_peer:
            with open(os.path.join(tmp, "peer0_packed_input_ids_document.bin"), "rb") as a:
                with open(
                    os.path.join(tmp, f"w{args.workers.split(',')[0]}_0_packed_input_ids_document.bin"), "rb"
                ) as b:
                    same = a.read() == b.read()

    peer = statistics.median(results["peer: apply_chat_template loop"]) if not args.no_peer else None
    print(
        f"\n{args.rows} DeepScaleR-style rows, qwen_r1, R1AlpacaStyleInstructionHandler; median of {args.repeats}; "
        f"{os.cpu_count()} CPUs; TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}"
    )
    print(f"{'configuration':34} {'median s':>9} {'rows/s':>9} {'vs peer':>8}   all runs (s)")
    for name, times in results.items():
        med = statistics.median(times)
        ratio = f"{peer / med:.2f}x" if peer else "-"
        print(f"{name:34} {med:9.2f} {args.rows / med:9.0f} {ratio:>8}   {', '.join(f'{t:.2f}' for t in times)}")
    if same is not None:
        print(f"peer input_ids identical to mindrl's: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
