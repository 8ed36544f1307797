"""tools/general_check.py on two tiny models: the KL of a model to itself is fp32's rounding, to another model it is
large, on the same (seeded) base samples; the rows are the instructions with both models' greedy answers."""

from __future__ import annotations

from tools.general_check import INSTRUCTIONS, check


def test_general_check_measures_how_far_the_tuned_model_moved(tiny_models):
    base, other = tiny_models["untied"], tiny_models["tied"]
    same = check(base, base, max_new=12, samples=2)
    moved = check(base, other, max_new=12, samples=2)
    assert same["kl_tokens"] == moved["kl_tokens"] > 0  # the base's own samples, drawn with the same seed
    assert moved["kl_per_token"] > 0.01  # two random models (0.21 nats per token here)
    # the same model: the base's log-probs (generate's, with its KV cache) against a full forward's, fp32 rounding only
    assert abs(same["kl_per_token"]) < 1e-4 * moved["kl_per_token"], (same["kl_per_token"], moved["kl_per_token"])
    for r in same, moved:
        assert [x["instruction"] for x in r["rows"]] == [q for q, _ in INSTRUCTIONS] and r["total"] == len(INSTRUCTIONS)
    assert all(x["base"] == x["tuned"] for x in same["rows"])  # greedy answers of one model
    assert [x["base"] for x in same["rows"]] == [x["base"] for x in moved["rows"]]
    assert same["base_right"] == same["kept"] == moved["base_right"]
