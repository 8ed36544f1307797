"""compute_rule_rewards and the verifier pool: weighted combination, config errors, external timeouts,
crash recovery, a persistent pool, and every pathological input returning within the timeout."""

import os
import time

import pytest

from mindrl.rewards import compute_rule_rewards, get_shared_pool, register_verifier, score_rule_rewards
from mindrl.rewards.verifiers import VERIFIERS
from tests.rewards import pool_helpers  # noqa: F401  (registers the _test_* verifiers)

WORKERS = 2
GOOD = "<think>2+2</think><answer>\\boxed{4}</answer>"
# Wall-clock bounds below are hang detectors, far above the real cost, so that a loaded 2-core machine
# does not fail them; the speed itself is measured by tools/bench_rewards.py.
HANG_S = 60.0


def score(responses, labels, names, weights, timeout=5.0):
    return compute_rule_rewards(responses, labels, names, weights, timeout=timeout, num_workers=WORKERS)


def test_weighted_combination_and_metrics():
    responses = [GOOD, "<think>x</think><answer>\\boxed{5}</answer>", "no answer at all"]
    rewards, metrics = score(responses, ["4", "4", "4"], ["acc", "format"], [1.0, 0.5])
    assert rewards == [1.0 + 0.5, -0.5 + 0.5, -1.0 + 0.0]
    assert metrics["reward/acc/mean"] == pytest.approx((1.0 - 0.5 - 1.0) / 3)
    assert metrics["reward/format/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/mean"] == pytest.approx(sum(rewards) / 3)
    assert metrics["reward/timeouts"] == 0.0 and metrics["reward/errors"] == 0.0 and metrics["reward/crashes"] == 0.0
    assert metrics["timing/rule_reward"] > 0


def test_single_name_and_weight_and_empty_batch():
    rewards, _ = score([GOOD], [4], "acc", 2.0)
    assert rewards == [2.0]
    rewards, metrics = score([], [], ["acc"], [1.0])
    assert rewards == [] and metrics["reward/mean"] == 0.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"verifier_function": ["acc", "format"], "verifier_weight": [1.0]}, ValueError, "has 2 entries.*has 1"),
        ({"verifier_function": ["acc", "fromat"], "verifier_weight": [1.0, 1.0]}, ValueError, "did you mean 'format'"),
        ({"verifier_function": [], "verifier_weight": []}, ValueError, "verifier_function is empty"),
        ({"verifier_function": ["acc"], "verifier_weight": [float("nan")]}, ValueError, "finite number"),
        ({"verifier_function": ["acc"], "verifier_weight": [1.0], "timeout": 0}, ValueError, "verifier_timeout"),
        ({"verifier_function": ["acc"], "verifier_weight": [1.0], "labels": ["1"]}, ValueError, "2 responses but 1"),
        (
            {"verifier_function": ["acc"], "verifier_weight": [1.0], "responses": [GOOD, None]},
            TypeError,
            r"responses\[1\]",
        ),
    ],
)
def test_config_errors_are_clear(kwargs, error, match):
    args = {"responses": [GOOD, GOOD], "labels": ["4", "4"], "num_workers": WORKERS, **kwargs}
    with pytest.raises(error, match=match):
        compute_rule_rewards(**args)


@pytest.fixture
def scratch_verifier_name():
    """A verifier name free for this test, unregistered afterwards so a rerun in the same process works."""
    name = "_test_lambda"
    assert name not in VERIFIERS, f"{name!r} left registered by an earlier test"
    yield name
    VERIFIERS.pop(name, None)


def test_lambda_verifier_is_rejected_before_scoring(scratch_verifier_name):
    register_verifier(scratch_verifier_name)(lambda r, label: 1.0)
    with pytest.raises(ValueError, match="module-level function"):
        score([GOOD], ["4"], [scratch_verifier_name], [1.0])


def test_pool_persists_across_calls():
    first, _ = score(["a"] * 8, [None] * 8, ["_test_pid"], [1.0])
    second, _ = score(["a"] * 8, [None] * 8, ["_test_pid"], [1.0])
    assert set(first) | set(second) <= {float(p) for p in get_shared_pool(WORKERS).worker_pids()}
    assert os.getpid() not in set(first)


