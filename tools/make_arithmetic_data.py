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
# --frames wide: more names, objects and sentence frames, among them the kinds of question a one-step problem can
# ask besides "how many now" (how many more are needed, how many were lost, how many a second person has); worded
# apart from tools/make_heldout_arithmetic.py's (tests/data/test_heldout_arithmetic.py checks that no frame, name or
# object is shared)
WIDE_NAMES = NAMES + ("Liam", "Isla", "Finn", "Aria", "Theo", "Nina", "Ravi", "Tara", "Hugo", "Lena", "Kai", "Jade")
WIDE_THINGS = THINGS + ("beans", "erasers", "stones", "flowers", "toys", "badges", "rings", "keys", "cups", "boats")
WIDE_ADD = ADD + (
    "{n} picked {a} {t} yesterday and {b} {t} today. How many {t} did {n} pick in all?",
    "{n} owns {a} {t}. For a birthday {n} got {b} more {t}. How many {t} does {n} own now?",
    "A team has {a} {t} and wins {b} more. How many {t} does the team have?",
    "{n} has {b} {t} more than a brother, who has {a} {t}. How many {t} does {n} have?",
    "In one room there are {a} {t} and in another room {b} {t}. How many {t} are there altogether?",
    "{n} drew {a} {t}, then drew {b} more. What is the number of {t} {n} drew?",
    "{n} read {a} pages of a book in the morning and {b} pages at night. How many pages did {n} read?",
    "A farmer has {a} {t} and buys {b} more. How many {t} does the farmer have now?",
)
WIDE_SUB = SUB + (
    "{n} wants {a} {t} and has {b}. How many more {t} does {n} want?",
    "{n} had {a} {t}. Now {n} has {b}. How many {t} did {n} lose?",
    "{n} has {a} {t}. A sister has {b} {t} fewer. How many {t} does the sister have?",
    "{n} has {a} {t}, {b} more than a cousin. How many {t} does the cousin have?",
    "A bag had {a} {t}. {n} ate {b} of them. How many {t} are in the bag now?",
    "Of {a} {t}, {b} were blue and the rest were red. How many {t} were red?",
    "{n} must read {a} pages and has read {b} pages. How many pages are left to read?",
    "{n} spent {b} of {a} {t}. How many {t} are left?",
)
DISTRACTORS = (
    "{n} is in grade {x}. ",
    "The walk took {x} minutes. ",
    "{n} has {x} cousins. ",
    "The bus number was {x}. ",
    "{n} is {x} centimetres taller than last year. ",
)


def columns(a: int, op: str, b: int) -> str:
    """The sum or difference worked column by column, the answer last: "47+38: 7+8=15, 4+3+1=8, so 85",
    "94-59: 14-9=5, 9-5-1=3, so 35" (the borrow and the carry written out, each step one single-digit fact a 135M
    model can look up); one-digit operands give "8+1=9". Operands in [0, 99]; a - b with a >= b."""
    if not (0 <= a <= 99 and 0 <= b <= 99) or op not in "+-" or (op == "-" and a < b):
        raise ValueError(f"columns() works two-digit a + b or a - b with a >= b, got {a} {op} {b}")
    c = a + b if op == "+" else a - b
    if a < 10 and b < 10:
        return f"{a}{op}{b}={c}"
    (at, ao), (bt, bo) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        ones, carry = f"{ao}+{bo}={ao + bo}", ao + bo >= 10
        tens = "+".join(str(x) for x in (at, bt) if x) + ("+1" if carry else "")
        tens_value = at + bt + carry
    else:
        borrow = ao < bo
        ones = f"{ao + 10 * borrow}-{bo}={ao + 10 * borrow - bo}"
        tens = f"{at}" + (f"-{bt}" if bt else "") + ("-1" if borrow else "")
        tens_value = at - bt - borrow
    steps = ones if tens in (str(tens_value), "") else f"{ones}, {tens}={tens_value}"
    return f"{a}{op}{b}: {steps}, so {c}"


SOLUTIONS = {
    "sentence": lambda a, op, b, c: f"The answer is {c}.",
    "equation": lambda a, op, b, c: f"{a} {op} {b} = {c}",
    "columns": lambda a, op, b, c: columns(a, op, b),
}


