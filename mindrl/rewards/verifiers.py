"""Rule verifiers `(response_text, label_text) -> float`, registered under MindSpeed-RL's names so that
`rl_config.verifier_function` carries over. Each is pure; none executes text from a response."""

from __future__ import annotations

import difflib
import importlib
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from mindrl.rewards.dapo_math import dapo_math_score
from mindrl.rewards.extract import (
    final_answer,
    has_strict_structure,
    last_boxed_content,
    matches_think_answer_format,
)
from mindrl.rewards.retool import retool_score

Verifier = Callable[[str, "str | None"], float]

VERIFIERS: dict[str, Verifier] = {}
"""name -> verifier. The rewards' own table, so that rewards/ (like algorithms/, whose estimators have theirs) stands
on the ground floor and config/ can check names against both."""

MATH_VERIFIERS: set[str] = set()
"""The verifiers that compare answers with math-verify: a scoring process imports math-verify and sympy (~0.4 s, ~45
MiB) and warms their parsers (`warm_up_math`) before it scores with one of them, and only then."""

MATH_MODULE = "mindrl.rewards.equivalence"
"""What the math verifiers import (math-verify, sympy): the pool's forkserver preloads it when they are used."""

INLINE_VERIFIERS: set[str] = set()
"""The verifiers that are a few linear-time scans of the text (extract.py), which no response can make slow: a run
that uses these alone scores in its own process, without the pool's processes (~45 MiB) or their timeout."""


def register_verifier(name: str, uses_math: bool = False, inline: bool = False) -> Callable[[Verifier], Verifier]:
    """Decorator: make a module-level function selectable in `rl_config.verifier_function`.

    It runs in pool worker processes, so it must be importable by module and name (no lambdas). uses_math: it calls
    `math_equal` or math-verify (the pool then warms them up before it scores). inline: its cost is linear in the
    text's length, whatever the text (no math, no backtracking regex), so it needs no timeout (INLINE_VERIFIERS)."""

    def decorator(fn: Verifier) -> Verifier:
        if name in VERIFIERS and VERIFIERS[name] is not fn:
            raise ValueError(f"verifier {name!r} is already registered to {VERIFIERS[name].__qualname__}")
        VERIFIERS[name] = fn
        if uses_math:
            MATH_VERIFIERS.add(name)
        if inline and not uses_math:
            INLINE_VERIFIERS.add(name)
        return fn

    return decorator


def uses_math(names: Sequence[str]) -> bool:
    """Whether any of these verifiers compares answers with math-verify."""
    return any(name in MATH_VERIFIERS for name in names)


def scored_inline(names: Sequence[str]) -> bool:
    """Whether these verifiers score in the calling process (all of them INLINE_VERIFIERS) instead of the pool."""
    return bool(names) and all(name in INLINE_VERIFIERS for name in names)


def score_sample(
    fns: Sequence[Verifier], response: str, label: str | None
) -> tuple[tuple[float, ...] | None, str | None]:
    """(one score per verifier, None) or (None, the error) when a verifier raised or gave a non-finite score."""
    try:
        scores = tuple(float(fn(response, label)) for fn in fns)
    except Exception as exc:  # a verifier bug must cost one sample, not the batch
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    bad = [fn.__name__ for fn, s in zip(fns, scores) if not math.isfinite(s)]
    return (None, f"non-finite score from {', '.join(bad)}") if bad else (scores, None)


def _math():
    """The answer-equivalence module (math-verify, sympy), imported on first use only."""
    return importlib.import_module(MATH_MODULE)


def warm_up_math() -> None:
    """Import math-verify and build its regexes and latex2sympy's parser (~2 s at first use), before a scoring process
    reports ready: the first samples' timeouts must not pay for it."""
    acc_reward("<answer>\\boxed{\\frac{1}{2}}</answer>", "0.5")
    math_verify_reward("so \\boxed{2}", "2")


