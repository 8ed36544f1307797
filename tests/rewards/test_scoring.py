"""compute_rule_rewards and the verifier pool: weighted combination, config errors, external timeouts,
crash recovery, a persistent pool, and every pathological input returning within the timeout."""

import os
import time

import pytest

from mindrl.rewards import compute_rule_rewards, get_shared_pool, register_verifier
from tests.rewards import pool_helpers  # noqa: F401  (registers the _test_* verifiers)

WORKERS = 2
GOOD = "<think>2+2</think><answer>\\boxed{4}</answer>"


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


def test_lambda_verifier_is_rejected_before_scoring():
    register_verifier("_test_lambda")(lambda r, label: 1.0)
    with pytest.raises(ValueError, match="module-level function"):
        score([GOOD], ["4"], ["_test_lambda"], [1.0])


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
    assert (
        time.perf_counter() - start < 30.0
    )  # one timeout, not a stalled batch (the hang is 600 s; slack for a loaded machine)
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


ALL = ["acc", "format", "strict_format", "base_acc", "acc_for_ppo", "math_17k_acc", "math_verify", "gsm8k"]
PATHOLOGICAL = {
    "tower": ("<think>x</think><answer>\\boxed{9^{9^{9^{9}}}}</answer>", "1"),
    "tower_label": ("\\boxed{1}", "9^{9^{9^{9}}}"),
    "long_response": ("Let us think. " * 7_200 + "\\boxed{2}", "2"),
    "nested_braces": ("\\boxed{" + "{" * 400 + "1" + "}" * 400 + "}", "1"),
    "invalid_latex": ("\\boxed{\\frac{1}{ \\sqrt[ \\left( } ^^ _ & \\end{array}}", "1"),
    "unbalanced_boxed": ("the answer is \\boxed{\\frac{1}{2}", "0.5"),
    "unicode_control": ("\\boxed{\u00bd\u200b\x00\x07\u202e\ud800\U0001f600}\x1b[31m", "0.5"),
    "empty": ("", ""),
    "none_label": ("\\boxed{3}", None),
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_input_returns_within_timeout(name):
    response, label = PATHOLOGICAL[name]
    timeout = 1.0
    start = time.perf_counter()
    rewards, metrics = score([response], [label], ALL, [1.0] * len(ALL), timeout=timeout)
    elapsed = time.perf_counter() - start
    assert elapsed < timeout + 15, f"{name} took {elapsed:.2f}s"
    assert len(rewards) == 1 and rewards[0] == rewards[0]  # a number, not NaN
    if metrics["reward/timeouts"]:
        assert rewards == [0.0]


def test_tower_is_a_timeout_not_a_hang():
    response, label = PATHOLOGICAL["tower"]
    rewards, metrics = score([response, GOOD], [label, "4"], ["acc"], [1.0], timeout=1.0)
    assert metrics["reward/timeouts"] == 1.0
    assert rewards == [0.0, 1.0]
