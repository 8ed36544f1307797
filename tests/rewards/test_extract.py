"""Answer extraction and tag-structure checks: hand cases, the linear format check against the regex
it replaces, and pathological inputs that must stay fast in-process."""

import random
import re
import time

import pytest

from mindrl.rewards.extract import (
    answer_tag_content,
    final_answer,
    has_strict_structure,
    last_boxed_content,
    matches_think_answer_format,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped set braces do not nest
        ("\\boxed{a^{b^{c}}} end", "a^{b^{c}}"),
        ("\\boxed 5 apples", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{1} and then \\boxed{2", None),  # the last box is truncated: no answer, no fallback
        ("\\boxed{  }", None),
        ("\\boxed", None),
        ("no box", None),
        ("", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


def test_answer_tag_and_final_answer():
    assert answer_tag_content("<answer> 42 </answer>") == "42"
    assert answer_tag_content("<answer>1</answer> <answer>2</answer>") == "2"
    assert answer_tag_content("<answer>unclosed") is None
    assert answer_tag_content("<answer>  </answer>") is None
    assert final_answer("<answer>The result is \\boxed{9}</answer>") == "9"
    assert final_answer("<answer>9</answer>") == "9"
    assert final_answer("nothing here") is None


FORMAT_REGEX = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


@pytest.mark.parametrize(
    "text, ok",
    [
        ("<think>a</think><answer>b</answer>", True),
        ("<think>a</think> \n <answer>b</answer>", True),
        ("<think></think><answer></answer>", True),
        ("<think>a</think><answer>b</answer>\n", True),  # `$` accepts one trailing newline
        ("<think>a</think><answer>b</answer>\n\n", False),
        ("<think>a</think>x<answer>b</answer>", False),
        (" <think>a</think><answer>b</answer>", False),
        ("<think>a</think><answer>b</answer> extra", False),
        ("<think>a</think>x</think><answer>b</answer>", True),  # .*? may span a </think>
        ("<think>a</think><answer>", False),
        ("<think></think><answer></answer", False),
    ],
)
def test_format_check_hand_cases(text, ok):
    assert matches_think_answer_format(text) is ok
    assert (FORMAT_REGEX.match(text) is not None) is ok


def test_format_check_equals_the_regex_on_random_strings():
    rng = random.Random(0)
    atoms = ["<think>", "</think>", "<answer>", "</answer>", "</think><answer>", " ", "\n", "x", "<", ">", "/"]
    matched = 0
    for _ in range(3000):
        # bias towards the right start and end so that both outcomes are exercised
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 7)))
        text = ("<think>" if rng.random() < 0.7 else "") + text + ("</answer>" if rng.random() < 0.7 else "")
        expected = FORMAT_REGEX.match(text) is not None
        matched += expected
        assert matches_think_answer_format(text) == expected, repr(text)
    assert 100 < matched < 2900


@pytest.mark.parametrize(
    "text, ok",
    [
        ("<think>r</think><answer>so \\boxed{2}</answer>", True),
        ("<think>r</think>\n<answer>\\boxed{\\frac{1}{2}} done</answer>", True),
        ("<think>r</think><answer>2</answer>", False),  # no box
        ("<think>r</think><answer>\\boxed{1}\\boxed{2}</answer>", False),  # two boxes
        ("<think>r \\boxed{2}</think><answer>x</answer>", False),  # box outside the answer
        ("<think>r</think><think>s</think><answer>\\boxed{2}</answer>", False),
        ("<answer>\\boxed{2}</answer><think>r</think>", False),
        ("<think>r</think><answer>\\boxed{2</answer>", False),  # unbalanced
        ("<think>r</think><answer>\\boxed{2}</answer> ", False),
    ],
)
def test_strict_structure(text, ok):
    assert has_strict_structure(text) is ok


PATHOLOGICAL = {
    "nested": "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",
    "unbalanced": "\\boxed{" + "{" * 100_000,
    "many_boxes": "\\boxed{1}" * 10_000,
    "tags": "<think>" + "</think><answer>" * 6_000 + "x" * 10_000,
    "huge": "x" * 100_000,
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_extraction_is_linear_on_pathological_text(name):
    text = PATHOLOGICAL[name]
    start = time.process_time()
    last_boxed_content(text)
    answer_tag_content(text)
    matches_think_answer_format(text)
    has_strict_structure(text)
    assert time.process_time() - start < 5.0  # CPU time: linear is ~0.01 s, quadratic would be minutes
