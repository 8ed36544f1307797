"""The workers' stage profiler (profiler_config): it records only the selected stage, iteration and rank, writes a
trace with the stage's named range, and its summary puts the time where it went (GEMMs, elementwise, optimizer)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mindrl.platform.profiler import ProfileOptions
from mindrl.workers.profiling import OPTIMIZER_RANGE, ProfileSettings, StageProfiler, op_category


def _work(steps: int = 3) -> None:
    """A small training loop: GEMMs, elementwise ops and optimizer steps (under the optimizer's range)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(512, 256)
    for _ in range(steps):
        loss = (model(x).tanh() ** 2).mean()
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            opt.step()
        opt.zero_grad()


def _settings(root, **kw) -> ProfileSettings:
    base = dict(save_path=str(root), stages=("actor_update",), start=2, end=3, ranks=(1,),
                options=ProfileOptions(analyse=True, record_shapes=True))  # fmt: skip
    return ProfileSettings(**{**base, **kw})


@pytest.mark.parametrize(
    "iteration,stage,rank",
    [
        (None, "actor_update", 1),
        (1, "actor_update", 1),
        (3, "actor_update", 1),
        (2, "critic_update", 1),
        (2, "actor_update", 0),
    ],  # fmt: skip
)
def test_nothing_is_recorded_outside_the_selection(tmp_path, iteration, stage, rank):
    prof = StageProfiler(_settings(tmp_path), rank)
    prof.set_iteration(iteration)
    ran = []
    with prof.stage(stage):
        ran.append(1)
    assert ran == [1] and prof.written == [] and os.listdir(tmp_path) == []


def test_disabled_profiler_is_a_plain_range(tmp_path):
    prof = StageProfiler(None, 0)
    prof.set_iteration(1)
    with torch.profiler.profile() as outer, prof.stage("actor_update"):
        torch.ones(3).add_(1)
    assert "mindrl::actor_update" in {e.name for e in outer.events()}
    assert prof.written == []


def test_selected_stage_writes_its_trace_and_summary(tmp_path):
    prof = StageProfiler(_settings(tmp_path), 1)
    prof.set_iteration(2)
    with prof.stage("actor_update"):
        _work()
    out = tmp_path / "actor_update" / "iter_2"
    assert prof.written == [str(out / "rank_1.json")]
    assert sorted(os.listdir(out)) == ["rank_1.json", "rank_1.ops.txt", "rank_1.summary.json"]
    trace = json.load(open(out / "rank_1.json"))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"mindrl::actor_update", OPTIMIZER_RANGE, "aten::addmm"} <= names
    summary = json.load(open(out / "rank_1.summary.json"))
    s = summary["seconds"]
    print(summary)
    assert (summary["stage"], summary["iteration"], summary["rank"]) == ("actor_update", 2, 1)
    assert s["gemm"] > 0 and s["elementwise"] > 0 and s["optimizer"] > 0 and s["communication"] == 0
    assert sum(s.values()) <= summary["wall_s"] * 1.05
    assert abs(sum(summary["share"].values()) - sum(s.values()) / summary["wall_s"]) < 1e-9
    text = open(out / "rank_1.ops.txt").read()
    assert text.startswith("actor_update, iteration 2, rank 1:") and "aten::addmm" in text
    assert "[[512, 256]" in text  # record_shapes: ops split by input shape


def test_every_rank_and_stage_when_unrestricted(tmp_path):
    settings = _settings(tmp_path, stages=("actor_update", "critic_update"), ranks=None,
                         options=ProfileOptions())  # fmt: skip
    for rank in (0, 3):
        prof = StageProfiler(settings, rank)
        prof.set_iteration(2)
        for stage in ("critic_update", "actor_update"):
            with prof.stage(stage):
                _work(1)
    found = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert found == [f"{s}/iter_2/rank_{r}.json" for s in ("actor_update", "critic_update") for r in (0, 3)]


def test_op_categories():
    assert op_category("aten::mm", False) == "gemm"
    assert op_category("aten::addmm_", False) == "gemm"  # the weight-grad accumulation into main_grad
    assert op_category("mindrl_c::gemm", False) == "gemm"  # a CPU rollout engine's linears (vllm_ops.PackedLinear)
    assert op_category("_C::onednn_mm", False) == "gemm"  # vLLM-CPU's linear layers
    assert op_category("aten::mm", True) == "optimizer"
    assert op_category("c10d::allreduce_", False) == "communication"
    assert op_category("_ReduceFromModelParallelRegion", False) == "communication"
    assert op_category("aten::mul", False) == "elementwise"


def test_breakdown_counts_the_stage_thread_only(tmp_path):
    """A helper thread's ops (e.g. a rollout engine's) are not the stage's: only the range's thread counts."""
    import threading

    def helper():
        with torch.profiler.record_function("helper"):
            for _ in range(20):
                torch.randn(256, 256) @ torch.randn(256, 256)

    prof = StageProfiler(_settings(tmp_path), 1)
    prof.set_iteration(2)
    with prof.stage("actor_update"):
        t = threading.Thread(target=helper)
        t.start()
        torch.randn(64, 64).exp()
        t.join()
    summary = json.load(open(tmp_path / "actor_update" / "iter_2" / "rank_1.summary.json"))
    assert summary["seconds"]["gemm"] == 0  # the GEMMs ran in the helper thread
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_s"], rel=0.05)
