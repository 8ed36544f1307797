#!/usr/bin/env python
"""Write held-out arithmetic word problems that test the arithmetic, not the training generator
(tools/make_arithmetic_data.py): DeepScaleR JSON rows ({"problem", "answer", "solution"}), seeded.

Apart from the training generator on purpose: its own names, objects, sentence frames (add and subtract, none of the
training ones) and answer instructions; two-digit operands (10-99) where most additions carry and most subtractions
borrow; and in about half the problems a distractor number (an age, a day count, a price) that plays no part in the
answer. Graded by the `gsm8k` verifier (the last number of the response).

    python tools/make_heldout_arithmetic.py --out data/heldout.json --count 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ("Olivia", "Ethan", "Sofia", "Lucas", "Grace", "Omar", "Chloe", "Ivan", "Nora", "Felix", "Priya", "Jack",
         "Hana", "Diego", "Ruby", "Kofi", "Elena", "Yusuf", "Maya", "Owen")  # fmt: skip
THINGS = ("beads", "buttons", "crayons", "seashells", "postcards", "toy cars", "ribbons", "paper cranes", "acorns",
          "tickets", "balloons", "candles", "puzzle pieces", "blocks", "pebbles", "feathers")  # fmt: skip
PLACES = ("jar", "basket", "drawer", "shoebox", "bag", "crate", "tin", "bucket")
# {n}: a name, {t}: a plural object, {p}: a container, {a} {b}: the operands; {d}: the distractor sentence, or "".
ADD = (
    "{d}{n} collected {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} collect in total?",
    "{d}A {p} holds {a} {t}. {n} adds another {b} {t} to it. How many {t} are in the {p} now?",
    "{d}{n} bought {a} {t} at one shop and {b} {t} at another. How many {t} did {n} buy altogether?",
    "{d}{n} found {a} {t} in the garden, then {b} more near the fence. How many {t} were found?",
    "{d}On a shelf there are {a} {t}. A teacher brings {b} extra {t}. How many {t} are on the shelf?",
    "{d}{n} made {a} {t} in the morning and {b} in the afternoon. What is the total number of {t}?",
    "{d}The first {p} has {a} {t} and the second {p} has {b} {t}. How many {t} are there in both?",
    "{d}{n} received {a} {t} from a cousin and {b} {t} from a neighbour. How many {t} did {n} receive?",
    "{d}A class used {a} {t} last week and {b} {t} this week. How many {t} were used over the two weeks?",
    "{d}{n} counted {a} red {t} and {b} blue {t}. How many {t} did {n} count?",
    "{d}There were {a} {t} at the fair. Then {b} more {t} arrived. How many {t} were at the fair then?",
    "{d}{n} saved {a} {t} and was later given {b} more. How many {t} does {n} have?",
)
SUB = (
    "{d}{n} had {a} {t} and handed {b} of them to friends. How many {t} does {n} still have?",
    "{d}A {p} held {a} {t}. {n} took {b} {t} out of it. How many {t} remain in the {p}?",
    "{d}{n} baked {a} {t} and sold {b}. How many {t} were not sold?",
    "{d}There are {a} {t} in a {p}. {b} of them are broken. How many {t} are not broken?",
    "{d}{n} needs {a} {t} and already has {b}. How many more {t} does {n} need?",
    "{d}A shop had {a} {t} in stock and sold {b} {t} today. How many {t} are left in stock?",
    "{d}{n} started with {a} {t}. After losing some, {n} has {b} left. How many {t} were lost?",
    "{d}{n} has {a} {t}, which is {b} more than a friend has. How many {t} does the friend have?",
    "{d}Out of {a} {t}, {n} gave away {b}. How many {t} did {n} keep?",
    "{d}A box of {a} {t} was opened and {b} {t} were used. How many {t} are still in the box?",
    "{d}{n} wants to collect {a} {t} and has {b} so far. How many {t} are still missing?",
    "{d}The {p} had {a} {t} before {n} removed {b} of them. How many {t} are in the {p} now?",
)
DISTRACTORS = (
    "{n} is {x} years old. ",
    "It took {n} {x} minutes. ",
    "{n} lives {x} kilometres from school. ",
    "The {p} cost {x} dollars. ",
    "It was {x} degrees outside. ",
    "{n}'s house is number {x}. ",
)
INSTRUCTIONS = ("Answer with just the number.", "Reply with only the final number.", "Give just the number.")


def _operands(rng: random.Random, add: bool) -> tuple[int, int]:
    """Two-digit operands; three in four additions carry and three in four subtractions borrow."""
    hard = rng.random() < 0.75
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if not add:
            a, b = max(a, b), min(a, b)
            if a == b:
                continue
            borrow = a % 10 < b % 10
            if borrow == hard:
                return a, b
        elif ((a % 10 + b % 10) >= 10) == hard:
            return a, b


def problem(rng: random.Random) -> tuple[str, int]:
    """One held-out problem (text with its instruction) and its answer."""
    add = rng.random() < 0.5
    a, b = _operands(rng, add)
    n, t, p = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PLACES)
    d = ""
    if rng.random() < 0.5:
        d = rng.choice(DISTRACTORS).format(n=n, p=p, x=rng.randint(3, 95))
    frame = rng.choice(ADD if add else SUB)
    text = frame.format(n=n, t=t, p=p, a=a, b=b, d=d)
    return f"{text} {rng.choice(INSTRUCTIONS)}", (a + b if add else a - b)


def make_rows(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct problems drawn with `seed`, as DeepScaleR rows."""
    if count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    rng = random.Random(seed)
    seen: dict[str, int] = {}
    while len(seen) < count:
        text, answer = problem(rng)
        seen.setdefault(text, answer)
    return [{"problem": text, "answer": str(ans), "solution": f"The answer is {ans}."} for text, ans in seen.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--count", type=int, default=200, help="problems")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rows = make_rows(a.count, a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=0)
    print(f"{a.out}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
