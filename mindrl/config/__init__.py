"""Typed configs for MindSpeed-RL's YAML schema, loaded through hydra and validated once, before any worker starts:
`load_config("ppo_tiny_cpu", overrides=["rl_config.epochs=2"])`."""

from mindrl.config.errors import ConfigError, Issue
from mindrl.config.generate import GenerateConfig, SamplingSection
from mindrl.config.loader import default_config_dir, load_config
from mindrl.config.megatron import MegatronTrainingConfig, RoleConfig
from mindrl.config.model import ModelArchConfig
from mindrl.config.rl import IntegratedModeConfig, ResourceConfig, RLSectionConfig
from mindrl.config.root import RLConfig

__all__ = [
    "ConfigError",
    "GenerateConfig",
    "IntegratedModeConfig",
    "Issue",
    "MegatronTrainingConfig",
    "ModelArchConfig",
    "RLConfig",
    "RLSectionConfig",
    "ResourceConfig",
    "RoleConfig",
    "SamplingSection",
    "default_config_dir",
    "load_config",
]
