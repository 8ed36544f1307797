"""Fixtures of the trainer tests (the tiny RL assets are built once per session)."""

from tests.trainer.rl_helpers import assets, dsv3_assets, moe_assets, qwen3_assets, sft_assets  # noqa: F401
