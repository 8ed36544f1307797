"""One tiny PPO iteration end to end with packed rows and token-budget micro-batches (rl_config.use_remove_padding,
use_dynamic_bsz): no padding is computed (perf/padding_ratio 0, actor and critic), and the iteration is the padded
run's (rl_helpers.layout_run "tp1", shared with test_ppo_e2e)."""

from __future__ import annotations

import math

import pytest

from tests.trainer.rl_helpers import _config, _train, layout_overrides, layout_run

pytestmark = pytest.mark.slow  # starts Ray and worker processes that import vLLM and megatron


def test_packed_ppo_iteration_computes_no_padding(assets, tmp_path_factory, tmp_path):
    cfg = _config("ppo_tiny_cpu", assets, tmp_path, *layout_overrides("tp1"), "rl_config.use_remove_padding=true",
                  "rl_config.use_dynamic_bsz=true", "rl_config.max_packing_token_size=160",
                  "rl_config.update_max_packing_token_size=120")  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    packed = lines[0]
    for prefix in ("perf/", "perf/critic_"):
        assert packed[f"{prefix}padding_ratio"] == 0.0
        assert packed[f"{prefix}computed_tokens"] == packed[f"{prefix}real_tokens"] > 0
        assert packed[f"{prefix}shared_prompt_tokens"] == 0
    padded = layout_run(assets, tmp_path_factory, "tp1")
    assert padded.lines[0]["perf/padding_ratio"] > 0
    print("padding ratio, actor / critic: padded", padded.lines[0]["perf/padding_ratio"],
          padded.lines[0]["perf/critic_padding_ratio"], "packed", packed["perf/padding_ratio"],
          packed["perf/critic_padding_ratio"])  # fmt: skip
    # The same samples (same seed), and the same update within the layouts' own bound (test_ppo_e2e)
    assert [r["response"] for r in rollouts] == [r["response"] for r in padded.rollouts]
    base = padded.lines[0]
    for key in ("critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/entropy"):
        assert math.isclose(packed[key], base[key], rel_tol=1e-5, abs_tol=1e-7), (key, packed[key], base[key])
    assert math.isclose(packed["actor/pg_loss"], base["actor/pg_loss"], abs_tol=1e-6)
