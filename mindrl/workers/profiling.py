"""Per-stage profiling in the workers (`profiler_config`): which stage of which iteration on which rank is recorded
(`StageProfiler`), where its trace goes, and the summary of where its time went."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mindrl.platform.profiler import ProfileOptions, events_in_process, stage_profiler, stage_range, trace_file

logger = logging.getLogger("mindrl.trainer")  # the driver's lines (announce_iteration)

OPTIMIZER_RANGE = "mindrl::optimizer"
"""The named range around each optimizer step (`rl_model.ppo_update`): the summary counts the ops under it as the
optimizer's."""

CATEGORIES = ("gemm", "elementwise", "optimizer", "communication", "python")
_COMM = ("allreduce", "all_reduce", "allgather", "all_gather", "broadcast", "reduce_scatter", "gloo", "c10d::",
         "barrier", "record_param_comms", "modelparallelregion", "sequenceparallelregion", "asynccommunication")  # fmt: skip
# torch's GEMMs, mindrl's oneDNN linears on CPU (mindrl.kernels.cpu_linear), vLLM-CPU's (its linear layers run
# oneDNN or packed-weight kernels registered as torch ops), and mindrl's GEMM in a CPU rollout engine (the range
# vllm_ops.GEMM_RANGE)
_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm", "_linear_pointwise", "onednn_mm",
         "weight_packed_linear", "mindrl_c::gemm")  # fmt: skip


@dataclass(frozen=True)
class ProfileSettings:
    """What the driver tells a worker to profile (from `profiler_config.integrated`)."""

    save_path: str
    stages: tuple[str, ...]
    start: int  # first profiled iteration
    end: int  # first iteration not profiled
    ranks: tuple[int, ...] | None = None  # None: every rank
    options: ProfileOptions = ProfileOptions()
    mstx: bool = False


def op_category(name: str, in_optimizer: bool) -> str:
    """gemm, elementwise, optimizer (any op under the optimizer's range) or communication (megatron's TP autograd
    functions wait on their collectives in their own self time)."""
    low = name.lower()
    if in_optimizer:
        return "optimizer"
    if any(s in low for s in _COMM):
        return "communication"
    if any(s in low for s in _GEMM):
        return "gemm"
    return "elementwise"


def time_breakdown(events, wall_s: float) -> dict[str, float]:
    """Seconds per category (CATEGORIES) from a torch profiler's events: each host op's self time goes to its
    category; "python" is the wall time no top-level op covers (the interpreter, the framework's own code). Ops
    under `mindrl::` ranges count; the ranges themselves do not. Only the thread(s) that ran a top-level `mindrl::`
    range count (the stage's own thread, not e.g. a rollout engine's helper threads); all threads without one."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    events = [e for e in events if e.device_type.name == "CPU"]
    threads = {e.thread for e in events if e.name.startswith("mindrl::") and e.cpu_parent is None}
    top_level = 0.0
    for e in events:
        if e.name.startswith("mindrl::") or (threads and e.thread not in threads):
            continue
        parent, in_opt = e.cpu_parent, False
        while parent is not None:
            if parent.name == OPTIMIZER_RANGE:
                in_opt = True
                break
            parent = parent.cpu_parent
        out[op_category(e.name, in_opt)] += e.self_cpu_time_total / 1e6
        if e.cpu_parent is None or e.cpu_parent.name.startswith("mindrl::"):
            top_level += e.cpu_time_total / 1e6
    out["python"] = max(wall_s - top_level, 0.0)
    return out


class StageProfiler:
    """One worker's profiler. `stage(name)` is cheap when nothing is profiled (one named range)."""

    def __init__(self, settings: ProfileSettings | None, rank: int):
        self.settings = settings
        self.rank = rank
        self.iteration: int | None = None
        self.written: list[str] = []  # traces written by this worker, in order

    def set_iteration(self, iteration: int | None) -> None:
        self.iteration = iteration

    def active(self, stage: str) -> bool:
        s, it = self.settings, self.iteration
        return (
            s is not None
            and it is not None
            and s.start <= it < s.end
            and stage in s.stages
            and (s.ranks is None or self.rank in s.ranks)
        )

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        mstx = self.settings.mstx if self.settings is not None else False
        if not self.active(name):
            with stage_range(f"mindrl::{name}", mstx):
                yield
            return
        assert self.settings is not None
        out_dir = os.path.join(self.settings.save_path, name, f"iter_{self.iteration}")
        stem = f"rank_{self.rank}"
        prof = stage_profiler(out_dir, stem, self.settings.options)
        with prof:
            t0 = time.perf_counter()
            with stage_range(f"mindrl::{name}", mstx):
                yield
            wall = time.perf_counter() - t0
        trace = trace_file(out_dir, stem)
        self.written.append(trace)
        if self.settings.options.analyse and events_in_process():
            self._summarize(prof, out_dir, stem, name, wall, trace, self.settings.options.record_shapes)

    def _summarize(self, prof, out_dir: str, stem: str, name: str, wall: float, trace: str, by_shape: bool) -> None:
        breakdown = time_breakdown(prof.events(), wall)
        summary = {
            "stage": name,
            "iteration": self.iteration,
            "rank": self.rank,
            "wall_s": wall,
            "seconds": breakdown,
            "share": {k: (v / wall if wall > 0 else 0.0) for k, v in breakdown.items()},
            "trace": trace,
        }
        with open(os.path.join(out_dir, f"{stem}.summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        table = prof.key_averages(group_by_input_shape=by_shape).table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(out_dir, f"{stem}.ops.txt"), "w") as f:
            shares = ", ".join(f"{k} {v:.3f} s ({summary['share'][k]:.0%})" for k, v in breakdown.items())
            f.write(f"{name}, iteration {self.iteration}, rank {self.rank}: {wall:.3f} s wall; {shares}\n\n{table}\n")


def announce_iteration(groups: list, prof: ProfileSettings | None, iteration: int) -> None:
    """The driver's side while profiling is on: tell every worker of `groups` which iteration runs next; after the
    last profiled one, that none does, and log where the traces went."""
    if prof is None or not prof.start <= iteration <= prof.end:
        return
    profiled = iteration < prof.end
    written = []
    for group in groups:
        for traces in group.profile_iteration(iteration if profiled else None):
            written += traces
    if profiled:
        logger.info("profiler: recording iteration %d (%s) under %s", iteration, ", ".join(prof.stages), prof.save_path)
    else:
        logger.info("profiler: %d traces of iterations %d-%d under %s", len(written), prof.start, prof.end - 1,
                    prof.save_path)  # fmt: skip
