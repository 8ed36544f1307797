"""Each verifier's MindSpeed-RL semantics, math-verify equivalence over the answer forms the issue lists,
the registry's errors, and proof that model text is never executed. All in-process (no pool)."""

import os

import pytest

from mindrl.rewards import get_verifier, list_verifiers, math_equal

MINDSPEED_NAMES = [
    "acc", "format", "strict_format", "base_acc", "acc_for_ppo", "acc_for_dapo", "math_17k_acc", "math_verify", "gsm8k"
]  # fmt: skip


def test_all_mindspeed_names_are_registered():
    assert set(MINDSPEED_NAMES) <= set(list_verifiers())


def test_unknown_verifier_lists_known_names_and_close_matches():
    with pytest.raises(ValueError) as err:
        get_verifier("math_verfy")
    msg = str(err.value)
    assert "unknown verifier 'math_verfy' (from rl_config.verifier_function)" in msg
    assert "acc, acc_for_dapo, acc_for_ppo, base_acc" in msg and "did you mean 'math_verify'" in msg


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "1/2"),
        ("\\frac12", "0.5"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("[1, 3)", "[1,3)"),
        ("\\{3, 2, 1\\}", "\\{1,2,3\\}"),
        ("50\\%", "50"),
        ("50\\%", "50\\%"),
        ("5 \\text{ cm}", "5"),
        ("\\text{B}", "B"),
        ("(B)", "B"),
        ("1,000,000", "1000000"),
        ("12{,}345", "12345"),
        ("(x+1)^2", "x^2+2x+1"),
        ("-1.0", "-1"),
        ("\\pi", "3.14159265358979"),
    ],
)
def test_math_equal_accepts_equivalent_forms(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("0.51", "\\frac{1}{2}"),
        ("(1, 3]", "[1,3)"),
        ("\\{1, 2\\}", "\\{1,2,3\\}"),
        ("C", "B"),
        ("\\sqrt{3}", "\\sqrt{2}"),
        ("1001", "1000"),
        ("x+1", "x+2"),
        ("", "1"),
        ("1", None),
        (None, "1"),
    ],
)
def test_math_equal_rejects_different_answers(pred, gold):
    assert not math_equal(pred, gold)


def test_acc_scores():
    acc = get_verifier("acc")
    assert acc("<think>x</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5") == 1.0
    assert acc("first \\boxed{3} then \\boxed{0.5}", "\\frac12") == 1.0  # the last box counts
    assert acc("<answer>0.5</answer>", "1/2") == 1.0  # no box: the answer tag
    assert acc("\\boxed{0.4}", "0.5") == -0.5
    assert acc("\\boxed{0.5}", None) == -0.5
    assert acc("I do not know", "0.5") == -1.0
    assert acc("", "0.5") == -1.0


def test_format_and_strict_format_scores():
    ok = "<think>because</think>\n<answer>It is \\boxed{4}.</answer>"
    assert get_verifier("format")(ok, None) == 1.0
    assert get_verifier("format")("<think>x</think> text <answer>4</answer>", None) == 0.0
    assert get_verifier("strict_format")(ok, None) == 1.0
    assert get_verifier("strict_format")("<think>x</think><answer>4</answer>", None) == -0.5


def test_base_acc_needs_structure_and_correct_answer():
    base_acc = get_verifier("base_acc")
    assert base_acc("<think>2+2</think><answer>\\boxed{4}</answer>", "4") == 1.0
    assert base_acc("<think>2+2</think><answer>\\boxed{5}</answer>", "4") == 0.0
    assert base_acc("2+2 = \\boxed{4}", "4") == 0.0  # right answer, no structure


@pytest.mark.parametrize("name", ["acc_for_ppo", "math_17k_acc"])
def test_boxed_only_accuracy(name):
    fn = get_verifier(name)
    assert fn("thus \\boxed{\\dfrac{3}{4}}", "0.75") == 1.0
    assert fn("thus \\boxed{0.7}", "0.75") == 0.0
    assert fn("<answer>0.75</answer>", "0.75") == 0.0  # only a box counts here


def test_math_verify_scores():
    mv = get_verifier("math_verify")
    assert mv("So the final answer is $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert mv("The answer is \\boxed{[1, 3)}", "$[1,3)$") == 1.0
    assert mv("The answer is \\boxed{2}", "\\boxed{2}") == 1.0
    assert mv("The answer is \\boxed{3}", "2") == 0.0
    assert mv("", "2") == 0.0
    assert mv("\\boxed{2}", None) == 0.0
    assert mv("\\boxed{2}", 2) == 1.0  # numeric labels from a dataset


def test_gsm8k_scores():
    gsm8k = get_verifier("gsm8k")
    assert gsm8k("She pays 3 * 4 = 12 dollars. #### 12", "#### 12") == 1.0
    assert gsm8k("so 7 apples, then 1,250 in total", "Natalia sold ... #### 1250") == 1.0
    assert gsm8k("total: 12.50", "12.5") == 1.0
    assert gsm8k("#### -3", "-3") == 1.0
    assert gsm8k("about 12", "13") == 0.0
    assert gsm8k("no digits", "13") == 0.0
    assert gsm8k("1" * 5000, "1") == 0.0  # too long to be an answer, and int() would refuse it
    assert gsm8k("12", None) == 0.0


@pytest.mark.parametrize("name", MINDSPEED_NAMES)
def test_model_text_is_never_executed(name, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    response = f"<think>x</think><answer>\\boxed{{{payload}}}</answer>"
    score = get_verifier(name)(response, payload)
    assert isinstance(score, float)
    assert not os.path.exists(marker)
