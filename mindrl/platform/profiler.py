"""The platform's profiler for one profiled stage (torch.profiler on CPU and CUDA, torch_npu.profiler on Ascend):
`stage_profiler` records and writes a trace, `stage_range` names a span in whatever trace is recording."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mindrl.platform.detect import current_platform


@dataclass(frozen=True)
class ProfileOptions:
    """What to record (MindSpeed-RL's profiler_config keys, platform-neutral names)."""

    with_host: bool = True  # profile_with_cpu
    with_device: bool = True  # profile_with_npu: CUDA kernels / NPU tasks
    with_memory: bool = False  # profile_with_memory
    record_shapes: bool = False  # profile_record_shapes
    with_stack: bool = False  # profile_with_module
    level: str = "level0"  # profile_level
    export_type: str = "text"  # profile_export_type
    analyse: bool = False  # profile_analysis


def events_in_process() -> bool:
    """Whether the profiler keeps its events in this process after it stops (torch.profiler: yes, so a summary can
    be computed right away; torch_npu writes raw data for its own offline or `analyse` parsing)."""
    return current_platform().name != "npu"


def trace_file(out_dir: str, name: str) -> str:
    """Where the trace of `name` is written on this platform (torch_npu: a directory of its own layout)."""
    return os.path.join(out_dir, name if current_platform().name == "npu" else f"{name}.json")


def stage_profiler(out_dir: str, name: str, options: ProfileOptions):
    """An unstarted profiler (a context manager) that writes `trace_file(out_dir, name)` when it stops."""
    platform = current_platform()
    os.makedirs(out_dir, exist_ok=True)
    if platform.name == "npu":
        import torch_npu

        prof_mod = torch_npu.profiler
        levels = {
            "level_none": prof_mod.ProfilerLevel.Level_none,
            "level0": prof_mod.ProfilerLevel.Level0,
            "level1": prof_mod.ProfilerLevel.Level1,
            "level2": prof_mod.ProfilerLevel.Level2,
        }
        export = prof_mod.ExportType.Db if options.export_type == "db" else prof_mod.ExportType.Text
        activities = [a for a, on in ((prof_mod.ProfilerActivity.CPU, options.with_host),
                                      (prof_mod.ProfilerActivity.NPU, options.with_device)) if on]  # fmt: skip
        return prof_mod.profile(
            activities=activities,
            record_shapes=options.record_shapes,
            profile_memory=options.with_memory,
            with_stack=options.with_stack,
            experimental_config=prof_mod._ExperimentalConfig(profiler_level=levels[options.level], export_type=export),
            on_trace_ready=prof_mod.tensorboard_trace_handler(
                trace_file(out_dir, name), worker_name=name, analyse_flag=options.analyse
            ),
        )
    activities = []
    if options.with_host:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if options.with_device and platform.name == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if not activities:
        raise ValueError(
            f"nothing to profile on {platform.name}: profile_with_cpu is false and there is no device activity "
            "(profile_with_npu records a device's kernels)"
        )
    path = trace_file(out_dir, name)
    return torch.profiler.profile(
        activities=activities,
        record_shapes=options.record_shapes,
        profile_memory=options.with_memory,
        with_stack=options.with_stack,
        with_flops=options.level == "level2",
        on_trace_ready=lambda prof: prof.export_chrome_trace(path),
    )


@contextlib.contextmanager
def stage_range(name: str, mstx: bool = False) -> Iterator[None]:
    """A named range around a stage's work, in the trace being recorded (and an mstx range on Ascend with mstx)."""
    mark = None
    if mstx and current_platform().name == "npu":
        import torch_npu

        mark = torch_npu.npu.mstx.range_start(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if mark is not None:
            import torch_npu

            torch_npu.npu.mstx.range_end(mark)
