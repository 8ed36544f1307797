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


# name -> text of size ~n. Each family is built at two sizes; linear scans cost ~10x more at 10x the
# size, a quadratic one 100x.
PATHOLOGICAL = {
    "nested": lambda n: "\\boxed{" + "{" * n + "1" + "}" * n + "}",
    "unbalanced": lambda n: "\\boxed{" + "{" * n,
    "many_boxes": lambda n: "\\boxed{1}" * (n // 9),
    "tags": lambda n: "<think>" + "</think><answer>" * (n // 16) + "x" * n,
    "escapes": lambda n: "\\boxed{" + "\\{" * (n // 2),
    "huge": lambda n: "x" * n,
}
SMALL, LARGE = 20_000, 200_000


def _extract_all(text: str) -> None:
    last_boxed_content(text)
    answer_tag_content(text)
    matches_think_answer_format(text)
    has_strict_structure(text)


def _cpu_seconds_per_call(text: str, min_total: float = 0.05) -> float:
    """CPU time of one _extract_all(text), repeated until the total is measurable; best of 3."""
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.process_time()
        while True:
            _extract_all(text)
            calls += 1
            elapsed = time.process_time() - start
            if elapsed >= min_total:
                break
        best = min(best, elapsed / calls)
    return best


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_extraction_is_linear_on_pathological_text(name):
    small, large = PATHOLOGICAL[name](SMALL), PATHOLOGICAL[name](LARGE)
    t_small, t_large = _cpu_seconds_per_call(small), _cpu_seconds_per_call(large)
    ratio = t_large / t_small
    # 10x the input: linear is ~10x; quadratic would be ~100x. CPU time, so other processes do not count.
    assert ratio < 35, f"{name}: {len(large)} chars cost {ratio:.1f}x {len(small)} chars ({t_small:.2e} s/call)"
    assert t_large < 5.0  # a hang detector, not a speed claim (see tools/bench_rewards.py)
