"""String-level pieces of the rule verifiers: find the final answer, check the R1 tag structure.
Linear-time scans only (no backtracking regexes), so no response length can make them slow."""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_BOXED_PREFIXES = ("\\boxed", "\\fbox")
_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")


def _balanced_group(text: str, open_at: int) -> int | None:
    """Index just past the `}` closing the `{` at text[open_at], or None if it never closes.
    Escaped braces (\\{ and \\}) are literal set braces in LaTeX and do not nest."""
    depth = 0
    i = open_at
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def find_last_boxed(text: str) -> tuple[int, int, str] | None:
    """(start, end, content) of the last \\boxed{...} (or \\fbox{...}) in text, or None.

    Only the last one counts: if it is unbalanced (e.g. a truncated response) there is no answer,
    rather than silently falling back to an earlier, superseded one."""
    start = max(text.rfind(prefix) for prefix in _BOXED_PREFIXES)
    if start < 0:
        return None
    prefix = next(p for p in _BOXED_PREFIXES if text.startswith(p, start))
    i = start + len(prefix)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _balanced_group(text, i)
        if end is None:
            return None
        return start, end, text[i + 1 : end - 1]
    # "\boxed 5": the argument is the next token
    j = i
    while j < len(text) and not text[j].isspace() and text[j] not in "$}":
        j += 1
    return (start, j, text[i:j]) if j > i else None


def last_boxed_content(text: str) -> str | None:
    """Content of the last \\boxed{} in text (stripped), or None when there is none or it is empty."""
    found = find_last_boxed(text)
    if found is None:
        return None
    content = found[2].strip()
    return content or None


def answer_tag_content(text: str) -> str | None:
    """Content of the last <answer>...</answer> (stripped), or None when absent or empty."""
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    end = text.find(ANSWER_CLOSE, start)
    if end < 0:
        return None
    content = text[start + len(ANSWER_OPEN) : end].strip()
    return content or None


def final_answer(text: str) -> str | None:
    """The answer a grader reads: the last \\boxed{} if any, else the <answer> content."""
    boxed = last_boxed_content(text)
    return boxed if boxed is not None else answer_tag_content(text)


def matches_think_answer_format(text: str) -> bool:
    """Exactly re.match(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", text, re.DOTALL), in linear time.

    Like the regex, `$` also accepts one trailing newline."""
    if not text.startswith(THINK_OPEN):
        return False
    if text.endswith(ANSWER_CLOSE):
        close_at = len(text) - len(ANSWER_CLOSE)
    elif text.endswith(ANSWER_CLOSE + "\n"):
        close_at = len(text) - len(ANSWER_CLOSE) - 1
    else:
        return False
    # the earliest `</think>\s*<answer>` has the earliest end, so it is the only one worth checking
    match = _THINK_THEN_ANSWER.search(text, len(THINK_OPEN))
    return match is not None and match.end() <= close_at


def has_strict_structure(text: str) -> bool:
    """MindSpeed-RL's strict structure: `<think>…</think>…<answer>…\\boxed{…}…</answer>`, start to end,
    with exactly one of each tag and exactly one balanced \\boxed{}, inside the answer."""
    for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, "\\boxed"):
        if text.count(tag) != 1:
            return False
    if not (text.startswith(THINK_OPEN) and text.endswith(ANSWER_CLOSE)):
        return False
    boxed = find_last_boxed(text)
    if boxed is None or not text.startswith("\\boxed{", boxed[0]):
        return False
    think_close, answer_open = text.find(THINK_CLOSE), text.find(ANSWER_OPEN)
    answer_close = len(text) - len(ANSWER_CLOSE)
    return think_close < answer_open and answer_open < boxed[0] and boxed[1] <= answer_close
