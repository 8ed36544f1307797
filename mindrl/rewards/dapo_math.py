"""DAPO's math reward (`acc_for_dapo`): the last "Answer: ..." line of the response's tail, normalised the Minerva way
and compared as a string with the normalised label; +1 / -1 (docs/algorithms.md gives the rules and examples)."""

from __future__ import annotations

import re

ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
"""Where the answer is read: the text after "Answer:" (any case, spaces around the colon) up to the line's end."""
TAIL_CHARS = 300
"""Only the response's last characters are searched (DAPO's choice: MATH-500's longest answer has 159)."""
NO_ANSWER = "[INVALID]"

# Minerva's normalisation (Lewkowycz et al. 2022), in the order DAPO applies it: plain replacements, then words and
# units deleted, then the TeX rewrites.
_REPLACE = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_DELETE = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep only the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """The answer as Minerva compares it: what follows the last '=', spaces, articles, units and TeX wrappers removed,
    shorthand \\frac / \\sqrt braced, and a plain integer's thousands separators dropped."""
    text = answer.split("=")[-1]
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for word in _DELETE:
        text = text.replace(word, "")
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response: str) -> str:
    """The normalised text after the last "Answer:" in the response's last TAIL_CHARS characters; NO_ANSWER
    normalised (it is unchanged) when there is none."""
    found = ANSWER_PATTERN.findall(response[-TAIL_CHARS:])
    return normalize_final_answer(found[-1] if found else NO_ANSWER)


def dapo_math_score(response: str, label: str | None) -> float:
    """1.0 when the extracted answer equals the normalised label as strings, else -1.0 (no answer, wrong answer, no
    label)."""
    if label is None:
        return -1.0
    return 1.0 if extract_answer(response) == normalize_final_answer(str(label)) else -1.0
