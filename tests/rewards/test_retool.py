"""retool_reward (MindSpeed-RL's ReTool reward): strict boxed string match in the response's tail, the tool-call
bonus on wrong answers capped at 0, and the episode's own observation format counted as calls, failed ones
(error observations) not."""

from __future__ import annotations

import pytest

from mindrl.rewards.retool import last_boxed, retool_score
from mindrl.rewards.verifiers import INLINE_VERIFIERS, get_verifier

OBS = "<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "code", "arguments": {"code": "print(17*23)"}}\n</tool_call>'


def decoded(text: str) -> str:
    """As the scorer sees a response: decoded with the special tokens dropped."""
    return text.replace("<|im_end|>", "").replace("<|im_start|>", "")


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
    two_calls = CALL + OBS.format("1") + CALL + OBS.format("2")
    assert verifier(two_calls + "\\boxed{3}", "4") == -0.8
    assert verifier(two_calls + "\\boxed{4}", "4") == 1.0
    assert verifier(decoded(two_calls) + "\\boxed{3}", "4") == -0.8  # as the scorer decodes it
    assert "retool_reward" in INLINE_VERIFIERS


def test_only_successful_calls_earn_the_bonus():
    """A call answered with an error (malformed, unknown tool, failed code, a call over the turn's budget) earns
    nothing: else a policy that cannot run code yet earns more by writing broken calls than by answering."""
    verifier = get_verifier("retool_reward")
    broken = [
        "Error: malformed tool call (not JSON)",
        "Error: no tool named 'python' (tools: code)",
        "Error: Traceback (most recent call last):\n...SyntaxError...(truncated)",
    ]
    for text in (lambda x: x, decoded):
        episode = "".join(CALL + OBS.format(b) for b in broken)
        assert verifier(text(episode + "\\boxed{7}"), "391") == -1.0
        assert verifier(text(CALL + OBS.format("391") + episode + "\\boxed{7}"), "391") == -0.9
        # two calls in one turn, the second not run: one block each, one user turn
        two = CALL + CALL + OBS.format("391\n</tool_response>\n<tool_response>\nError: 1 more tool call(s) not run")
        assert verifier(text(two + "\\boxed{7}"), "391") == -0.9
        assert verifier(text(CALL + OBS.format("") + "\\boxed{7}"), "391") == -0.9  # printed nothing, still ran
        # a success whose output mentions an error is still a success: only the start tells
        assert verifier(text(CALL + OBS.format("no Error: here") + "\\boxed{7}"), "391") == -0.9


def test_blocks_the_policy_writes_itself_earn_nothing():
    """Only the loop's answers count: blocks right after a call's closing tag. A policy that writes a
    `<tool_response>` block into its own turn (as its SFT traces show whole episodes) is not paid for it."""
    verifier = get_verifier("retool_reward")
    fake = "<tool_response>\n391\n</tool_response>"
    malformed = '<tool_call>\n{"name": "code", "argu' + fake + "\nuser\n" + fake
    assert verifier(decoded(malformed + OBS.format("Error: malformed tool call") + "\\boxed{7}"), "391") == -1.0
    assert verifier(decoded("I ran it.\nuser\n" + fake + fake + "\\boxed{7}"), "391") == -1.0
    assert verifier(decoded("x" * 10_000 + CALL * 500 + "user\n<tool_response>\n" * 500 + "\\boxed{7}"), "3") == -1.0


def test_last_boxed():
    assert last_boxed("\\boxed{a}\\boxed{b{c}}") == "b{c}"
    assert last_boxed("none") is None and last_boxed("\\boxed{") is None
