"""DAPO, Dr.GRPO and GSPO end to end on the tiny model: dynamic sampling's and the overlong buffer's metrics checked
against a direct computation on the same rollouts (rollouts.jsonl holds every sampled response, trained or dropped),
the prompt sampler's position in the checkpoint, and one short run each of Dr.GRPO and GSPO (the latter with
REINFORCE++ advantages: the third estimator end to end, beside group_norm and gae)."""

from __future__ import annotations

import math
import shutil

import pytest

from mindrl.checkpoint import mcore_ckpt
from mindrl.checkpoint.iterations import TrainerState
from tests.trainer.rl_helpers import _config, _train, assert_same_checkpoints
from tests.trainer.test_ppo_e2e import REQUIRED, _check_metrics

pytestmark = pytest.mark.slow  # each run starts Ray and worker processes that import vLLM and megatron

MAX_TOKENS, BUFFER, FACTOR = 16, 12, 0.5


def _penalty(length: int) -> float:
    """DAPO's overlong penalty written out (MindSpeed-RL's formula), independent of mindrl.algorithms."""
    exceed = min(length - (MAX_TOKENS - BUFFER), BUFFER)
    return min(-exceed / BUFFER * FACTOR, 0.0)


def _groups(rows: list[dict], n: int) -> list[list[dict]]:
    assert len(rows) % n == 0
    groups = [rows[i : i + n] for i in range(0, len(rows), n)]
    for g in groups:  # the n samples of one prompt, with one fate
        assert len({r["prompt"] for r in g}) == 1 and len({r["dynamic_sampling"] for r in g}) == 1
    return groups


_RUN: dict = {}


