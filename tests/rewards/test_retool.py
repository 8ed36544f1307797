"""retool_reward (MindSpeed-RL's ReTool reward): strict boxed string match in the response's tail, the tool-call
bonus on wrong answers capped at 0, and the episode's own observation format counted as calls."""

from __future__ import annotations

import pytest

from mindrl.rewards.retool import last_boxed, retool_score
from mindrl.rewards.verifiers import INLINE_VERIFIERS, get_verifier

OBS = "<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "response, label, score",
    [
        ("so \\boxed{42}", "42", 1.0),
        ("so \\boxed{42}.<|im_end|>", "42", 1.0),
        ("\\boxed{41} no wait \\boxed{42}", "42", 1.0),  # the last box counts
        ("\\boxed{42} no wait \\boxed{41}", "42", -1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("\\boxed{0.5}", "\\frac{1}{2}", -1.0),  # a string comparison, no math equivalence
        ("\\boxed{ 42}", "42", -1.0),  # no normalisation either
        ("the answer is 42", "42", -1.0),
        ("\\boxed{42", "42", -1.0),  # unclosed
        ("\\boxed{42}" + "x" * 95, "42", -1.0),  # the box must end within the last 100 characters
        ("\\boxed{42}" + "x" * 89, "42", 1.0),
        ("\\boxed{42}", None, -1.0),
    ],
)
def test_strict_box(response, label, score):
    assert retool_score(response, label) == score


def test_tool_calls_soften_a_wrong_answer_up_to_zero():
    wrong = "\\boxed{7}"
    assert retool_score(wrong, "8", tool_calls=0) == -1.0
    assert retool_score(wrong, "8", tool_calls=3) == -0.7  # exact tenths
    assert retool_score(wrong, "8", tool_calls=10) == 0.0
    assert retool_score(wrong, "8", tool_calls=25) == 0.0
    assert retool_score("\\boxed{8}", "8", tool_calls=25) == 1.0  # a right answer gets no bonus


def test_the_registered_verifier_counts_the_episodes_tool_responses():
    verifier = get_verifier("retool_reward")
    two_calls = "<tool_call>...</tool_call>" + OBS.format("1") + "<tool_call>...</tool_call>" + OBS.format("2")
    assert verifier(two_calls + "\\boxed{3}", "4") == -0.8
    assert verifier(two_calls + "\\boxed{4}", "4") == 1.0
    assert "retool_reward" in INLINE_VERIFIERS


def test_last_boxed():
    assert last_boxed("\\boxed{a}\\boxed{b{c}}") == "b{c}"
    assert last_boxed("none") is None and last_boxed("\\boxed{") is None
