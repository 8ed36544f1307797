#!/usr/bin/env python
"""Write the quickstart's synthetic task in DeepScaleR's JSON format ({"problem", "answer", "solution"}).

The task: "Which number is larger: 3 or 8?" over pairs of distinct digits, asked in a few phrasings.
Two DISJOINT splits (no problem text is in both):

  OUT/sft.json   instruction data for mindrl-sft. Its answers are a RANDOM one of the two numbers (not the
                 larger one!), with the solution "The answer is \\boxed{X}.": SFT teaches the answer format and
                 to answer with one of the two numbers, but not the task, so the model solves about half.
  OUT/rl.json    the RL prompts, labelled with the correct (larger) number, graded by acc_for_ppo
                 (1 when the last \\boxed{} equals the label): the room RL has to learn in.

Preprocess (both with the qwen chat template, so SFT and RL see the same prompts):

  bash examples/data/preprocess_data.sh deepscaler input=OUT/rl.json tokenizer_name_or_path=HF \\
      output_prefix=DATA/train prompt_type=qwen
  bash examples/data/preprocess_data.sh deepscaler input=OUT/sft.json tokenizer_name_or_path=HF \\
      output_prefix=DATA/sft prompt_type=qwen handler_name=AlpacaStyleInstructionHandler \\
      'map_keys={prompt: problem, response: solution}'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random

TEMPLATES = (
    "Which number is larger: {a} or {b}?",
    "Which is bigger, {a} or {b}?",
    "What is the larger of {a} and {b}?",
    "Pick the larger number: {a}, {b}.",
)


def problems() -> list[tuple[str, int, int]]:
    """Every (problem text, a, b): ordered pairs of distinct digits in every phrasing."""
    pairs = [(a, b) for a, b in itertools.product(range(10), repeat=2) if a != b]
    return [(t.format(a=a, b=b), a, b) for t in TEMPLATES for a, b in pairs]


def make_splits(seed: int = 0, sft_rows: int = 2048, rl_fraction: float = 0.5) -> tuple[list[dict], list[dict]]:
    """(sft rows, rl rows). The problems are shuffled and cut in two disjoint sets; the SFT rows sample their
    set with replacement, each with a fresh random answer, so every SFT problem is answered both ways."""
    rng = random.Random(seed)
    pool = problems()
    rng.shuffle(pool)
    n_rl = int(round(rl_fraction * len(pool)))
    rl_set, sft_set = pool[:n_rl], pool[n_rl:]
    rl = [
        {"problem": p, "answer": str(max(a, b)), "solution": f"{max(a, b)} > {min(a, b)}, so \\boxed{{{max(a, b)}}}."}
        for p, a, b in rl_set
    ]
    sft = []
    for _ in range(sft_rows):
        p, a, b = rng.choice(sft_set)
        pick = rng.choice((a, b))
        sft.append({"problem": p, "answer": str(pick), "solution": f"The answer is \\boxed{{{pick}}}."})
    return sft, rl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created): sft.json and rl.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and of the random SFT answers")
    p.add_argument("--sft-rows", type=int, default=2048, help="SFT rows (sampled from the SFT problems)")
    p.add_argument("--rl-fraction", type=float, default=0.5, help="share of the problems held out for RL")
    a = p.parse_args(argv)
    if not 0 < a.rl_fraction < 1:
        p.error(f"--rl-fraction must be in (0, 1), got {a.rl_fraction}")
    sft, rl = make_splits(a.seed, a.sft_rows, a.rl_fraction)
    os.makedirs(a.out, exist_ok=True)
    for name, rows in (("sft", sft), ("rl", rl)):
        with open(os.path.join(a.out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    n_sft = len({r["problem"] for r in sft})
    print(f"wrote {a.out}/sft.json ({len(sft)} rows, {n_sft} problems) and {a.out}/rl.json ({len(rl)} problems)")


if __name__ == "__main__":
    main()
