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
