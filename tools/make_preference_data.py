#!/usr/bin/env python
"""Write the quickstart task as preference pairs ({"prompt", "chosen", "rejected"}) for reward-model training.

The task (tools/make_quickstart_data.py): "Which number is larger: 3 or 8?". chosen answers with the larger number,
rejected with the smaller (or, in a `distractor_fraction` of the pairs, with a digit not in the question, so that
"the bigger digit wins" is not the whole lesson), both as "The answer is \\boxed{X}."; in a `format_fraction` of the
pairs the rejected answer is the RIGHT number in a broken form (the box unclosed, cut short, repeated, missing, or
followed by a second wrong box) that the rule check fails, and the chosen one is, half the time, a WRONG number in the
right form: a broken answer ranks below any well-formed one, so that a policy cannot score by abstaining (RL on a
reward model without those pairs learns to emit "\\boxed{" and stop: docs/reward_model.md). A reward model that prefers
the chosen answers agrees with the rule check (acc_for_ppo) of the RL stage. The file holds `rows` pairs drawn from the training
problems, then `valid_fraction` of them drawn from DISJOINT held-out problems at the end, so megatron's contiguous
split (`split: "90,10,0"` for valid_fraction 0.1) holds out problems the model never saw.

    python tools/make_preference_data.py --out data/pref --rows 2000 --valid-fraction 0.1 --seed 0
    bash examples/data/preprocess_data.sh pairwise input=data/pref/pref.json tokenizer_name_or_path=HF \\
        output_prefix=DATA/pref prompt_type=qwen
"""

from __future__ import annotations

import argparse
import json
import os
import random


def answer(x: int) -> str:
    return f"The answer is \\boxed{{{x}}}."


def broken(x: int, wrong: int, rng: random.Random) -> str:
    """The right number `x` in a form that acc_for_ppo (the last \\boxed{} equals the label) rejects."""
    good = answer(x)
    forms = (
        lambda: good[: rng.randrange(len("The answer is \\boxed{"), good.index("}"))],  # cut before the box closes
        lambda: f"The answer is \\boxed{{{x}",
        lambda: " ".join([f"The answer is \\boxed{{{x}"] + [f"is \\boxed{{{x}"] * rng.randint(1, 3)),
        lambda: f"The answer is {x}.",
        lambda: f"{good} The answer is \\boxed{{{wrong}}}.",
    )
    return rng.choice(forms)()


def make_pairs(
    rows: int = 2000,
    valid_fraction: float = 0.1,
    seed: int = 0,
    distractor_fraction: float = 0.25,
    format_fraction: float = 0.0,
    bigger_fraction: float = 0.0,
) -> list[dict]:
    """`rows` pairs: the first (1 - valid_fraction) from one set of problems, the rest from a disjoint set."""
    from tools.make_quickstart_data import problems

    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction must be within [0, 1), got {valid_fraction}")
    rng = random.Random(seed)
    pool = problems()
    rng.shuffle(pool)
    n_valid = int(round(valid_fraction * rows))
    held = max(1, int(round(valid_fraction * len(pool)))) if n_valid else 0
    train_set, valid_set = pool[held:], pool[:held]
    out = []
    for i in range(rows):
        p, a, b = rng.choice(train_set if i < rows - n_valid else valid_set)
        wrong = min(a, b)
        if rng.random() < distractor_fraction:
            others = [x for x in range(10) if x not in (a, b)]
            bigger = [x for x in others if x > max(a, b)]
            # larger than both (bigger_fraction): "the biggest digit wins" must not pay either
            wrong = rng.choice(bigger if bigger and rng.random() < bigger_fraction else others)
        chosen, rejected = answer(max(a, b)), answer(wrong)
        if rng.random() < format_fraction:
            rejected = broken(max(a, b), wrong, rng)
            if rng.random() < 0.5:
                chosen = answer(wrong)
        out.append({"prompt": p, "chosen": chosen, "rejected": rejected})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created): pref.json")
    p.add_argument("--rows", type=int, default=2000, help="pairs in all (training + held-out)")
    p.add_argument("--valid-fraction", type=float, default=0.1, help="share of the pairs from held-out problems")
    p.add_argument("--distractor-fraction", type=float, default=0.25, help="share rejected with a digit not asked")
    p.add_argument(
        "--format-fraction",
        type=float,
        default=0.0,
        help="share rejected with the right number in a broken form (unclosed, cut, repeated, no box)",
    )
    p.add_argument(
        "--bigger-fraction",
        type=float,
        default=0.0,
        help="share of the distractors drawn from the digits larger than both numbers",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    pairs = make_pairs(a.rows, a.valid_fraction, a.seed, a.distractor_fraction, a.format_fraction, a.bigger_fraction)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "pref.json")
    with open(path, "w") as f:
        json.dump(pairs, f, indent=0)
    print(f"wrote {len(pairs)} pairs to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