def _length_reward(assets, plus: str = "") -> list[str]:
    """A reward that varies on the random tiny model, which never answers right: the overlong penalty, with responses
    stopping at the first digit token so that lengths vary from sample to sample. `plus`: "+" for a config that
    does not write the overlong keys."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets / "hf"))
    digits = sorted({tok.convert_tokens_to_ids(str(d)) for d in range(10)} - {tok.unk_token_id})
    return [
        f"{plus}rl_config.overlong_buffer_enable=true", f"{plus}rl_config.rollout_max_tokens={MAX_TOKENS}",
        f"{plus}rl_config.overlong_buffer={BUFFER}", f"{plus}rl_config.overlong_buffer_penalty_factor={FACTOR}",
        f"generate_config.sampling_config.max_tokens={MAX_TOKENS}",
        f"+generate_config.sampling_config.stop_token_ids={digits}", "rl_config.use_tensorboard=false",
    ]  # fmt: skip


def _dapo_overrides(assets) -> list[str]:
    """The filter compares the whole reward (`_length_reward`'s penalty)."""
    return [
        "rl_config.filter_groups_metric=seq_reward", "rl_config.filter_groups_train_batch_size=4",
        "rl_config.mini_batch_size=2", "rl_config.filter_groups_max_batches=8", "megatron_training.save_interval=1",
        *_length_reward(assets),
    ]  # fmt: skip


def _dapo_run(assets, tmp_path_factory):  # assets: the tiny Qwen3 (dapo_tiny_cpu's model)
    """dapo_tiny_cpu for 2 iterations, saved after each (shared by the tests below)."""
    if not _RUN:
        run_dir = tmp_path_factory.mktemp("dapo")
        cfg = _config("dapo_tiny_cpu", assets, run_dir, "megatron_training.train_iters=2", *_dapo_overrides(assets))
        _, results, lines, rollouts = _train(cfg)
        _RUN.update(cfg=cfg, lines=lines, rollouts=rollouts, run_dir=run_dir)
    return _RUN


def test_dapo_dynamic_sampling_and_overlong_metrics(qwen3_assets, tmp_path_factory):
    assets = qwen3_assets
    run = _dapo_run(assets, tmp_path_factory)
    cfg, lines, rollouts, tmp_path = run["cfg"], run["lines"], run["rollouts"], run["run_dir"]
    rl = cfg.rl_config
    assert not rl.needs_reference and rl.train_batch_size == 4 and rl.num_mini_batches == 2
    n, gbs = rl.n_samples_per_prompt, cfg.megatron_training.global_batch_size
    consumed = 0
    filtered_seen = 0
    for m in lines:
        rows = [r for r in rollouts if r["iteration"] == m["iteration"]]
        groups = _groups(rows, n)
        fate = [g[0]["dynamic_sampling"] for g in groups]
        assert fate[: rl.train_batch_size] == ["trained"] * rl.train_batch_size
        # the filter: a group is dropped exactly when its samples' rewards (rule reward + penalty) are all equal
        for g in groups:
            metric = [r["reward"] + _penalty(r["response_length"]) for r in g]
            assert (max(metric) == min(metric)) == (g[0]["dynamic_sampling"] == "filtered"), g
        assert m["train/generated_groups"] == len(groups) == m["train/num_gen_batches"] * gbs
        assert m["train/filtered_groups"] == fate.count("filtered")
        assert m["train/surplus_groups"] == fate.count("surplus")
        assert math.isclose(m["train/filtered_groups_ratio"], fate.count("filtered") / len(groups))
        every = [r["reward"] + _penalty(r["response_length"]) for r in rows]
        assert abs(m["train/generated_reward_mean"] - sum(every) / len(every)) <= 1e-6
        # the overlong metrics and the shaped score of the trained responses
        trained = [r for r in rows if r["dynamic_sampling"] == "trained"]
        penalties = [_penalty(r["response_length"]) for r in trained]
        assert abs(m["reward/overlong_penalty"] - sum(penalties) / len(penalties)) <= 1e-6
        assert abs(m["reward/overlong_ratio"] - sum(p < 0 for p in penalties) / len(penalties)) <= 1e-6
        shaped = [r["reward"] + p for r, p in zip(trained, penalties)]
        assert abs(m["critic/score/mean"] - sum(shaped) / len(shaped)) <= 1e-6
        assert m["actor/skipped_updates"] == 0 and "actor/kl_loss" in m and m["actor/kl_loss"] == 0
        consumed += int(m["train/num_gen_batches"]) * gbs
        filtered_seen += fate.count("filtered")
        # the checkpoint of this iteration holds the sampler's position after every generation batch it drew
        it_dir = mcore_ckpt.iteration_dir(str(tmp_path / "ckpt_actor"), m["iteration"])
        assert TrainerState.read(it_dir).loader["sampler"]["consumed_samples"] == consumed
    assert filtered_seen > 0  # the run did filter (else this test checks nothing)
    assert any(p < 0 for r in rollouts for p in [_penalty(r["response_length"])])


def test_dapo_resume_draws_the_same_prompts(qwen3_assets, tmp_path_factory, tmp_path):
    """Stopped after iteration 1 and resumed, iteration 2 samples the same prompts and responses as the straight run
    (the prompt sampler's position covers every generation batch), with the same metrics and final weights."""
    from mindrl.checkpoint import mcore_ckpt

    assets = qwen3_assets
    run = _dapo_run(assets, tmp_path_factory)
    split = tmp_path / "split"
    shutil.copytree(run["run_dir"], split)
    shutil.rmtree(split / "ckpt_actor" / "iter_0000002")
    mcore_ckpt.write_tracker(str(split / "ckpt_actor"), 1)
    resume = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]
    cfg = _config("dapo_tiny_cpu", assets, split, "megatron_training.train_iters=2", *_dapo_overrides(assets), *resume,
                  actor_load=split / "ckpt_actor")  # fmt: skip
    _, results, lines, rollouts = _train(cfg)
    assert [r.iteration for r in results] == [2]
    straight = [r for r in run["rollouts"] if r["iteration"] == 2]
    resumed = [r for r in rollouts if r["iteration"] == 2]
    assert [(r["prompt"], r["response"], r["dynamic_sampling"]) for r in resumed] == [
        (r["prompt"], r["response"], r["dynamic_sampling"]) for r in straight
    ]
    a, b = run["lines"][1], lines[1]
    for k in a:
        if not k.startswith("timing/") and not k.endswith("_tps"):
            assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-6), (k, a[k], b[k])
    assert_same_checkpoints(run["run_dir"] / "ckpt_actor", split / "ckpt_actor", tmp_path)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("dr_grpo", ["+rl_config.norm_adv_by_std_in_grpo=false", "rl_config.loss_agg_mode=seq-mean-token-sum-norm",
                     "rl_config.init_kl_coef=0"]),
        ("gspo", ["+rl_config.policy_loss_mode=gspo", "+rl_config.clip_ratio_low=3e-4",
                  "+rl_config.clip_ratio_high=4e-4", "rl_config.mini_batch_size=4", "rl_config.epochs=2",
                  "+rl_config.shuffle_mini_batch=true", "rl_config.adv_estimator=reinforce_plus_plus"]),
    ],
)  # fmt: skip
def test_grpo_family_runs(assets, tmp_path, name, overrides):
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=1",
                  *_length_reward(assets, plus="+"), *overrides)  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    (m,) = lines
    assert m["actor/skipped_updates"] == 0 and math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    if name == "dr_grpo":
        # advantages are score minus group mean: bounded by the largest score gap of a group
        assert not cfg.rl_config.needs_reference and "timing/reference_model" not in m
        assert abs(m["critic/advantages/max"]) <= m["critic/score/max"] - m["critic/score/min"] + 1e-6
    else:
        # off-policy steps see a ratio away from 1, and the clip at 3e-4 of the sequence ratio is active somewhere
        assert m["actor/ppo_kl"] != 0 and 0 < m["actor/pg_clipfrac"] <= 1
        # reinforce_plus_plus (no prompt groups, discounted returns) holds the metrics contract; every estimator's
        # wiring into the batch is test_loop_pieces', without workers
        assert cfg.rl_config.adv_estimator == "reinforce_plus_plus"
        _check_metrics(lines, cfg, REQUIRED)