def test_hanging_sample_times_out_is_counted_and_the_worker_replaced():
    pool = get_shared_pool(WORKERS)
    before = set(pool.worker_pids())
    responses = ["ok"] * 5 + ["HANG"] + ["ok"] * 5
    start = time.perf_counter()
    rewards, metrics = score(responses, [None] * 11, ["_test_sleep_if_marked"], [1.0], timeout=1.0)
    assert time.perf_counter() - start < HANG_S  # one timeout, not a stalled batch (the hang is 600 s)
    assert rewards == [1.0] * 5 + [0.0] + [1.0] * 5
    assert metrics["reward/timeouts"] == 1.0 and metrics["reward/worker_restarts"] == 1.0
    assert set(pool.worker_pids()) != before
    rewards, metrics = score(["ok"] * 4, [None] * 4, ["_test_sleep_if_marked"], [1.0])
    assert rewards == [1.0] * 4 and metrics["reward/timeouts"] == 0.0


def test_crashing_worker_costs_one_sample_and_is_replaced():
    responses = ["ok", "CRASH", "ok", "ok", "CRASH", "ok"]
    rewards, metrics = score(responses, [None] * 6, ["_test_crash_if_marked", "format"], [1.0, 1.0])
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert metrics["reward/crashes"] == 2.0 and metrics["reward/worker_restarts"] == 2.0


def test_raising_or_nan_verifier_scores_zero_and_counts_as_error():
    rewards, metrics = score(["ok", "RAISE", "NAN"], [None] * 3, ["_test_raise_if_marked"], [1.0])
    assert rewards == [1.0, 0.0, 0.0]
    assert metrics["reward/errors"] == 2.0 and metrics["reward/worker_restarts"] == 0.0


def test_linear_verifiers_alone_score_in_this_process_as_the_pool_does():
    """`format` and `strict_format` (linear-time scans) alone score in the calling process, with no pool made, to the
    pool's scores; a raising or non-finite one counts as an error there too; with any other verifier the pool scores."""
    from mindrl.rewards import pool as pool_module
    from mindrl.rewards import shutdown_shared_pool

    responses = [GOOD, "<think>x</think> <answer>5</answer>", "", "no tags", "<answer>\\boxed{1}</answer>"]
    names = ["format", "strict_format"]
    fns = [VERIFIERS[n] for n in names]
    expected = get_shared_pool(WORKERS).score(responses, [None] * 5, fns, timeout=HANG_S).scores
    shutdown_shared_pool()
    scored = score_rule_rewards(responses, [None] * 5, names, [1.0, 0.5], num_workers=WORKERS)
    assert pool_module._shared_pool is None
    assert [tuple(s) for s in scored.per_verifier] == expected
    assert scored.rewards == [a + 0.5 * b for a, b in expected]
    rewards, metrics = score(["ok", "RAISE", "NAN"], [None] * 3, ["_test_inline_raise_if_marked", "format"], [1, 1])
    assert rewards == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 2.0 and pool_module._shared_pool is None
    score([GOOD], ["4"], ["format", "_test_pid"], [1.0, 0.0])
    assert pool_module._shared_pool is not None


