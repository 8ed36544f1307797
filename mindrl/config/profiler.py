"""`profiler_config`: per-stage profiling of the workers, in MindSpeed-RL's keys: which stages of which iterations write
a trace per rank, and optionally a summary of where the time went (docs/profiling.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from mindrl.config.errors import Collector
from mindrl.config.section import Section

STAGES = (
    "actor_generate",
    "actor_compute_log_prob",
    "reference_compute_log_prob",
    "critic_compute_values",
    "reward_compute_scores",
    "actor_update",
    "critic_update",
)
LEVELS = ("level_none", "level0", "level1", "level2")
EXPORT_TYPES = ("text", "db")


@dataclass
class ProfilerSection(Section):
    """One worker kind's profiler settings (MindSpeed-RL's `profiler_config.integrated`; its defaults)."""

    SECTION: ClassVar[str] = "profiler_config.integrated"

    profile: bool = False
    """Profile at all (every other key depends on it)."""
    mstx: bool = False
    """Ascend's lightweight range markers (mstx). mindrl always marks each profiled stage as a named range in the
    trace (`mindrl::<stage>`); on Ascend this also records mstx ranges."""
    stage: str | list[str] = "all"
    """`all`, or one or a list of: actor_generate, actor_compute_log_prob, reference_compute_log_prob,
    critic_compute_values, reward_compute_scores, actor_update, critic_update."""
    profile_save_path: str = "./profiler_data"
    """Where the traces go: <profile_save_path>/<stage>/iter_<N>/rank_<R>.* (relative paths: to the working
    directory of mindrl-train)."""
    profile_export_type: str = "text"
    """text (a Chrome / Perfetto trace JSON; on Ascend its profiler's text export) or db (Ascend only: its profiler's
    database export; elsewhere the text trace is written)."""
    profile_step_start: int = 1
    """First profiled iteration (1-based)."""
    profile_step_end: int = 2
    """First iteration no longer profiled: iterations start .. end-1 are profiled."""
    profile_level: str = "level0"
    """level_none, level0, level1 or level2: the Ascend profiler's collection level. On CPU and CUDA level2 also
    counts the FLOPs of matmuls; the other levels collect the same events there."""
    profile_with_memory: bool = False
    """Record allocations (memory timeline)."""
    profile_record_shapes: bool = False
    """Record each op's input shapes (the summary then also splits ops by shape)."""
    profile_with_cpu: bool = True
    """Host-side events (every torch op). Off: device activity only (needs a device)."""
    profile_with_npu: bool = True
    """Device-side activity (CUDA kernels, or NPU tasks); nothing to record on a CPU."""
    profile_with_module: bool = False
    """Python call stacks of the ops (large traces)."""
    profile_analysis: bool = False
    """Also write the summary next to each trace (summary.json + a text table of the top ops); on Ascend, parse
    the raw data right after collection (the Ascend profiler's analyse)."""
    profile_ranks: str | list[int] = "all"
    """`all`, or the global ranks of the workers to profile, e.g. [0]."""

    @classmethod
    def normalize(cls, key: str, value):
        if key == "stage" and isinstance(value, (list, tuple)) and len(value) == 1 and value[0] == "all":
            return "all"
        return value

    def validate(self, col: Collector) -> None:
        stages = [self.stage] if isinstance(self.stage, str) else list(self.stage)
        if isinstance(self.stage, str) and self.stage != "all" and self.stage not in STAGES:
            col.add("stage", f"{self.stage!r} is not a stage; expected all or some of {', '.join(STAGES)}")
        elif not isinstance(self.stage, str):
            bad = [s for s in stages if s not in STAGES]
            if bad or not stages:
                col.add("stage", f"{bad or stages} {'are not stages' if bad else 'is empty'}; expected all or a list "
                        f"of {', '.join(STAGES)}")  # fmt: skip
        if self.profile_level not in LEVELS:
            col.add("profile_level", f"{self.profile_level!r} is not one of {', '.join(LEVELS)}")
        if self.profile_export_type not in EXPORT_TYPES:
            col.add("profile_export_type", f"{self.profile_export_type!r} is not one of {', '.join(EXPORT_TYPES)}")
        if self.profile_step_start < 1:
            col.add("profile_step_start", f"must be >= 1 (iterations count from 1), got {self.profile_step_start}")
        elif self.profile_step_end <= self.profile_step_start:
            col.add("profile_step_end", f"must be > profile_step_start={self.profile_step_start} (the end is not "
                    f"profiled: start .. end-1 are), got {self.profile_step_end}")  # fmt: skip
        if isinstance(self.profile_ranks, str) and self.profile_ranks != "all":
            col.add("profile_ranks", f"expected all or a list of ranks, got {self.profile_ranks!r}")
        elif isinstance(self.profile_ranks, list) and (not self.profile_ranks or min(self.profile_ranks) < 0):
            col.add("profile_ranks", f"expected all or a non-empty list of ranks >= 0, got {self.profile_ranks}")
        if self.profile and not (self.profile_with_cpu or self.profile_with_npu):
            col.add("profile_with_cpu", "profile_with_cpu and profile_with_npu are both false: nothing to record")
        if not self.profile_save_path:
            col.add("profile_save_path", "must not be empty")

    @property
    def stages(self) -> tuple[str, ...]:
        return STAGES if self.stage == "all" else ((self.stage,) if isinstance(self.stage, str) else tuple(self.stage))

    @property
    def ranks(self) -> tuple[int, ...] | None:
        """The profiled ranks; None: all."""
        return None if self.profile_ranks == "all" else tuple(self.profile_ranks)


@dataclass
class ProfilerConfig(Section):
    """MindSpeed-RL's `profiler_config`. Its one worker kind, `integrated`, covers the critic's stages too (mindrl's
    critic runs in its own worker on the same devices)."""

    SECTION: ClassVar[str] = "profiler_config"

    integrated: ProfilerSection = field(default_factory=ProfilerSection)
