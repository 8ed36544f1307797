"""tools/make_heldout_arithmetic.py: a held-out set apart from the training generator (no shared sentence frame),
two-digit operands with carries and borrows, distractor numbers, right labels."""

from __future__ import annotations

import json
import re

from mindrl.rewards.verifiers import gsm8k_reward
from tools import make_arithmetic_data as train_gen
from tools import make_heldout_arithmetic as gen


def _frame_words(frame: str) -> str:
    return re.sub(r"\{\w+\}", "", frame).strip()


def test_heldout_is_seeded_correct_and_apart_from_the_training_generator(tmp_path):
    out = tmp_path / "heldout.json"
    assert gen.main(["--out", str(out), "--count", "300", "--seed", "5"]) == 0
    rows = json.loads(out.read_text())
    assert rows == gen.make_rows(300, seed=5) and gen.make_rows(300, seed=6) != rows
    assert len({r["problem"] for r in rows}) == 300
    train_frames = {_frame_words(f) for f in train_gen.WIDE_ADD + train_gen.WIDE_SUB}  # the wide frames hold all
    assert not train_frames & {_frame_words(f) for f in gen.ADD + gen.SUB}
    assert not set(train_gen.WIDE_NAMES) & set(gen.NAMES) and not set(train_gen.WIDE_THINGS) & set(gen.THINGS)
    assert not {_frame_words(f) for f in train_gen.DISTRACTORS} & {_frame_words(f) for f in gen.DISTRACTORS}
    for wide in (False, True):
        parts = train_gen.make_splits(2000, 200, seed=0, max_value=99, wide=wide, distractors=0.5 * wide)
        assert not {r["problem"] for part in parts for r in part} & {r["problem"] for r in rows}
    carries = distracted = 0
    for row in rows:
        answer = int(row["answer"])
        numbers = [int(x) for x in re.findall(r"\d+", row["problem"])]
        distracted += len(numbers) == 3
        a, b = numbers[-2:]  # a distractor comes first
        assert 10 <= a <= 99 and 10 <= b <= 99 and answer in (a + b, a - b) and answer > 0
        carries += (a % 10 + b % 10 >= 10) if answer == a + b else (a % 10 < b % 10)
        assert row["problem"].endswith(gen.INSTRUCTIONS)
        assert gsm8k_reward(row["solution"], row["answer"]) == 1.0
    assert 0.6 < carries / len(rows) < 0.9 and 0.35 < distracted / len(rows) < 0.65
