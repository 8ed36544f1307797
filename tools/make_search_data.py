#!/usr/bin/env python
"""Write a search task for the tiny model (configs/search_tiny_cpu.yaml, docs/agentic.md): questions about fictional
people whose answer, a 3-digit badge number, is written only in a corpus, so the model can answer only by calling
the search tool against mindrl-retrieval. DeepScaleR's JSON format, two DISJOINT splits (no person is in both):

  OUT/corpus.jsonl  Search-R1's corpus format for mindrl-retrieval: per person `{"id", "contents": "<name>\\n<name>'s
                    badge number is <k>."}`, and as many distractor rows naming their first and last names apart.
  OUT/sft.json      tool-use traces in the agent loop's own format (Qwen2.5's hermes `<tool_call>`, the search tool's
                    output as a `<tool_response>` user turn, written by BM25 over the corpus exactly as the server
                    answers, then the answer); a share (--tool-share) call the tool, the others guess.
  OUT/rl.json       the RL prompts, labelled with the badge number, graded by retool_reward.
  OUT/tools.yaml    the search tool (mindrl's SearchTool at --retrieval-url, topk 1) for rl_config.tool_config_path.
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

TOOL_NAME = "search"
TOPK = 1
FIRST = ("Kalo", "Miren", "Rudo", "Zeta", "Tavi", "Vono", "Nisa", "Pemo", "Lusk", "Dari", "Fenn", "Gorv", "Hale",
         "Isko", "Jari", "Oren")  # fmt: skip
LAST = ("Balder", "Corvin", "Duskel", "Eppart", "Frame", "Gimble", "Harrow", "Ilsen", "Jorrin", "Kettle", "Lomax",
        "Murrow", "Nettle", "Orrin", "Pike", "Quill")  # fmt: skip
TEMPLATES = ("What is the badge number of {name}?", "Which badge number does {name} have?")


def people(seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(f"{a} {b}", rng.randint(100, 999)) for a, b in itertools.product(FIRST, LAST)]


def corpus(persons: list[tuple[str, int]], seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    rows = [
        {"id": f"p{i}", "contents": f"{name}\n{name}'s badge number is {k}."} for i, (name, k) in enumerate(persons)
    ]
    for i, (name, _) in enumerate(persons):  # a first name and a last name alone match other people's rows too
        first, last = name.split()
        rows.append({"id": f"d{i}", "contents": f"{first} notes\n{first} keeps a badge like {last} does, "
                                                f"number {rng.randint(100, 999)} aside."})  # fmt: skip
    return rows


def tool_call(name: str) -> str:
    call = {"name": TOOL_NAME, "arguments": {"query_list": [name]}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def trace(name: str, k: int, observation: str) -> str:
    """The response of an episode that uses the tool (the SFT handler closes it with the end token)."""
    return tool_call(name) + OBSERVATION.format(out=observation) + f"The answer is \\boxed{{{k}}}."


def observations(rows: list[dict], names: list[str]) -> list[str]:
    """What the search tool shows for each name as the query: BM25's top hit over `rows` (mindrl-retrieval's), in
    the tool's format."""
    from mindrl.agent.retrieval import Retriever
    from mindrl.agent.tools import _passages

    hits = Retriever(rows).search(names, TOPK)
    return [_passages([{"document": row, "score": s} for row, s in q]) for q in hits]


def make_splits(seed: int, sft_people: int, tool_share: float) -> tuple[list[dict], list[dict], list[dict]]:
    """(corpus rows, SFT rows, RL rows): the first `sft_people` people (shuffled) train SFT, the others are RL's."""
    persons = people(seed)
    rows = corpus(persons, seed)
    rng = random.Random(seed + 2)
    rng.shuffle(persons)
    seen = observations(rows, [n for n, _ in persons])
    for (name, k), obs in zip(persons, seen):
        if f"{name}'s badge number is {k}." not in obs:
            raise RuntimeError(f"BM25's top hit for {name!r} is not its row: {obs!r}")
    sft, rl = [], []
    for i, ((name, k), obs) in enumerate(zip(persons, seen)):
        problem = rng.choice(TEMPLATES).format(name=name)
        if i < sft_people:
            guess = rng.randint(100, 999)
            text = trace(name, k, obs) if rng.random() < tool_share else f"The answer is \\boxed{{{guess}}}."
            sft.append({"problem": problem, "answer": str(k), "solution": text})
        else:
            rl.append({"problem": problem, "answer": str(k), "solution": trace(name, k, obs)})
    return rows, sft, rl


def tool_config(url: str) -> dict:
    return {"tools": [{
        "class_name": "mindrl.agent.tools.SearchTool",
        "config": {"retrieval_service_url": url, "topk": TOPK, "timeout": 30},
        "tool_schema": {"type": "function", "function": {
            "name": TOOL_NAME, "description": "Searches a corpus for documents about the queries.",
            "parameters": {"type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}}},
                           "required": ["query_list"]}}},
    }]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", required=True, help="output directory (created): corpus.jsonl, sft.json, rl.json, tools.yaml"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-people", type=int, default=192, help=f"people of the SFT split (of {len(FIRST) * len(LAST)})")
    p.add_argument("--tool-share", type=float, default=0.75, help="share of the SFT traces that call the tool")
    p.add_argument("--retrieval-url", default="http://127.0.0.1:8000/retrieve", help="mindrl-retrieval's /retrieve")
    a = p.parse_args(argv)
    if not 0 < a.sft_people < len(FIRST) * len(LAST):
        p.error(f"--sft-people: between 1 and {len(FIRST) * len(LAST) - 1}, got {a.sft_people}")
    rows, sft, rl = make_splits(a.seed, a.sft_people, a.tool_share)
    write_task(a.out, sft, rl, tool_config(a.retrieval_url))
    with open(os.path.join(a.out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {a.out}/corpus.jsonl ({len(rows)} rows), sft.json ({len(sft)}), rl.json ({len(rl)}), tools.yaml")


if __name__ == "__main__":
    main()