ALL = ["acc", "format", "strict_format", "base_acc", "acc_for_ppo", "math_17k_acc", "math_verify", "gsm8k"]
# name -> (response, label, the score each verifier in ALL owes it). A None score: the sample may time
# out instead (a power tower makes sympy evaluate 9^387420489; the pool kills it at the deadline).
PATHOLOGICAL = {
    # right format, wrong answer: only the format checks pass (gsm8k reads the last number, 9)
    "tower": ("<think>x</think><answer>\\boxed{9^{9^{9^{9}}}}</answer>", "1", [-0.5, 1, 1, 0, 0, 0, 0, 0]),
    "tower_label": ("\\boxed{1}", "9^{9^{9^{9}}}", [-0.5, 0, -0.5, 0, 0, 0, 0, 0]),
    # a right answer after 100 kB of text: every answer check passes, no format check does
    "long_response": ("Let us think. " * 7_200 + "\\boxed{2}", "2", [1, 0, -0.5, 0, 1, 1, 1, 1]),
    # 400 nested groups are no answer (math-verify is exponential in the depth); gsm8k sees the number 1
    "nested_braces": ("\\boxed{" + "{" * 400 + "1" + "}" * 400 + "}", "1", [-0.5, 0, -0.5, 0, 0, 0, 0, 1]),
    # unparseable box: no equivalence; gsm8k's last number is the 1 of \frac{1}
    "invalid_latex": ("\\boxed{\\frac{1}{ \\sqrt[ \\left( } ^^ _ & \\end{array}}", "1", [-0.5, 0, -0.5, 0, 0, 0, 0, 1]),
    # a truncated box is no answer for the rule verifiers; math-verify still reads \frac{1}{2} = 0.5
    "unbalanced_boxed": ("the answer is \\boxed{\\frac{1}{2}", "0.5", [-1, 0, -0.5, 0, 0, 0, 1, 0]),
    # \u00bd wrapped in control characters and a lone surrogate is not 0.5
    "unicode_control": (
        "\\boxed{\u00bd\u200b\x00\x07\u202e\ud800\U0001f600}\x1b[31m",
        "0.5",
        [-0.5, 0, -0.5, 0, 0, 0, 0, 0],
    ),
    "empty": ("", "", [-1, 0, -0.5, 0, 0, 0, 0, 0]),
    "none_label": ("\\boxed{3}", None, [-0.5, 0, -0.5, 0, 0, 0, 0, 0]),
}
MAY_TIME_OUT = {"tower", "tower_label"}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_input_scores_what_it_deserves(name):
    response, label, expected = PATHOLOGICAL[name]
    timeout = 1.0 if name in MAY_TIME_OUT else 10.0
    start = time.perf_counter()
    scores = score_rule_rewards([response], [label], ALL, [1.0] * len(ALL), timeout=timeout, num_workers=WORKERS)
    assert time.perf_counter() - start < timeout + HANG_S, name
    assert scores.metrics["reward/errors"] == 0.0 and scores.metrics["reward/crashes"] == 0.0
    if scores.per_verifier[0] is None:
        assert name in MAY_TIME_OUT, f"{name} timed out"
        assert scores.metrics["reward/timeouts"] == 1.0 and scores.rewards == [0.0]
        return
    assert dict(zip(ALL, scores.per_verifier[0])) == dict(zip(ALL, map(float, expected)))
    assert scores.rewards == [pytest.approx(sum(expected))]


def test_tower_is_a_timeout_not_a_hang():
    response, label, _ = PATHOLOGICAL["tower"]
    rewards, metrics = score([response, GOOD], [label, "4"], ["acc"], [1.0], timeout=1.0)
    assert metrics["reward/timeouts"] == 1.0
    assert rewards == [0.0, 1.0]


def test_math_verifiers_alone_make_the_pool_import_math_verify():
    """A pool that scores `format` only never imports math-verify nor sympy (nor torch); the first call with a math
    verifier warms its processes up before any sample's clock starts, so a tight timeout still scores."""
    from mindrl.rewards import VerifierPool

    with VerifierPool(1, start_method="spawn") as pool:  # its own processes, none forked from a warm one
        light = pool.score(["x"], [None], [VERIFIERS["_test_heavy_imports"], VERIFIERS["format"]], timeout=HANG_S)
        assert light.status == ["ok"] and light.scores[0][0] == 0.0
        heavy = pool.score(
            [GOOD], ["4"], [VERIFIERS["acc"], VERIFIERS["_test_heavy_imports"]], timeout=1.0, math_verifiers=True
        )
        assert heavy.status == ["ok"] and heavy.scores[0] == (1.0, 2.0), heavy  # math-verify and sympy, not torch
        assert heavy.worker_restarts == 0
