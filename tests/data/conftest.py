"""Shared fixtures for the data tests: one tiny ChatML tokenizer and one DeepScaleR-style file per session."""

from __future__ import annotations

import json
import random

import pytest


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> str:
    from tools.make_tiny_model import make_tokenizer

    out = str(tmp_path_factory.mktemp("tiny_tok"))
    make_tokenizer(out, vocab_size=1024)
    return out


@pytest.fixture(scope="session")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def deepscaler_rows(n: int, seed: int = 0) -> list[dict]:
    """DeepScaleR-format rows (problem, answer, solution, sometimes more keys) with LaTeX braces."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        row = {
            "problem": f"Let $x = \\frac{{{a}}}{{{b}}}$. Find {a} + {b} " + "and so on " * rng.randint(0, 30),
            "answer": f"\\frac{{{a + b}}}{{{b}}}" if i % 3 else str(a + b),
            "solution": f"We add. \\boxed{{{a + b}}}",
        }
        if i % 5 == 0:
            row["source"] = "amc"
        rows.append(row)
    return rows


@pytest.fixture(scope="session")
def deepscaler_json(tmp_path_factory) -> str:
    """A JSON list of 600 rows, 4 of them bad (null answer, missing problem, empty problem, int answer)."""
    rows = deepscaler_rows(600)
    rows[5]["answer"] = None
    del rows[7]["problem"]
    rows[9]["problem"] = "   "
    rows[11]["answer"] = 12
    path = tmp_path_factory.mktemp("raw") / "deepscaler.json"
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    return str(path)
