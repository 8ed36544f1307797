"""A PPO run whose actor, reference and critic load legacy megatron checkpoints (MindSpeed-LLM / MindSpeed-RL
mp_rank_XX files) does exactly what the same run from mindrl's own checkpoints does."""

from __future__ import annotations

import math
import os
import shutil

import pytest

from tests.checkpoint.test_legacy import ITERATION, save_legacy_rank
from tests.trainer.rl_helpers import _config, _train, layout_overrides, layout_run


def _legacy_copy(pool, mindrl_dir: str, root: str) -> str:
    """mindrl_dir re-saved as a legacy TP2 checkpoint, with the HF files the run reads its architecture from."""
    assert len([p for p in pool.run(save_legacy_rank, mindrl_dir, root, 2, 1) if p]) == 2
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    shutil.copytree(os.path.join(mindrl_dir, "hf_files"), os.path.join(root, "hf_files"))
    return root


@pytest.mark.slow
def test_ppo_from_legacy_checkpoints_matches(assets, pool, tmp_path, tmp_path_factory):
    """The mindrl side is the shared one-iteration PPO run at the shipped layout (rl_helpers.layout_run "tp2", also
    test_ppo_e2e's); the legacy side runs the same configuration from the legacy copies."""
    actor = _legacy_copy(pool, str(assets / "actor"), str(tmp_path / "legacy_actor"))
    critic = _legacy_copy(pool, str(assets / "critic"), str(tmp_path / "legacy_critic"))
    base_run = layout_run(assets, tmp_path_factory, "tp2")
    overrides = [*layout_overrides("tp2"), f"rl_config.integrated_mode_config.ref_model_load_path={actor}"]
    cfg = _config("ppo_tiny_cpu", assets, tmp_path / "legacy", *overrides, actor_load=actor, critic_load=critic)
    _, _, lines, legacy_rollouts = _train(cfg)
    (base, base_rollouts), legacy_line = (base_run.lines[0], base_run.rollouts), lines[0]
    assert [r["response"] for r in legacy_rollouts] == [r["response"] for r in base_rollouts]
    assert [r["reward"] for r in legacy_rollouts] == [r["reward"] for r in base_rollouts]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/entropy"):
        assert math.isclose(legacy_line[key], base[key], rel_tol=1e-6, abs_tol=1e-9), (key, legacy_line[key], base[key])
