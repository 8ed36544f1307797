"""Hermes tool calls, the format Qwen2.5's chat template teaches: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks in the assistant's text, any number of them. A block that is not such a call becomes a
`ToolCallError` the agent loop answers with an error observation, never an exception."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that is not a call: `text` is the block's content, `reason` what is wrong with it."""

    text: str
    reason: str


@dataclass
class ParsedTurn:
    """The `<tool_call>` blocks of one assistant turn in the order they were written: each a call or, malformed (an
    unclosed `<tool_call>` included), an error."""

    blocks: list[ToolCall | ToolCallError] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [b for b in self.blocks if isinstance(b, ToolCallError)]

    @property
    def any(self) -> bool:
        return bool(self.blocks)


def format_tool_call(call: ToolCall) -> str:
    """The block Qwen2.5's template writes for `call` (json.dumps, non-ASCII kept)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{START}\n{body}\n{END}"


_DECODER = json.JSONDecoder()


def _call(obj: Any, text: str) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(text, f"a tool call is a JSON object, got {type(obj).__name__}")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCallError(text, 'no "name" string')
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError(text, f'"arguments" is a string that is not JSON: {e}')
    if not isinstance(args, dict):
        return ToolCallError(text, f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Every `<tool_call>...</tool_call>` block of `text`, in order. The JSON is decoded from the opening tag on, so
    an argument that itself contains the end tag (code that prints it) stays one call; a block whose JSON does not
    decode runs to the next end tag, and one with no end tag is an error (the model was cut off)."""
    out = ParsedTurn()
    pos = text.find(START)
    while pos >= 0:
        body = pos + len(START)
        close = text.find(END, body)
        i = body + len(text[body:]) - len(text[body:].lstrip())
        try:
            obj, j = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            obj, j, why = None, -1, f"not JSON: {e}"
        if j >= 0:
            k = j + len(text[j:]) - len(text[j:].lstrip())
            if text.startswith(END, k):
                out.blocks.append(_call(obj, text[i:j]))
                pos = text.find(START, k + len(END))
                continue
            why = f"text after the JSON object before {END}" if close >= 0 else f"{START} without {END}"
        if close < 0:
            out.blocks.append(ToolCallError(text[body:].strip(), f"{START} without {END}"))
            break
        out.blocks.append(ToolCallError(text[body:close].strip(), why))
        pos = text.find(START, close + len(END))
    return out
