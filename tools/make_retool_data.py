#!/usr/bin/env python
"""Write the retool quickstart's task (`bash examples/quickstart_cpu.sh retool`) in DeepScaleR's JSON format: products
of two 2-digit numbers, which the tiny model cannot compute in its head but can with the code tool.

Two DISJOINT splits (no problem text is in both):

  OUT/sft.json   tool-use traces for mindrl-sft, in the agent loop's own format (Qwen2.5's hermes `<tool_call>`, the
                 tool's output as a `<tool_response>` user turn, then the answer). A share of the traces
                 (--tool-share) call the code tool and copy its output into \\boxed{}; the others answer at once with
                 a guess. SFT teaches the format and both habits; RL has to learn which one pays.
  OUT/rl.json    the RL prompts, labelled with the product, graded by retool_reward (1 when the last \\boxed{}
                 equals the label; else -1 plus 0.1 per tool call, capped at 0).
  OUT/tools.yaml the code tool (mindrl's CodeTool at --sandbox-url) for rl_config.tool_config_path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools._task_data import OBSERVATION, write_task  # noqa: E402

TEMPLATES = ("What is {a} * {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}.")
TOOL_NAME = "code"


def tool_call(a: int, b: int) -> str:
    call = {"name": TOOL_NAME, "arguments": {"code": f"print({a}*{b})"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def trace(a: int, b: int) -> str:
    """The response of an episode that uses the tool (the SFT handler closes it with the end token)."""
    return tool_call(a, b) + OBSERVATION.format(out=f"{a * b}\n") + f"The answer is \\boxed{{{a * b}}}."


def problems() -> list[tuple[str, int, int]]:
    return [(t.format(a=a, b=b), a, b) for t in TEMPLATES for a, b in itertools.product(range(10, 100), repeat=2)]


def make_splits(seed: int, sft_rows: int, rl_rows: int, tool_share: float) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pool = rng.sample(problems(), sft_rows + rl_rows)
    sft = []
    for p, a, b in pool[:sft_rows]:
        guess = a * b + rng.choice((-1, 1)) * rng.randint(1, 500)
        text = trace(a, b) if rng.random() < tool_share else f"The answer is \\boxed{{{guess}}}."
        sft.append({"problem": p, "answer": str(a * b), "solution": text})
    rl = [{"problem": p, "answer": str(a * b), "solution": trace(a, b)} for p, a, b in pool[sft_rows:]]
    return sft, rl


def tool_config(url: str) -> dict:
    return {"tools": [{
        "class_name": "mindrl.agent.tools.CodeTool",
        "config": {"sandbox_fusion_url": url, "default_timeout": 10, "memory_limit_mb": 256, "rate_limit": 8},
        "tool_schema": {"type": "function", "function": {
            "name": TOOL_NAME, "description": "Runs Python code and returns what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    }]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created): sft.json, rl.json, tools.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-rows", type=int, default=2048)
    p.add_argument("--rl-rows", type=int, default=1024)
    p.add_argument("--tool-share", type=float, default=0.5, help="share of the SFT traces that call the tool")
    p.add_argument("--sandbox-url", default="http://127.0.0.1:8080/run_code", help="the code tool's /run_code URL")
    a = p.parse_args(argv)
    sft, rl = make_splits(a.seed, a.sft_rows, a.rl_rows, a.tool_share)
    write_task(a.out, sft, rl, tool_config(a.sandbox_url))
    print(f"wrote {a.out}/sft.json ({len(sft)} rows), {a.out}/rl.json ({len(rl)}), {a.out}/tools.yaml")


if __name__ == "__main__":
    main()
