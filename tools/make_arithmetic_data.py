#!/usr/bin/env python
"""Write short arithmetic word problems in DeepScaleR's JSON format ({"problem", "answer", "solution"}), seeded.

One-step additions and subtractions ("Tom has 29 coins and gives away 14. How many coins are left?"), each ending
in an instruction on the answer's form; graded by the `gsm8k` verifier (the last number of the response). Two
DISJOINT splits, no problem text in both:

  OUT/train.json   the RL prompts
  OUT/test.json    the held-out problems the evaluation scores (greedy accuracy, pass@k)

    python tools/make_arithmetic_data.py --out data/arith --train 2000 --test 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Noah", "Emma", "Leo", "Zoe", "Max", "Ava")
THINGS = ("apples", "coins", "books", "stickers", "marbles", "pencils", "cards", "shells", "stamps", "cookies")
ADD = (
    "{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
    "{n} had {a} {t}. A friend gave {n} {b} {t}. How many {t} does {n} have?",
    "There are {a} {t} in a box and {n} puts in {b} more. How many {t} are in the box?",
)
SUB = (
    "{n} has {a} {t} and gives away {b}. How many {t} are left?",
    "{n} had {a} {t} and lost {b} of them. How many {t} does {n} have left?",
    "There are {a} {t} in a box and {n} takes out {b}. How many {t} are in the box now?",
)
INSTRUCTION = "Answer with just the number."


def problem(rng: random.Random, max_value: int) -> tuple[str, int]:
    """One word problem and its answer: a + b or a - b (never negative), operands in [1, max_value]."""
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, max_value), rng.randint(1, max_value)
    if rng.random() < 0.5:
        return rng.choice(ADD).format(n=n, t=t, a=a, b=b), a + b
    a, b = max(a, b), min(a, b)
    return rng.choice(SUB).format(n=n, t=t, a=a, b=b), a - b


def make_splits(train: int, test: int, seed: int = 0, max_value: int = 50) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): distinct problems drawn with `seed`, the first `test` of them held out."""
    if train < 1 or test < 0:
        raise ValueError(f"--train must be >= 1 and --test >= 0, got {train} and {test}")
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    budget = 50 * (train + test)
    while len(seen) < train + test and budget:
        text, answer = problem(rng, max_value)
        seen.setdefault(text, answer)
        budget -= 1
    if len(seen) < train + test:
        raise ValueError(
            f"only {len(seen)} distinct problems with operands up to {max_value}; ask for fewer than "
            f"{train + test} or raise --max-value"
        )
    rows = [
        {"problem": f"{text} {INSTRUCTION}", "answer": str(answer), "solution": f"The answer is {answer}."}
        for text, answer in seen.items()
    ]
    return rows[test:], rows[:test]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for train.json and test.json")
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--test", type=int, default=200, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-value", type=int, default=50, help="largest operand")
    a = ap.parse_args(argv)
    train, test = make_splits(a.train, a.test, a.seed, a.max_value)
    os.makedirs(a.out, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(a.out, f"{name}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=0)
        print(f"{path}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