def get_verifier(name: str) -> Verifier:
    """The verifier registered under `name`. Called directly it has no time limit; use
    `compute_rule_rewards` to score model output with the external timeout."""
    if isinstance(name, str) and name in VERIFIERS:
        return VERIFIERS[name]
    close = difflib.get_close_matches(str(name), list_verifiers(), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(
        f"unknown verifier {name!r} (from rl_config.verifier_function); known: {', '.join(list_verifiers())}{hint}"
    )


def list_verifiers() -> list[str]:
    return sorted(VERIFIERS)


@register_verifier("acc", uses_math=True)
def acc_reward(response: str, label: str | None) -> float:
    """Last \\boxed{} (else the <answer> content) equivalent to the label: 1.0; wrong: -0.5; no answer: -1.0."""
    answer = final_answer(response)
    if answer is None:
        return -1.0
    return 1.0 if _math().math_equal(answer, label) else -0.5


@register_verifier("format", inline=True)
def format_reward(response: str, label: str | None = None) -> float:
    """1.0 for `<think>…</think> <answer>…</answer>` spanning the whole response, else 0.0."""
    return 1.0 if matches_think_answer_format(response) else 0.0


@register_verifier("strict_format", inline=True)
def strict_format_reward(response: str, label: str | None = None) -> float:
    """1.0 for exactly one of each tag and one \\boxed{}, in order think, answer, boxed; else -0.5."""
    return 1.0 if has_strict_structure(response) else -0.5


@register_verifier("base_acc", uses_math=True)
def base_acc_reward(response: str, label: str | None) -> float:
    """1.0 when the strict structure holds AND the boxed answer is correct, else 0.0."""
    if not has_strict_structure(response):
        return 0.0
    return 1.0 if _math().math_equal(last_boxed_content(response), label) else 0.0


def _boxed_correct(response: str, label: str | None) -> float:
    return 1.0 if _math().math_equal(last_boxed_content(response), label) else 0.0


@register_verifier("acc_for_ppo", uses_math=True)
def acc_for_ppo_reward(response: str, label: str | None) -> float:
    """1.0 when the last \\boxed{} is equivalent to the label, else 0.0 (missing box included)."""
    return _boxed_correct(response, label)


@register_verifier("math_17k_acc", uses_math=True)
def math_17k_acc_reward(response: str, label: str | None) -> float:
    """Same rule as acc_for_ppo, kept as its own name for MindSpeed-RL's math-17k configs."""
    return _boxed_correct(response, label)


@register_verifier("acc_for_dapo")
def acc_for_dapo_reward(response: str, label: str | None) -> float:
    """DAPO's math reward: the last "Answer: ..." of the response's tail equals the label after Minerva's
    normalisation (a string comparison, no math-verify): 1.0, else -1.0 (`mindrl.rewards.dapo_math`)."""
    return dapo_math_score(response, label)


@register_verifier("retool_reward", inline=True)
def retool_reward(response: str, label: str | None) -> float:
    """ReTool's (MindSpeed-RL's name): the last \\boxed{} of the tail equals the label as a string: 1.0; else -1.0
    plus 0.1 per tool call that succeeded (not answered with an error), capped at 0 (`mindrl.rewards.retool`)."""
    return retool_score(response, label)


@register_verifier("math_verify", uses_math=True)
def math_verify_reward(response: str, label: str | None) -> float:
    """math-verify end to end: extract from the whole response, compare with the parsed label. 1.0 / 0.0."""
    if label is None or not response:
        return 0.0
    label_text = str(label).strip()
    eq = _math()
    pred = eq.parse_response(response)
    if not pred:
        return 0.0
    # parse() returns [parsed, extracted_text]; the two texts identify the comparison, and a group of
    # samples repeats a few answers, so the (slow, sympy) verify runs once per distinct pair
    extracted = pred[-1] if isinstance(pred[-1], str) else None
    key = (label_text, extracted)
    if extracted is not None and key in _MATH_VERIFY_CACHE:
        return _MATH_VERIFY_CACHE[key]
    score = 1.0 if eq.verify_parsed(eq.parse_gold_label(label_text), pred) else 0.0
    if extracted is not None:
        if len(_MATH_VERIFY_CACHE) >= 8192:
            _MATH_VERIFY_CACHE.clear()
        _MATH_VERIFY_CACHE[key] = score
    return score


_MATH_VERIFY_CACHE: dict[tuple[str, str], float] = {}


# A number as people write it: optional sign, thousands separators, decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
# Python refuses int() of strings past 4300 digits; no honest answer is that long.
_MAX_NUMBER_CHARS = 1000


def _gsm8k_number(text: str) -> Fraction | None:
    marker = text.rfind("####")
    region = text[marker + 4 :] if marker >= 0 else text
    matches = _NUMBER.findall(region)
    if not matches:
        return None
    candidate = matches[0] if marker >= 0 else matches[-1]
    candidate = candidate.replace(",", "")
    if len(candidate) > _MAX_NUMBER_CHARS:
        return None
    return Fraction(candidate)


@register_verifier("gsm8k")
def gsm8k_reward(response: str, label: str | None) -> float:
    """The number after `####` (else the last number) equals the label's, compared exactly: 1.0 / 0.0."""
    if label is None:
        return 0.0
    pred, gold = _gsm8k_number(response), _gsm8k_number(str(label))
    return 1.0 if pred is not None and gold is not None and pred == gold else 0.0
