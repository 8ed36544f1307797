"""ReTool's reward (MindSpeed-RL's `retool_reward`): the answer is the last `\\boxed{...}` near the end of the
response, compared with the label as a string (no normalisation): +1 when equal, -1 otherwise. A wrong answer earns
back 0.1 per tool call that succeeded, up to 0 (calling the code tool is encouraged, never rewarded above a right
answer). A call answered with an error (a malformed call, an unknown tool, code that failed or hit a limit) earns
nothing: paying for it would let a policy that cannot yet run code earn more by writing broken calls."""

from __future__ import annotations

import re

TAIL_CHARS = 300
"""The response's last characters the reward reads (MindSpeed-RL's cut, then its strict check's)..."""
BOX_CHARS = 100
"""...and the last characters of those in which the boxed answer must start and end."""
TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
"""One block per tool call answered: the agent loop writes each call's output in such a block (its ChatFormat)..."""
FAILED = "Error:"
"""...and a failed call's output starts with this (mindrl.trainer.pipeline.agent_loop.AgentLoop._call)."""
CALLS_PER_POINT = 10
"""0.1 per call; kept as an integer ratio so that the scores are exact tenths ((calls - 10) / 10)."""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` whose braces close, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def successful_calls(response: str) -> int:
    """The `<tool_response>` blocks of `response` whose output is not an error."""
    return sum(not m.group(1).startswith(FAILED) for m in TOOL_RESPONSE.finditer(response))


def retool_score(response: str, label: str | None, tool_calls: int | None = None) -> float:
    """+1 / -1 as in the module doc; `tool_calls` (successful calls) None: counted from the response's
    `<tool_response>` blocks by `successful_calls` (a model that writes such a block itself gains at most the bonus
    of a wrong answer, capped at 0)."""
    pred = last_boxed(response[-TAIL_CHARS:][-BOX_CHARS:])
    score = 1.0 if label is not None and pred == label else -1.0
    if score < 0:
        calls = successful_calls(response) if tool_calls is None else tool_calls
        score = min(0.0, (calls - CALLS_PER_POINT) / CALLS_PER_POINT)
    return score
