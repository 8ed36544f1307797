"""`acc_for_dapo`: DAPO's "Answer:" extraction and Minerva normalisation, on cases written from MindSpeed-RL's and
verl's documented behaviour (their unit tests and the DAPO recipe's prompt: "Answer: $Answer" on the last line)."""

import pytest

from mindrl.rewards import get_verifier
from mindrl.rewards.dapo_math import TAIL_CHARS, extract_answer, normalize_final_answer


@pytest.mark.parametrize(
    "text, normalised",
    [
        ("Answer: \\boxed{2x + 3}", "Answer:2x+3"),  # no "=": the whole text, spaces dropped
        ("= \\boxed{2x + 3}", "2x+3"),  # what follows the last "="
        ("an \\boxed{2x + 3}", "2x+3"),  # articles dropped
        ("\\boxed{2x + 3} square", "2x+3"),  # units and words dropped
        ("$\\boxed{2x + 3}$", "2x+3"),  # math delimiters
        ("\\text{Answer}: \\boxed{2x + 3}", "Answer:2x+3"),  # \text{} unwrapped
        ("frac12", "frac{1}{2}"),  # shorthand braced
        ("sqrt2", "sqrt{2}"),
        ("1,000", "1000"),  # thousands separators of an integer
        ("1,2", "12"),  # (any digits-and-commas text is an integer to it)
        ("(1, 2)", "(1,2)"),  # but a tuple keeps its comma
        ("5 \\text{ cm}", "5"),
        ("90^\\circ", "90"),
        ("\\$18.90", "18.90"),
        ("x = 7", "7"),
        ("\\textbf{12}", "12"),
        ("\\overline{3}", "3"),
    ],
)
def test_minerva_normalisation(text, normalised):
    assert normalize_final_answer(text) == normalised


def test_extraction_takes_the_last_answer_line_of_the_tail():
    assert extract_answer("Answer: 3\nsome more thinking\nAnswer: 4") == "4"
    assert extract_answer("answer : $\\frac{1}{2}$\n") == "\\frac{1}{2}"  # any case, spaces around the colon
    assert extract_answer("the answer is \\boxed{4}") == "[INVALID]"  # a box alone is no answer
    long = "Answer: 5\n" + "x" * TAIL_CHARS
    assert extract_answer(long) == "[INVALID]"  # beyond the last 300 characters


@pytest.mark.parametrize(
    "response, label, score",
    [
        ("Let me think.\nAnswer: 42", "42", 1.0),
        ("... so the total is 1,000.\nAnswer: 1,000", "1000", 1.0),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # a string comparison: no math equivalence
        ("Answer: 41", "42", -1.0),
        ("The answer is \\boxed{42}", "42", -1.0),  # no "Answer:" line
        ("", "42", -1.0),
        ("Answer: 42", None, -1.0),
    ],
)
def test_acc_for_dapo_scores(response, label, score):
    assert get_verifier("acc_for_dapo")(response, label) == score
