"""External experiment trackers (wandb, SwanLab) as metrics sinks beside metrics.jsonl and TensorBoard: one run per
trainer run, opened from rl_config's MindSpeed-RL keys and closed with every background process it started."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

SWANLAB_DEFAULT_DIR = "swanlog"  # under run_dir when swanlab_save_dir is ''


@dataclass(frozen=True)
class TrackerSpec:
    """What to open: `kind` 'wandb' or 'swanlab', the project, the run name ('' lets the tracker pick), the directory
    its files go under, and (SwanLab) the mode."""

    kind: str
    project: str
    name: str
    save_dir: str
    mode: str = ""

    @property
    def key(self) -> str:
        """The config key that turned this tracker on, for error messages."""
        return f"rl_config.use_{self.kind}"


def trackers_from_config(rl, run_dir: str) -> list[TrackerSpec]:
    """The trackers `rl` (an RLSectionConfig) turns on, with their directories resolved against `run_dir`."""
    out = []
    if rl.use_wandb:
        out.append(TrackerSpec("wandb", rl.wandb_project, rl.wandb_exp_name, rl.wandb_save_dir or run_dir))
    if rl.use_swanlab:
        save_dir = rl.swanlab_save_dir or os.path.join(run_dir, SWANLAB_DEFAULT_DIR)
        out.append(TrackerSpec("swanlab", rl.swanlab_project, rl.swanlab_exp_name, save_dir, rl.swanlab_mode))
    return out


def import_tracker(spec: TrackerSpec):
    """The tracker's package, or an ImportError that names the config key and the pip command."""
    try:
        return importlib.import_module(spec.kind)
    except ImportError as e:
        raise ImportError(
            f"{spec.key} is true but the `{spec.kind}` package is not installed: `pip install {spec.kind}`, "
            f"or set {spec.key}: false"
        ) from e


class TrackerRun:
    """One open tracker run (the package's run object in `_run`): `log(values, step)` and `close()` (idempotent)."""

    _run = None

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish()
        finally:
            self._after_close()

    def _after_close(self) -> None:
        """What the package needs once its run has finished (nothing by default)."""


class WandbRun(TrackerRun):
    """A wandb run. wandb starts a `wandb-core` service process for its runs; it is stopped on close once no
    wandb run is left in this process, so a finished trainer leaves no process behind."""

    def __init__(self, wandb, spec: TrackerSpec, config: dict | None):
        os.makedirs(spec.save_dir, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=spec.project or None, name=spec.name or None, dir=spec.save_dir, config=config)

    def _after_close(self) -> None:
        if self._wandb.run is None:  # no other run of this process still needs the service
            self._wandb.teardown()


class SwanLabRun(TrackerRun):
    """A SwanLab run, never interactive: a cloud run without `swanlab login` fails at start instead of prompting."""

    def __init__(self, swanlab, spec: TrackerSpec, config: dict | None):
        os.makedirs(spec.save_dir, exist_ok=True)
        self._run = swanlab.init(
            project=spec.project,
            experiment_name=spec.name or None,
            logdir=spec.save_dir,
            mode=spec.mode,  # swanlab reads MindSpeed-RL's 'cloud' as 'online'
            config=config,
            settings=swanlab.Settings(interactive=False),
        )


_RUNS = {"wandb": WandbRun, "swanlab": SwanLabRun}


def open_tracker(spec: TrackerSpec, package, config: dict | None) -> TrackerRun:
    """Start `spec`'s run with its package (from `import_tracker`, called first so that a missing package fails
    before any file is written)."""
    return _RUNS[spec.kind](package, spec, config)
