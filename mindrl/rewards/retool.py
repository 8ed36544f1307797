"""ReTool's reward (MindSpeed-RL's `retool_reward`): the answer is the last `\\boxed{...}` near the end of the
response, compared with the label as a string (no normalisation): +1 when equal, -1 otherwise. A wrong answer earns
back 0.1 per tool call that succeeded, up to 0 (calling the code tool is encouraged, never rewarded above a right
answer). A call answered with an error (a malformed call, an unknown tool, code that failed or hit a limit) earns
nothing: paying for it would let a policy that cannot yet run code earn more by writing broken calls."""

from __future__ import annotations

TAIL_CHARS = 300
"""The response's last characters the reward reads (MindSpeed-RL's cut, then its strict check's)..."""
BOX_CHARS = 100
"""...and the last characters of those in which the boxed answer must start and end."""
CALL_END, USER_TURN = "</tool_call>", "user\n"
BLOCK_START, BLOCK_END = "<tool_response>\n", "\n</tool_response>"
"""Where the agent loop answers calls (its ChatFormat, as the scorer decodes it: special tokens dropped): right after
the turn's closing `</tool_call>`, a user turn of `<tool_response>` blocks, one per call. Only blocks there count: the
policy can write a `<tool_response>` block into its own turn (its SFT traces hold whole episodes), but a turn ends
at `</tool_call>` (one token in Qwen2.5's vocabulary), so what follows one is the loop's..."""
TURN_MARKS = ("<|im_end|>", "<|im_start|>")
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
    """The observation blocks (after `CALL_END`) of `response` whose output is not an error; one linear scan."""
    n, pos = 0, 0
    while (i := response.find(CALL_END, pos)) >= 0:
        j = i + len(CALL_END)
        while j < len(response):  # the turn's end and the user turn's start, decoded or not
            if response[j].isspace():
                j += 1
            elif response.startswith(TURN_MARKS, j):
                j = response.index(">", j) + 1
            else:
                break
        if response.startswith(USER_TURN, j):
            j += len(USER_TURN)
            while response.startswith(BLOCK_START, j):
                end = response.find(BLOCK_END, j + len(BLOCK_START))
                if end < 0:  # nor after any later start
                    return n
                n += not response.startswith(FAILED, j + len(BLOCK_START))
                j = end + len(BLOCK_END) + response.startswith("\n", end + len(BLOCK_END))
        pos = max(j, i + 1)
    return n


def retool_score(response: str, label: str | None, tool_calls: int | None = None) -> float:
    """+1 / -1 as in the module doc; `tool_calls` (successful calls) None: counted from the response's observations
    by `successful_calls`."""
    pred = last_boxed(response[-TAIL_CHARS:][-BOX_CHARS:])
    score = 1.0 if label is not None and pred == label else -1.0
    if score < 0:
        calls = successful_calls(response) if tool_calls is None else tool_calls
        score = min(0.0, (calls - CALLS_PER_POINT) / CALLS_PER_POINT)
    return score
