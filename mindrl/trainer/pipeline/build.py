"""The experience pipeline of a validated config: its schedule, episode and engine, and the filter if configured."""

from __future__ import annotations

from collections.abc import Callable

from mindrl.trainer.pipeline import Pipeline, bounded, one_step_off, partial
from mindrl.trainer.pipeline.engines import Engine
from mindrl.trainer.pipeline.episode import Episode, OneTurn
from mindrl.trainer.pipeline.filter import DynamicSampling
from mindrl.trainer.pipeline.schedule import Schedule, Seeds, Sync


def build(cfg, loader, dataset, engine: Engine, sampling, tokenizer, rewards, export: Callable[[], object]) -> Pipeline:
    """`engine`: the trainer's rollout; `rewards`: `model_rewards.Rewards` (the filter scores with them); `export`:
    the actor's current weights (bounded publishes them). The combinations config validation refuses never get here."""
    rl, mt = cfg.rl_config, cfg.megatron_training
    n = rl.n_samples_per_prompt
    schedule: Schedule
    ep = None
    if rl.async_mode == "bounded":  # the samplers are the engines
        schedule = bounded.bounded(cfg, dataset)
        schedule.export = export
    else:
        ep = episode(cfg, engine, tokenizer, sampling)
        sync = Sync(loader, ep, sampling, Seeds(mt.seed, n))
        pool, ahead = partial.from_config(cfg, sampling, ep.limit(sampling)), one_step_off.one_step_off(cfg)
        schedule = (partial.PartialSchedule(pool, sync) if pool is not None
                    else one_step_off.OneStepOffSchedule(ahead, sync) if ahead is not None else sync)  # fmt: skip
    keep = None
    if rl.filter_groups_enable:
        names = rewards.client.settings.verifier_function
        keep = DynamicSampling(rl, n, names, rewards, tokenizer, engine.enter_phase)
    return Pipeline(schedule, n, tokenizer.pad_token_id, keep, ep)


def episode(cfg, engine: Engine, tokenizer, sampling) -> Episode:
    """One turn, or with rl_config.multi_turn_enable the agent loop over the tools of tool_config_path."""
    rl = cfg.rl_config
    if not rl.multi_turn_enable:
        return OneTurn(engine)
    from mindrl.agent.tools import build_tools
    from mindrl.trainer.pipeline.agent_loop import AgentLimits, AgentLoop

    return AgentLoop(engine, tokenizer, build_tools(rl.tool_config_path), AgentLimits.from_config(rl, sampling.max_tokens),
                     turn_stop=tool_call_end(tokenizer))  # fmt: skip


def tool_call_end(tokenizer) -> int | None:
    """The hermes `</tool_call>` token where the tokenizer has it as one token (Qwen2.5's): a turn also ends there, so
    the tools run as soon as a call is written. A model whose tokenizer spells it in several tokens ends its turn at
    its end token instead (the calls are parsed either way)."""
    ids = tokenizer.encode("</tool_call>", add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