def problem(
    rng: random.Random, max_value: int, min_value: int = 1, wide: bool = False, distractors: float = 0.0
) -> tuple[str, int, tuple[int, str, int]]:
    """One word problem, its answer and its sum (a, "+" or "-", b): a + b or a - b (never negative), operands in
    [min_value, max_value]; `wide`: the wide frames; `distractors`: the share opening with an unrelated number."""
    names, things = (WIDE_NAMES, WIDE_THINGS) if wide else (NAMES, THINGS)
    n, t = rng.choice(names), rng.choice(things)
    a, b = rng.randint(min_value, max_value), rng.randint(min_value, max_value)
    d = ""
    if distractors and rng.random() < distractors:
        d = rng.choice(DISTRACTORS).format(n=n, x=rng.randint(2, 99))
    if rng.random() < 0.5:
        return d + rng.choice(WIDE_ADD if wide else ADD).format(n=n, t=t, a=a, b=b), a + b, (a, "+", b)
    a, b = max(a, b), min(a, b)
    return d + rng.choice(WIDE_SUB if wide else SUB).format(n=n, t=t, a=a, b=b), a - b, (a, "-", b)


def make_splits(
    train: int,
    test: int,
    seed: int = 0,
    max_value: int = 50,
    *,
    min_value: int = 1,
    easy: float = 0.0,
    easy_max: int = 20,
    wide: bool = False,
    distractors: float = 0.0,
    solution: str = "sentence",
) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): distinct problems drawn with `seed`, the first `test` of them held out. `easy`: the
    share drawn with operands in [1, easy_max] instead (an easier part that gives GRPO signal from the start);
    `solution`: the row's worked answer, "sentence" ("The answer is c."), "equation" ("a + b = c") or "columns"
    (worked column by column, `columns()`: the recipe's SFT target)."""
    if train < 1 or test < 0:
        raise ValueError(f"--train must be >= 1 and --test >= 0, got {train} and {test}")
    if not 1 <= min_value <= max_value:
        raise ValueError(f"--min-value must be in [1, --max-value], got {min_value} and {max_value}")
    if not 0.0 <= easy <= 1.0 or not 0.0 <= distractors <= 1.0:
        raise ValueError(f"--easy and --distractors are shares in [0, 1], got {easy} and {distractors}")
    if solution not in SOLUTIONS:
        raise ValueError(f"--solution must be one of {', '.join(SOLUTIONS)}, got {solution!r}")
    rng = random.Random(seed)
    seen: dict[str, tuple[int, tuple[int, str, int]]] = {}
    budget = 50 * (train + test)
    while len(seen) < train + test and budget:
        lo, hi = (1, easy_max) if easy and rng.random() < easy else (min_value, max_value)
        text, answer, terms = problem(rng, hi, lo, wide, distractors)
        seen.setdefault(text, (answer, terms))
        budget -= 1
    if len(seen) < train + test:
        raise ValueError(
            f"only {len(seen)} distinct problems with operands up to {max_value}; ask for fewer than "
            f"{train + test} or raise --max-value"
        )
    rows = [
        {"problem": f"{text} {INSTRUCTION}", "answer": str(answer), "solution": SOLUTIONS[solution](*terms, answer)}
        for text, (answer, terms) in seen.items()
    ]
    return rows[test:], rows[:test]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for train.json and test.json")
    ap.add_argument("--train", type=int, default=2000, help="training problems")
    ap.add_argument("--test", type=int, default=200, help="held-out problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-value", type=int, default=50, help="largest operand")
    ap.add_argument("--min-value", type=int, default=1, help="smallest operand")
    ap.add_argument("--easy", type=float, default=0.0, help="share of problems with operands up to --easy-max")
    ap.add_argument("--easy-max", type=int, default=20, help="largest operand of the easy share")
    ap.add_argument(
        "--frames",
        choices=("basic", "wide"),
        default="basic",
        help="wide: more names, objects and sentence frames (more kinds of question)",
    )
    ap.add_argument("--distractors", type=float, default=0.0, help="share opening with an unrelated number")
    ap.add_argument(
        "--solution",
        choices=tuple(SOLUTIONS),
        default="sentence",
        help="the rows' worked answer: 'The answer is c.', 'a + b = c' or the columns worked with their carries and "
        "borrows, 'a+b: ..., so c' (an SFT target)",
    )
    a = ap.parse_args(argv)
    train, test = make_splits(a.train, a.test, a.seed, a.max_value, min_value=a.min_value, easy=a.easy,
                              easy_max=a.easy_max, wide=a.frames == "wide", distractors=a.distractors,
                              solution=a.solution)  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        path = os.path.join(a.out, f"{name}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=0)
        print(f"{path}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
