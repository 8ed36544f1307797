"""tools/make_general_data.py (the recipe's self-distillation rows) apart from tools/general_check.py's instructions,
its mix; general_check's patterns. No model: the generation itself runs in the recipe."""

from __future__ import annotations

import re

import pytest

from tools import general_check
from tools import make_general_data as gen


def test_instructions_are_apart_from_the_check_and_the_mix_is_seeded():
    assert len(set(gen.INSTRUCTIONS)) == len(gen.INSTRUCTIONS)
    assert not {q for q, _ in general_check.INSTRUCTIONS} & set(gen.INSTRUCTIONS)
    gen._check_apart()
    train = [{"problem": f"p{i}", "answer": str(i), "solution": str(i)} for i in range(20)]
    general = [{"problem": "q", "answer": "", "solution": "a"}, {"problem": "r", "answer": "", "solution": "b"}]
    mixed = gen.mix(train, general, repeat=3, seed=0)
    assert len(mixed) == 26 and sum(r["problem"] == "q" for r in mixed) == 3
    assert sorted(mixed, key=str) == sorted(train + general * 3, key=str)
    assert mixed == gen.mix(train, general, repeat=3, seed=0) != gen.mix(train, general, repeat=3, seed=1)


@pytest.mark.parametrize("argv, message", [
    (["--mix", "t.json"], "--mix and --mix-out go together"),
    (["--repeat", "0"], "--repeat must be >= 1, got 0"),
])  # fmt: skip
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gen.main(["--hf", "nowhere", "--out", "x.json", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_day_count_pattern_wants_days():
    pattern = dict(general_check.INSTRUCTIONS)["How many days are there in a week?"]
    assert re.search(pattern, "A week is approximately 7 days.", re.I)
    assert re.search(pattern, "There are seven days in a week.", re.I)
    assert not re.search(pattern, "7+6=13", re.I)
