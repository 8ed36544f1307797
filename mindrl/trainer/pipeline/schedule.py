"""The schedule layer: when each generation batch is sampled relative to the updates. `Schedule` is its interface;
`Sync` draws and samples a batch with the weights it trains (one_step_off, bounded and partial are their own
modules)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mindrl.data.prompt_dataset import PromptBatch
from mindrl.trainer import experience
from mindrl.trainer.experience import Response


@dataclass
class Generated:
    """One generation batch: G prompts with their n responses each."""

    prompt_ids: list[list[int]]
    responses: list[list[Response]]
    labels: list[list[int]]
    """Per row (G * n), its prompt's label token ids."""
    metrics: dict[str, float] = field(default_factory=dict)
    rows_meta: dict[str, list] = field(default_factory=dict)
    """Per-row metadata for the RL batch ("weight_version"; bounded: "prompt_index", "epoch")."""


def generated(prompts: PromptBatch, responses: list[list[Response]], n: int, **rows_meta: list) -> Generated:
    """The generation batch of dataset `prompts` and their responses."""
    labels = experience.row_labels(prompts.extras, n, len(responses) * n)
    return Generated([p.tolist() for p in prompts.prompts], responses, labels, {}, rows_meta)


@dataclass(frozen=True)
class Seeds:
    """Per-prompt sampling seeds from (seed, iteration, generation batch, dataset row): sampling does not depend on the
    layout, the mode, or how the prompts are spread over engine replicas."""

    seed: int
    n: int

    def __call__(self, iteration: int, gen_batch: int, indices: Sequence[int]) -> list[int]:
        base = self.seed * 1_000_003 + iteration * 7919 + gen_batch * 104_729
        return [(base + int(i) * self.n) % (2**31) for i in indices]


class Schedule:
    """When generation happens relative to the updates. The trainer's weights hold `iteration - 1` updates when
    `next(iteration, ...)` is called."""

    def next(self, iteration: int, gen_batch: int, timing: dict[str, float]) -> Generated:
        """Iteration `iteration`'s generation batch number `gen_batch` (> 0 only under a filter that asked for more),
        its schedule metrics in `Generated.metrics`; the rollout's timings added to `timing`."""
        raise NotImplementedError

    def after_update(self, iteration: int, timing: dict[str, float]) -> None:
        """Called once the weights hold `iteration` updates (bounded publishes them)."""

    def state_dict(self) -> dict:
        """TrainerState fields: what is in flight, so that a resume continues exactly."""
        return {}

    def load_state_dict(self, state, iteration: int) -> None:
        """The fields of a checkpoint's TrainerState `state`, saved at `iteration`."""
        refuse_pending(state)

    def close(self) -> None:
        """Release what the schedule holds outside this process."""


def refuse_pending(state) -> None:
    """A checkpoint whose one_step_off batches generated ahead only one_step_off can resume."""
    meta = state.async_rollout
    if meta and meta.get("batches"):
        raise ValueError(
            f"the checkpoint holds {len(meta['batches'])} batch(es) generated ahead by rl_config.async_mode "
            "one_step_off, whose prompts its data loader has drawn: resume with async_mode one_step_off (a "
            "synchronous resume would skip them)"
        )


class Sync(Schedule):
    """Each generation batch drawn from the data loader and sampled now, with the weights it trains."""

    def __init__(self, loader, episode, sampling, seeds: Seeds):
        self.loader, self.episode, self.sampling, self.seeds = loader, episode, sampling, seeds
        self._batches = None

    def draw(self) -> PromptBatch:
        if self._batches is None:  # after a resume restored the loader's position
            self._batches = iter(self.loader)
        return next(self._batches)

    __next__ = draw  # the loader's batches, for the schedules that draw through this one

    def __iter__(self):
        return self

    def next(self, iteration: int, gen_batch: int, timing: dict[str, float]) -> Generated:
        prompts = self.draw()
        ids = [p.tolist() for p in prompts.prompts]
        groups = self.episode.run(ids, self.sampling, self.seeds(iteration, gen_batch, prompts.indices), timing)
        rows = len(groups) * self.seeds.n
        out = generated(prompts, experience.stamp(groups, iteration - 1), self.seeds.n,
                        weight_version=[iteration - 1] * rows)  # fmt: skip
        out.metrics.update(self.episode.metrics)
        return out
