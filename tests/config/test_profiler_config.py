"""profiler_config (MindSpeed-RL's `profiler_config.integrated` block): its keys load with their defaults, what the
workers get from them, and every bad value is reported under its key."""

from __future__ import annotations

import json
import os

from mindrl.config import load_config
from mindrl.config.profiler import STAGES
from mindrl.workers.from_config import critic_settings, integrated_settings, profile_settings
from tests.config.conftest import TINY_HF, asset_overrides, write_configs
from tests.config.test_errors import CONFIGS, PPO, errors, issue

P = "profiler_config.integrated"

# MindSpeed-RL's documented block (docs/zh/features/profiler.md), as a user would bring it over.
MINDSPEED_BLOCK = """
profiler_config:
  integrated:
    profile: true
    mstx: false
    stage: [actor_update, critic_update]
    profile_save_path: ./profiler_data
    profile_export_type: text
    profile_step_start: 2
    profile_step_end: 4
    profile_level: level1
    profile_with_memory: false
    profile_record_shapes: true
    profile_with_cpu: true
    profile_with_npu: true
    profile_with_module: false
    profile_analysis: true
    profile_ranks: [0, 1]
"""


def _load(*overrides: str, config_path: str | None = None, name: str = "ppo_tiny_cpu"):
    return load_config(name, config_path=config_path, overrides=list(overrides))


def test_off_by_default():
    cfg = _load()
    p = cfg.profiler_config.integrated
    assert not p.profile and p.stage == "all" and p.stages == STAGES and p.ranks is None
    assert (p.profile_step_start, p.profile_step_end, p.profile_level) == (1, 2, "level0")
    assert profile_settings(cfg) is None
    assert "profiler_config" not in cfg.ignored_keys and "profiler_config" in cfg.to_dict()


def test_mindspeed_block_loads_and_reaches_the_workers(tmp_path, monkeypatch, assets):
    text = open(PPO).read() + MINDSPEED_BLOCK
    write_configs(tmp_path, {"cfg.yaml": text, "model/tiny_qwen2.yaml": open(os.path.join(CONFIGS, "model/tiny_qwen2.yaml")).read()})  # fmt: skip
    with open(os.path.join(assets["tokenizer"], "config.json"), "w") as f:  # the rollout engine's model dir
        json.dump(TINY_HF, f)
    monkeypatch.chdir(tmp_path)
    cfg = _load(*asset_overrides(assets), config_path=str(tmp_path), name="cfg")
    assert not [k for k in cfg.ignored_keys if k.startswith("profiler_config")]
    s = profile_settings(cfg)
    assert s is not None
    assert s.save_path == os.path.join(str(tmp_path), "profiler_data")  # relative: the driver's working directory
    assert (s.stages, s.start, s.end, s.ranks) == (("actor_update", "critic_update"), 2, 4, (0, 1))
    o = s.options
    assert (o.with_host, o.with_device, o.with_memory, o.record_shapes, o.with_stack) == (
        True,
        True,
        False,
        True,
        False,
    )
    assert (o.level, o.export_type, o.analyse) == ("level1", "text", True)
    assert integrated_settings(cfg).profile == s == critic_settings(cfg).profile  # one block for both worker kinds


def test_one_stage_and_overrides():
    cfg = _load(f"{P}.profile=true", f"{P}.stage=actor_generate", f"{P}.profile_step_start=3",
                f"{P}.profile_step_end=5", f"{P}.profile_ranks=[1]")  # fmt: skip
    s = profile_settings(cfg)
    assert (s.stages, s.start, s.end, s.ranks) == (("actor_generate",), 3, 5, (1,))


def test_bad_values_are_reported_under_their_keys():
    err = errors("ppo_tiny_cpu", f"{P}.profile=true", f"{P}.stage=[actor_update,actor_updat]",
                 f"{P}.profile_level=level3", f"{P}.profile_export_type=json", f"{P}.profile_step_start=0",
                 f"{P}.profile_ranks=some", f"{P}.profile_save_path=''")  # fmt: skip
    issue(err, f"{P}.stage", "['actor_updat'] are not stages", "actor_update")
    issue(err, f"{P}.profile_level", "'level3' is not one of level_none, level0, level1, level2")
    issue(err, f"{P}.profile_export_type", "'json' is not one of text, db")
    issue(err, f"{P}.profile_step_start", "must be >= 1")
    issue(err, f"{P}.profile_ranks", "expected all or a list of ranks")
    issue(err, f"{P}.profile_save_path", "must not be empty")


def test_more_bad_values():
    issue(errors("ppo_tiny_cpu", f"{P}.profile_step_start=3", f"{P}.profile_step_end=3"), f"{P}.profile_step_end",
          "must be > profile_step_start=3")  # fmt: skip
    issue(errors("ppo_tiny_cpu", f"{P}.stage=update"), f"{P}.stage", "'update' is not a stage")
    issue(errors("ppo_tiny_cpu", f"{P}.stage=[]"), f"{P}.stage", "is empty")
    issue(errors("ppo_tiny_cpu", f"{P}.profile_ranks=[-1]"), f"{P}.profile_ranks", "ranks >= 0")
    issue(errors("ppo_tiny_cpu", f"{P}.profile=true", f"{P}.profile_with_cpu=false", f"{P}.profile_with_npu=false"),
          f"{P}.profile_with_cpu", "nothing to record")  # fmt: skip
    issue(errors("ppo_tiny_cpu", f"{P}.profile=yes"), f"{P}.profile", "expected true or false")
    issue(errors("ppo_tiny_cpu", f"{P}.profil=true"), f"{P}.profil", "did you mean 'profile'")
    issue(errors("ppo_tiny_cpu", "profiler_config.actor.profile=true"), "profiler_config.actor", "unknown key")
