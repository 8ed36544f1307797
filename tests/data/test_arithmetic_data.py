"""tools/make_arithmetic_data.py: seeded, disjoint splits whose labels the gsm8k verifier accepts."""

from __future__ import annotations

import json
import re

import pytest

from mindrl.rewards.verifiers import gsm8k_reward
from tools import make_arithmetic_data as gen


def test_splits_are_seeded_disjoint_and_correct(tmp_path):
    assert gen.main(["--out", str(tmp_path), "--train", "300", "--test", "40", "--seed", "3"]) == 0
    train = json.loads((tmp_path / "train.json").read_text())
    test = json.loads((tmp_path / "test.json").read_text())
    assert (len(train), len(test)) == (300, 40)
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert (train, test) == gen.make_splits(300, 40, seed=3)  # the seed decides everything
    assert gen.make_splits(300, 40, seed=4) != (train, test)
    for row in train + test:
        a, b = (int(x) for x in re.findall(r"\d+", row["problem"])[:2])
        assert int(row["answer"]) in (a + b, a - b) and int(row["answer"]) >= 0
        assert row["problem"].endswith(gen.INSTRUCTION)
        assert gsm8k_reward(row["solution"], row["answer"]) == 1.0  # the verifier the recipe grades with
        assert gsm8k_reward(f"{int(row['answer']) + 1}", row["answer"]) == 0.0


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct problems with operands up to 2"):
        gen.make_splits(5000, 10, max_value=2)


def test_wide_frames_distractors_and_equations(tmp_path):
    """--frames wide --distractors --easy --solution equation: the SFT rows of the recipe, still right and disjoint."""
    args = ["--train", "400", "--test", "50", "--seed", "2", "--max-value", "99", "--min-value", "10", "--easy", "0.25",
            "--frames", "wide", "--distractors", "0.5", "--solution", "equation"]  # fmt: skip
    assert gen.main(["--out", str(tmp_path), *args]) == 0
    train = json.loads((tmp_path / "train.json").read_text())
    test = json.loads((tmp_path / "test.json").read_text())
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    frames = {re.sub(r"\{\w+\}", "", f) for f in gen.WIDE_ADD + gen.WIDE_SUB}
    used, easy, distracted = set(), 0, 0
    for row in train + test:
        a, op, b, c = re.fullmatch(r"(\d+) ([+-]) (\d+) = (\d+)", row["solution"]).groups()
        assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(row["answer"]) >= 0
        assert gsm8k_reward(row["solution"], row["answer"]) == 1.0
        numbers = re.findall(r"\d+", row["problem"])
        distracted += len(numbers) == 3
        easy += max(int(a), int(b)) <= 20 and min(int(a), int(b)) < 10
        assert sorted(numbers[-2:]) == sorted([a, b]) and row["problem"].endswith(gen.INSTRUCTION)
        used.add(re.sub(r"\d+", "", row["problem"]))
    assert 0.35 < distracted / len(train + test) < 0.65 and 0.05 < easy / len(train + test) < 0.3
    assert len(used) > 100 and frames
    with pytest.raises(ValueError, match="--solution must be one of sentence, equation, columns"):
        gen.make_splits(10, 1, solution="boxed")
    with pytest.raises(ValueError, match="--min-value must be in"):
        gen.make_splits(10, 1, max_value=5, min_value=9)


def test_columns_work_every_sum_with_its_carry_or_borrow():
    """--solution columns (the recipe's SFT target) on every a + b and a - b in [0, 99]: each step is a true
    single-digit fact (the ones borrow exactly when their digit is smaller), the answer is the last number."""
    assert gen.columns(47, "+", 38) == "47+38: 7+8=15, 4+3+1=8, so 85"
    assert gen.columns(94, "-", 59) == "94-59: 14-9=5, 9-5-1=3, so 35"
    assert gen.columns(8, "+", 1) == "8+1=9"
    for a in range(100):
        for b in range(100):
            for op in "+-" if a >= b else "+":
                c = a + b if op == "+" else a - b
                text = gen.columns(a, op, b)
                assert gsm8k_reward(text, str(c)) == 1.0, text
                for lhs, rhs in re.findall(r"([\d+-]+)=(\d+)", text):
                    assert eval(lhs) == int(rhs), text  # noqa: S307 - digits and +/- only
                if a >= 10 or b >= 10:
                    ones = re.search(r": (\d+)[+-]", text)[1]
                    assert int(ones) == a % 10 + 10 * (op == "-" and a % 10 < b % 10), text
    with pytest.raises(ValueError, match="a - b with a >= b, got 3 - 5"):
        gen.columns(3, "-", 5)
    rows, _ = gen.make_splits(50, 0, max_value=99, solution="columns")
    assert all(gsm8k_reward(r["solution"], r["answer"]) == 1.0 for r in rows)
