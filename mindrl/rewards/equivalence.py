"""Mathematical answer equivalence through the math-verify library (never eval/exec of model text).
math-verify's own signal-based timeouts are off here: the process pool bounds time from outside."""

from __future__ import annotations

import logging
from functools import lru_cache

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from mindrl.rewards.extract import find_last_boxed


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its timeout is off; here that is deliberate (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())

# Longer "answers" are never a final answer, and parsing them can take seconds; treat as unparseable.
MAX_ANSWER_CHARS = 5000
# math-verify's LaTeX parser is super-linear in bracket nesting (found by fuzzing): `{` is exponential
# (depth 12: ~2 s, 20: ~4 s, 30: minutes), `[` and `\left(` quadratic (depth 60: ~8 s). Honest answers
# nest a few levels (\left(\frac{\sqrt{3}}{2}, 1\right] is 3); deeper counts as unparseable.
MAX_BRACKET_DEPTH = 8
_OPENERS, _CLOSERS = "{[(", "}])"


def too_deeply_nested(text: str, limit: int = MAX_BRACKET_DEPTH) -> bool:
    """True when brackets ({ [ ( in any mix, escaped or not) nest more than `limit` deep in text.
    Closers are not matched to openers: intervals like [1, 3) close with the other kind."""
    if sum(text.count(c) for c in _OPENERS) <= limit:
        return False
    depth = 0
    for ch in text:
        if ch in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        elif ch in _CLOSERS and depth:
            depth -= 1
    return False


_ANSWER_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


@lru_cache(maxsize=8192)
def parse_answer(answer: str) -> tuple:
    """Parse a bare answer string ("\\frac12", "0.5", "[1, 3)", "B") into math-verify's parsed form.

    Wrapped in $...$ so that math-verify reads it as LaTeX (its \\boxed{} extraction drops `\\%`).
    Cached: a group of samples usually repeats a handful of answers, and labels repeat per prompt."""
    answer = answer.strip().strip("$").strip()
    if not answer or len(answer) > MAX_ANSWER_CHARS or too_deeply_nested(answer):
        return ()
    return tuple(parse(f"${answer}$", extraction_config=_ANSWER_CONFIG, parsing_timeout=None))


@lru_cache(maxsize=8192)
def math_equal(prediction: str | None, reference: str | None) -> bool:
    """True when the extracted answer `prediction` is mathematically equivalent to `reference`.

    Handles fractions vs decimals, \\sqrt, \\dfrac, \\left( \\right), intervals, sets, percentages,
    units and \\text{}, thousands separators and multiple-choice letters (all via math-verify)."""
    if prediction is None or reference is None:
        return False
    prediction, reference = str(prediction).strip(), str(reference).strip()
    if not prediction or not reference:
        return False
    if prediction == reference:
        return True
    gold, pred = parse_answer(reference), parse_answer(prediction)
    if not gold or not pred:
        return False
    return bool(verify(list(gold), list(pred), timeout_seconds=None))


@lru_cache(maxsize=4096)
def parse_gold_label(label: str) -> tuple:
    """Parse a dataset label for the `math_verify` verifier: as written if it already carries LaTeX
    delimiters or a \\boxed{}, otherwise as a bare answer wrapped in $...$."""
    text = label.strip()
    if too_deeply_nested(text):
        return ()
    if "\\boxed" in text or "$" in text or "\\(" in text or "\\[" in text:
        parsed = tuple(parse(text, parsing_timeout=None))
        if parsed:
            return parsed
    return parse_answer(text)


def parse_response(response: str) -> list:
    """math-verify extraction of the final answer from a whole response (\\boxed{} first); nothing when
    the part it would parse (the last \\boxed{}, else the whole text) nests too deeply."""
    boxed = find_last_boxed(response)
    if too_deeply_nested(response if boxed is None else boxed[2]):
        return []
    return parse(response, extraction_config=_ANSWER_CONFIG, parsing_timeout=None)


def verify_parsed(gold: tuple, pred: list) -> bool:
    """math-verify's equivalence of parsed gold and prediction; False when either is empty."""
    if not gold or not pred:
        return False
    return bool(verify(list(gold), pred, timeout_seconds=None))
