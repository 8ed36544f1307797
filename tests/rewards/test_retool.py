"""retool_reward (MindSpeed-RL's ReTool reward): strict boxed string match in the response's tail, the tool-call
bonus on wrong answers capped at 0, and the episode's own observation format counted as calls, failed ones
(error observations) not."""

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


def test_only_successful_calls_earn_the_bonus():
    """A call answered with an error (malformed, unknown tool, failed code, or a call over the turn's budget) earns
    nothing: else a policy that cannot run code yet earns more by writing broken calls than by answering."""
    verifier = get_verifier("retool_reward")
    ran = OBS.format("391")
    broken = [
        OBS.format("Error: malformed tool call (not JSON)"),
        OBS.format("Error: no tool named 'python' (tools: code)"),
        OBS.format("Error: Traceback (most recent call last):\n...SyntaxError...(truncated)"),
        OBS.format("Error: 1 more tool call(s) not run: at most 1 in this turn"),
    ]
    assert verifier("".join(broken) + "\\boxed{7}", "391") == -1.0
    assert verifier(ran + "".join(broken) + "\\boxed{7}", "391") == -0.9
    assert verifier(OBS.format("") + "\\boxed{7}", "391") == -0.9  # code that printed nothing still ran
    # a success whose output mentions an error is still a success: only the start tells
    assert verifier(OBS.format("no Error: here") + "\\boxed{7}", "391") == -0.9


def test_last_boxed():
    assert last_boxed("\\boxed{a}\\boxed{b{c}}") == "b{c}"
    assert last_boxed("none") is None and last_boxed("\\boxed{") is None
