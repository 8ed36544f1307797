"""Property-based fuzzing of answer extraction and the rule verifiers: arbitrary text never raises and
finishes in time; a boxed number grades equal to itself (and in its other written forms), another number
does not. Bounded: fixed example counts, derandomized, no example database."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindrl.rewards import DEFAULT_TIMEOUT_S, list_verifiers, score_rule_rewards
from mindrl.rewards.extract import (
    answer_tag_content,
    final_answer,
    find_last_boxed,
    has_strict_structure,
    last_boxed_content,
    matches_think_answer_format,
)
from mindrl.rewards.verifiers import get_verifier

BOUNDED = dict(derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
RULE_VERIFIERS = [
    "acc",
    "format",
    "strict_format",
    "base_acc",
    "acc_for_ppo",
    "math_17k_acc",
    "math_verify",
    "gsm8k",
    "acc_for_dapo",
    "retool_reward",
]
# the values each verifier may return (its docstring's contract)
VALUES = {
    "acc": {1.0, -0.5, -1.0},
    "format": {1.0, 0.0},
    "strict_format": {1.0, -0.5},
    "base_acc": {1.0, 0.0},
    "acc_for_ppo": {1.0, 0.0},
    "math_17k_acc": {1.0, 0.0},
    "math_verify": {1.0, 0.0},
    "gsm8k": {1.0, 0.0},
    "acc_for_dapo": {1.0, -1.0},
    "retool_reward": {1.0} | {(k - 10) / 10 for k in range(11)},
}

# Pieces that steer random text into the parsers' interesting paths.
ATOMS = [
    "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "\\{", "\\}", "\\", "<think>", "</think>", "<answer>",
    "</answer>", "$", "$$", "\\frac{", "\\sqrt{", "\\left(", "\\right)", "^", "_", "####", "1", "-2", "3.5",
    "1,000", "x", " ", "\n", "\\text{", "%", "\x00", "\ud800", "\u202e", "\U0001f600", "½",
]  # fmt: skip
text_piece = st.one_of(st.sampled_from(ATOMS), st.text(max_size=8))
fuzz_text = st.lists(text_piece, max_size=40).map("".join)


def _extract_everything(text: str) -> None:
    found = find_last_boxed(text)
    if found is not None:
        start, end, content = found
        assert 0 <= start < end <= len(text) and content in text[start:end]
    for value in (last_boxed_content(text), answer_tag_content(text), final_answer(text)):
        assert value is None or (isinstance(value, str) and value and value == value.strip())
    assert isinstance(matches_think_answer_format(text), bool)
    assert isinstance(has_strict_structure(text), bool)


@settings(max_examples=400, deadline=2000, **BOUNDED)
@given(fuzz_text)
def test_extraction_never_raises(text):
    _extract_everything(text)


@settings(max_examples=12, deadline=None, **BOUNDED)
@given(piece=fuzz_text.filter(bool), size=st.integers(100_000, 1_000_000))
def test_extraction_on_huge_text_is_fast(piece, size):
    text = (piece * (size // len(piece) + 1))[:size]
    start = time.process_time()
    _extract_everything(text)
    assert time.process_time() - start < 5.0  # linear scans of 1 MB take ~0.1 s; a hang detector


def test_every_registered_rule_verifier_is_fuzzed():
    assert set(RULE_VERIFIERS) == {n for n in list_verifiers() if not n.startswith("_test_")}


# String-only verifiers (no math-verify): cheap enough to fuzz in-process with no timeout at all.
@pytest.mark.parametrize("name", ["format", "strict_format", "gsm8k", "retool_reward"])
@settings(max_examples=200, deadline=2000, **BOUNDED)
@given(response=fuzz_text, label=st.one_of(st.none(), fuzz_text))
def test_string_verifiers_never_raise(name, response, label):
    assert get_verifier(name)(response, label) in VALUES[name]


@settings(max_examples=25, deadline=None, **BOUNDED)
@given(
    batch=st.lists(
        st.tuples(fuzz_text, st.one_of(st.none(), fuzz_text, st.integers(-(10**6), 10**6).map(str))),
        min_size=1,
        max_size=6,
    )
)
def test_all_verifiers_through_the_pool_finish_in_time(batch):
    """The contract for model output: every verifier on arbitrary text either scores within the timeout
    or is cut off at it; none raises or crashes its worker."""
    responses, labels = [r for r, _ in batch], [label for _, label in batch]
    timeout = 2.0
    start = time.perf_counter()
    scores = score_rule_rewards(responses, labels, RULE_VERIFIERS, [1.0] * len(RULE_VERIFIERS), timeout, 2)
    # each sample takes at most its timeout; the slack is for a loaded machine (a hang detector)
    assert time.perf_counter() - start < timeout * len(batch) + 30
    assert scores.metrics["reward/errors"] == 0.0 and scores.metrics["reward/crashes"] == 0.0, scores.metrics
    for per_verifier in scores.per_verifier:
        if per_verifier is not None:
            assert all(v in VALUES[n] for n, v in zip(RULE_VERIFIERS, per_verifier)), per_verifier


@settings(max_examples=4, deadline=None, **BOUNDED)
@given(piece=fuzz_text.filter(bool), size=st.integers(200_000, 1_000_000))
def test_all_verifiers_on_huge_text_through_the_pool(piece, size):
    response = (piece * (size // len(piece) + 1))[:size] + "\\boxed{7}"
    scores = score_rule_rewards([response], ["7"], RULE_VERIFIERS, [1.0] * len(RULE_VERIFIERS), DEFAULT_TIMEOUT_S, 2)
    assert scores.metrics["reward/errors"] == 0.0 and scores.metrics["reward/crashes"] == 0.0, scores.metrics
    if scores.per_verifier[0] is not None:
        got = dict(zip(RULE_VERIFIERS, scores.per_verifier[0]))
        assert all(v in VALUES[n] for n, v in got.items()), got
        # whatever precedes it, a balanced last \boxed{7} is the answer for the box-reading verifiers
        if find_last_boxed(response)[2] == "7":
            assert got["acc_for_ppo"] == got["math_17k_acc"] == 1.0, got


# ------------------------------------------------------------------ a boxed number grades equal to itself
def _decimal_text(value: Fraction) -> str:
    # exact decimals only (denominators 2^a 5^b), written with their digits
    return format(value.numerator / value.denominator, "f").rstrip("0").rstrip(".") if value else "0"


integers = st.integers(-(10**9), 10**9).map(lambda n: (Fraction(n), [str(n)]))
decimals = st.builds(lambda n, places: Fraction(n, 10**places), st.integers(-(10**6), 10**6), st.integers(1, 4)).map(
    lambda v: (v, [_decimal_text(v)])
)
fractions_ = st.builds(Fraction, st.integers(-999, 999), st.integers(2, 999)).filter(lambda v: v.denominator > 1)
fractions_ = fractions_.map(
    lambda v: (
        (v, [f"\\frac{{{v.numerator}}}{{{v.denominator}}}", f"{v.numerator}/{v.denominator}"])
        if v > 0
        else (v, [f"-\\frac{{{-v.numerator}}}{{{v.denominator}}}"])
    )
)
# simple expressions with a known value: a+b, a*b (as \cdot), a^k
expressions = st.one_of(
    st.builds(lambda a, b: (Fraction(a + b), [f"{a}+{b}"]), st.integers(0, 999), st.integers(0, 999)),
    st.builds(lambda a, b: (Fraction(a * b), [f"{a} \\cdot {b}"]), st.integers(0, 99), st.integers(0, 99)),
    st.builds(lambda a, k: (Fraction(a**k), [f"{a}^{{{k}}}"]), st.integers(2, 9), st.integers(2, 4)),
)
numbers = st.one_of(integers, decimals, fractions_, expressions)
MATH_EQUIVALENCE = ["acc", "acc_for_ppo", "math_17k_acc", "math_verify"]


def _r1(answer: str) -> str:
    return f"<think>some reasoning</think>\n<answer>The answer is \\boxed{{{answer}}}.</answer>"


@settings(max_examples=60, deadline=None, **BOUNDED)
@given(number=numbers, form=st.integers(0, 1))
def test_boxed_number_grades_equal_to_itself(number, form):
    value, texts = number
    written = texts[form % len(texts)]
    response = _r1(written)
    for name in MATH_EQUIVALENCE + ["base_acc", "format", "strict_format"]:
        assert get_verifier(name)(response, written) == 1.0, (name, written)
    # the label in its canonical form: same value, possibly written differently
    canonical = (
        str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    )
    for name in MATH_EQUIVALENCE:
        assert get_verifier(name)(response, canonical) == 1.0, (name, written, canonical)
    if value.denominator == 1 and not any(op in written for op in "+^\\/"):
        assert get_verifier("gsm8k")(response, canonical) == 1.0, written


@settings(max_examples=60, deadline=None, **BOUNDED)
@given(number=numbers, delta=st.integers(1, 1000), sign=st.sampled_from([1, -1]))
def test_boxed_number_grades_zero_against_another_number(number, delta, sign):
    value, texts = number
    other = value + sign * delta
    other_text = (
        str(other.numerator) if other.denominator == 1 else f"\\frac{{{other.numerator}}}{{{other.denominator}}}"
    )
    response = _r1(texts[0])
    assert get_verifier("acc")(response, other_text) == -0.5, (texts[0], other_text)
    for name in ["acc_for_ppo", "math_17k_acc", "math_verify", "base_acc"]:
        assert get_verifier(name)(response, other_text) == 0.0, (name, texts[0], other_text)


# Without `^` (a power tower is a known sympy hang, cut off by the pool's timeout: test_scoring.py),
# the math-verify verifiers are fast in-process too, nested braces included.
no_power_text = st.lists(
    st.one_of(st.sampled_from([a for a in ATOMS if a != "^"]), st.text("{}()[]1x\\+", max_size=12)), max_size=40
).map("".join)


@settings(max_examples=150, deadline=None, **BOUNDED)
@given(response=no_power_text, label=st.one_of(st.none(), no_power_text))
def test_math_verifiers_in_process_never_raise_and_are_fast(response, label):
    for name in MATH_EQUIVALENCE + ["base_acc"]:
        start = time.process_time()
        value = get_verifier(name)(response.replace("^", ""), None if label is None else label.replace("^", ""))
        assert value in VALUES[name]
        assert time.process_time() - start < DEFAULT_TIMEOUT_S, (name, response, label)


NESTINGS = ["{%s}", "\\sqrt{%s}", "\\frac{%s}{2}", "x^{%s}", "\\left(%s\\right)", "[%s]", "\\{%s\\}"]


def _nest(core: str, forms: list[str]) -> str:
    for form in forms:
        core = form % core
    return core


nest_forms = st.one_of(
    st.lists(st.sampled_from(NESTINGS), max_size=60),
    st.builds(lambda form, depth: [form] * depth, st.sampled_from(NESTINGS), st.integers(0, 60)),
)
nested_text = st.builds(_nest, st.sampled_from(["1", "x", "\\frac{1}{2}", "-3", ""]), nest_forms)


@settings(max_examples=40, deadline=None, **BOUNDED)
@given(answer=nested_text, label=st.one_of(nested_text, st.sampled_from(["1", "x", "0.5"])))
def test_math_verifiers_on_deeply_nested_answers_are_fast(answer, label):
    """math-verify's parser is exponential in brace depth: deep answers must be refused, not parsed."""
    response = _r1(answer)
    for name in MATH_EQUIVALENCE:
        start = time.process_time()
        assert get_verifier(name)(response, label) in VALUES[name]
        assert time.process_time() - start < DEFAULT_TIMEOUT_S, (name, answer, label)
