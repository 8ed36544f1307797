"""The experience pipeline of a validated config: its schedule, episode and engine, and the filter if configured."""

from __future__ import annotations

from collections.abc import Callable

from mindrl.trainer.pipeline import Pipeline, bounded, one_step_off, partial
from mindrl.trainer.pipeline.engines import Engine
from mindrl.trainer.pipeline.episode import OneTurn
from mindrl.trainer.pipeline.filter import DynamicSampling
from mindrl.trainer.pipeline.schedule import Schedule, Seeds, Sync


def build(cfg, loader, dataset, engine: Engine, sampling, tokenizer, rewards, export: Callable[[], object]) -> Pipeline:
    """`engine`: the trainer's rollout; `rewards`: `model_rewards.Rewards` (the filter scores with them); `export`:
    the actor's current weights (bounded publishes them). The combinations config validation refuses never get here."""
    rl, mt = cfg.rl_config, cfg.megatron_training
    n = rl.n_samples_per_prompt
    schedule: Schedule
    if rl.async_mode == "bounded":  # the samplers are the engines
        schedule = bounded.bounded(cfg, dataset)
        schedule.export = export
    else:
        sync = Sync(loader, OneTurn(engine), sampling, Seeds(mt.seed, n))
        pool, ahead = partial.from_config(cfg, sampling), one_step_off.one_step_off(cfg)
        schedule = (partial.PartialSchedule(pool, sync) if pool is not None
                    else one_step_off.OneStepOffSchedule(ahead, sync) if ahead is not None else sync)  # fmt: skip
    keep = None
    if rl.filter_groups_enable:
        names = rewards.client.settings.verifier_function
        keep = DynamicSampling(rl, n, names, rewards, tokenizer, engine.enter_phase)
    return Pipeline(schedule, n, tokenizer.pad_token_id, keep)
