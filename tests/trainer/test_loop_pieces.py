"""The driver's pieces that need no workers: the RL batch layout, the advantages of every estimator, DP sharding,
the abort rule for non-finite updates, and the cleanup of what a killed run recorded."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from types import SimpleNamespace as NS

import pytest
import torch

from mindrl.algorithms.advantages import get_advantage_estimator, list_advantage_estimators
from mindrl.batch import Batch, shard_rows
from mindrl.rollout.base import RolloutSample
from mindrl.trainer.experience import make_batch
from mindrl.trainer.leftovers import TEMP_RECORD, remove_leftovers
from mindrl.trainer.model_rewards import Rewards
from mindrl.trainer.pipeline import Pipeline
from mindrl.trainer.pipeline.engines import Engine
from mindrl.trainer.pipeline.episode import OneTurn
from mindrl.trainer.pipeline.filter import DynamicSampling
from mindrl.trainer.pipeline.schedule import Seeds, Sync
from mindrl.trainer.ppo_trainer import PPOTrainer, TrainingAborted
from mindrl.workers.results import Scores


def _bare_trainer(limit: int = 3, n: int = 2) -> PPOTrainer:
    t = PPOTrainer.__new__(PPOTrainer)  # no Ray: only the driver-side helpers are exercised
    t.cfg = NS(rl_config=NS(max_consecutive_skipped_updates=limit))
    t.skipped_in_a_row, t.iteration, t.n = 0, 0, n
    t.tokenizer = NS(pad_token_id=0)
    return t


def test_aborts_after_k_consecutive_skipped_iterations():
    t = _bare_trainer(limit=3)
    t._check_skipped({"actor/skipped_updates": 1.0})
    t._check_skipped({"critic/skipped_updates": 1.0})
    t._check_skipped({"actor/skipped_updates": 0.0, "critic/skipped_updates": 0.0})  # a clean one resets
    t._check_skipped({"actor/skipped_updates": 1.0})
    t._check_skipped({"actor/skipped_updates": 1.0})
    with pytest.raises(TrainingAborted, match="max_consecutive_skipped_updates=3"):
        t._check_skipped({"actor/skipped_updates": 1.0})


def test_zero_limit_never_aborts():
    t = _bare_trainer(limit=0)  # documented as "0: never abort"
    for _ in range(5):
        t._check_skipped({"actor/skipped_updates": 1.0})
    t._check_skipped({"actor/skipped_updates": 0.0})
    assert t.skipped_in_a_row == 0


def test_batch_layout_left_pads_prompts_and_right_pads_responses():
    samples = [
        [RolloutSample([5, 6], [-0.1, -0.2], "stop"), RolloutSample([7], [-0.3], "length")],
        [RolloutSample([8, 9, 10], [-0.4, -0.5, -0.6], "stop"), RolloutSample([], [], "length")],
    ]
    b = make_batch([[1, 2, 3], [4]], samples, n=2, pad_token_id=0)
    assert b.meta["prompt_length"] == 3
    assert b["input_ids"].tolist()[0] == [1, 2, 3, 5, 6, 0]
    assert b["input_ids"].tolist()[2] == [0, 0, 4, 8, 9, 10]
    assert b["attention_mask"].tolist()[2] == [0, 0, 1, 1, 1, 1]
    assert b["response_mask"].tolist() == [
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 1],
        [0, 0, 0],
    ]  # an empty response learns nothing
    assert torch.allclose(b["rollout_log_prob"][2], torch.tensor([-0.4, -0.5, -0.6]))
    assert b.rows_meta["uid"] == [0, 0, 1, 1]
    assert b.group_size == 2  # the n samples of a prompt are consecutive rows
    with pytest.raises(RuntimeError, match="prompt 1: the rollout returned 1 samples, expected 2"):
        make_batch([[1, 2, 3], [4]], [samples[0], samples[1][:1]], n=2, pad_token_id=0)


def test_dp_shards_hold_their_slice_of_every_mini_batch():
    shards = shard_rows(8, dp=2, num_mini_batches=2)
    assert shards == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # mini-batch k of each shard is that rank's part of global mini-batch k
    assert sorted(shards[0][:2] + shards[1][:2]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="do not split"):
        shard_rows(6, dp=2, num_mini_batches=2)


@pytest.mark.parametrize("name", list_advantage_estimators())
def test_advantages_apply_the_configured_estimator_to_the_batch(name):
    """Every registered estimator through the driver's wiring: the sequence scores on each response's last token, the
    prompt groups (the n samples of a prompt), gamma and lam, the critic's values for gae; and the metrics it logs.
    End to end, GRPO runs group_norm, PPO gae and test_ppo_e2e reinforce_plus_plus; the estimators' own math is
    test_advantages'."""
    t = _bare_trainer(n=2)
    t.cfg = NS(
        rl_config=NS(
            kl_in_reward=False,
            adv_estimator=name,
            gamma=0.9,
            lam=0.8,
            norm_adv_by_std_in_grpo=True,
            overlong_buffer_enable=False,
        )
    )
    t.needs_ref, t.verifier_names, t.kl_ctrl = False, ["acc_for_ppo"], None
    t.rewards = Rewards(None, None, None, t.cfg.rl_config)
    samples = [
        [RolloutSample([5, 6], [-0.1, -0.2], "stop"), RolloutSample([7], [-0.3], "length")],
        [RolloutSample([8, 9, 10], [-0.4, -0.5, -0.6], "stop"), RolloutSample([11, 12], [-0.7, -0.8], "stop")],
    ]
    b = make_batch([[1, 2, 3], [4]], samples, n=2, pad_token_id=0)
    values = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.4, 0.5, 0.6], [0.7, 0.8, 0.0]])
    if name == "gae":
        b["values"] = values
    metrics = {"reward/acc_for_ppo/mean": 0.75, "reward/errors": 1.0}
    scored = Scores([1.0, 0.0, 0.5, 0.25], [None] * 4, [""] * 4, [""] * 4, metrics)
    metrics = t._advantages(b, scored)

    mask = b["response_mask"]
    token_scores = torch.zeros(4, 3)
    token_scores[[0, 1, 2, 3], [1, 0, 2, 1]] = torch.tensor([1.0, 0.0, 0.5, 0.25])  # each response's last token
    assert torch.equal(b["token_level_scores"], token_scores) and torch.equal(b["token_level_rewards"], token_scores)
    estimator = get_advantage_estimator(name)
    if name == "gae":
        adv, ret = estimator(token_scores, values=values, response_mask=mask, gamma=0.9, lam=0.8)
    elif name == "reinforce_plus_plus":
        adv, ret = estimator(token_scores, mask, gamma=0.9)
    else:  # the group estimators: rows 0-1 are prompt 0's samples, rows 2-3 prompt 1's
        adv, ret = estimator(token_scores, mask, index=[0, 0, 1, 1])
    assert torch.equal(b["advantages"], adv) and torch.equal(b["returns"], ret)
    assert adv.abs().sum() > 0
    assert metrics["critic/advantages/mean"] == pytest.approx(adv[mask.bool()].mean().item(), abs=1e-6)
    assert metrics["reward/mean"] == pytest.approx(0.4375) and metrics["critic/score/mean"] == pytest.approx(0.4375)
    assert metrics["acc_for_ppo_rewards/mean"] == 0.75 and metrics["reward/errors"] == 1.0
    assert metrics["reward/crashes"] == 0.0
    assert ("critic/values/mean" in metrics) == (name == "gae")


def test_the_group_size_follows_the_rows_and_rows_meta_only_where_named():
    """`Batch.group_size` (the n samples of a prompt, consecutive) is kept by select, split and the DP shards that
    hold whole groups, shrinks to the runs of one group that a shard keeps, and is 1 where the rows are mixed; select
    ships per-row lists only when named."""
    b = Batch({"x": torch.arange(8)}, {"uid": [0, 0, 0, 0, 1, 1, 1, 1]}, group_size=4)
    assert b.select(["x"]).group_size == 4 and b.select(["x"]).rows_meta == {}
    assert b.select(["x"], rows_meta=["uid"]).rows_meta == b.rows_meta
    assert [s.group_size for s in b.split(2)] == [4, 4]
    assert [b.index(r).group_size for r in shard_rows(8, dp=2)] == [4, 4]
    assert [b.index(r).group_size for r in shard_rows(8, dp=2, num_mini_batches=2)] == [2, 2]
    assert b.index([0, 1, 2, 3, 4, 5]).group_size == 2 and b.index([3, 4]).group_size == 1
    assert Batch.concat(b.split(2)).group_size == 4
    with pytest.raises(ValueError, match="do not come in groups of 3"):
        Batch({"x": torch.arange(8)}, group_size=3)


def test_batch_rejects_ragged_rows():
    with pytest.raises(ValueError, match="same number of rows"):
        Batch({"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)})


def test_a_killed_runs_recorded_temp_folder_is_removed_and_nothing_else(tmp_path):
    """`remove_leftovers` removes the recorded reward-worker folder on this host only, and only a pymp-* folder
    given by an absolute path: a damaged or foreign record removes nothing, and the record goes either way."""
    run = tmp_path / "run"
    run.mkdir()
    mine, elsewhere, wrong_name = tmp_path / "pymp-abc", tmp_path / "pymp-def", tmp_path / "keep"
    for d in (mine, elsewhere, wrong_name):
        d.mkdir()
        (d / "listener").write_text("")
    host = socket.gethostname()
    entries = [
        {"host": host, "path": str(mine)},
        {"host": host + "-other", "path": str(elsewhere)},
        {"host": host, "path": str(wrong_name)},
        {"host": host, "path": os.path.relpath(elsewhere)},  # relative: not what a worker records
        "not an entry",
    ]
    (run / TEMP_RECORD).write_text(json.dumps(entries))
    remove_leftovers(str(run))
    assert not mine.exists() and elsewhere.is_dir() and wrong_name.is_dir()
    assert not (run / TEMP_RECORD).exists()
    for damaged in ("{not json", json.dumps({"host": host, "path": str(elsewhere)})):
        (run / TEMP_RECORD).write_text(damaged)
        remove_leftovers(str(run))
        assert elsewhere.is_dir() and not (run / TEMP_RECORD).exists()
    remove_leftovers(str(run))  # no record: nothing to do


# ------------------------------------------------------------------------------------------ dynamic sampling
class _FakeRollout:
    """Samples whose first token encodes the reward the fake verifier gives: prompt p's sample j scores
    rewards[p][j]."""

    def __init__(self, rewards: dict[int, list[float]]):
        self.rewards, self.calls = rewards, []

    def generate(self, prompt_ids, sampling, seeds):
        from mindrl.trainer.pipeline.engines import RolloutResult

        self.calls.append([p[0] for p in prompt_ids])
        out = [[RolloutSample([p[0], j + 1], [-0.1, -0.2], "stop") for j in range(2)] for p in prompt_ids]
        return RolloutResult(out, {"timing/rollout": 1.0})


class _FakeReward:
    def __init__(self, rollout: _FakeRollout):
        self.rollout = rollout

    def score(self, responses, labels):
        return responses

    def collect(self, responses, iteration):
        rewards = [self.rollout.rewards[r[0]][r[1] - 1] for r in responses]
        per = [[x] for x in rewards]
        metrics = {"reward/acc_for_ppo/mean": 0.0, "reward/timeouts": 0.0, "timing/rule_reward": 0.5}
        return Scores(rewards, per, [str(r) for r in responses], [""] * len(responses), metrics)


class _Sampling:
    """Dynamic sampling over the synchronous schedule, on a fake engine and fake verifiers: the pipeline's layers
    as the trainer builds them (`pipeline.build`)."""

    def __init__(self, rewards, train_batch: int, max_batches: int, first: int = 0):
        self.rl = NS(train_batch_size=train_batch, filter_groups_max_batches=max_batches,
                     filter_groups_metric="acc_for_ppo", overlong_buffer_enable=False)  # fmt: skip
        self.rollout = _FakeRollout(rewards)
        self.rewards = Rewards(_FakeReward(self.rollout), None, None, self.rl)
        self.phases: list[str] = []
        self.batches = _prompt_batches(first, 4)

    def next(self, iteration: int, timing: dict):
        def enter_phase(phase, timing):
            self.phases.append(phase)

        tokenizer = NS(pad_token_id=0, batch_decode=lambda ids, **kw: [str(x) for x in ids])
        keep = DynamicSampling(self.rl, 2, ["acc_for_ppo"], self.rewards, tokenizer, enter_phase)
        sync = Sync(self.batches, OneTurn(Engine(self.rollout, enter_phase, 1)), None, Seeds(1, 2))
        got = Pipeline(sync, 2, 0, keep).next(iteration, timing)
        return got.batch, got.labels, got.scored, got.metrics, got.untrained_rows


def _prompt_batches(first: int, size: int):
    from mindrl.data.prompt_dataset import PromptBatch

    k = first
    while True:
        ids = list(range(k, k + size))
        yield PromptBatch([torch.tensor([i, 100]) for i in ids], torch.tensor(ids), {})
        k += size


class _LoadingSource(_FakeRollout):
    """A rollout source that loads the weights on every call, or once per `awake` (as IntegratedRollout does)."""

    def __init__(self):
        super().__init__({})
        self.loads, self.held = 0, False

    @contextlib.contextmanager
    def awake(self, timing):
        self.loads, self.held = self.loads + 1, True
        timing["rollout/weight_loads"] = 1.0
        yield
        self.held = False
        timing["timing/reshard_to_train"] = 0.25

    def generate(self, prompt_ids, sampling, seeds):
        out = super().generate(prompt_ids, sampling, seeds)
        if not self.held:
            self.loads += 1
            out.timing["rollout/weight_loads"] = 1.0
        return out


def test_the_engines_calls_within_awake_share_one_weight_load_and_phase_entry():
    source, phases = _LoadingSource(), []
    engine = Engine(source, lambda phase, timing: phases.append(phase), 1)
    timing: dict[str, float] = {}
    prompts = [[1, 100], [2, 100]]
    engine.generate(prompts, None, [0, 1], timing)
    with engine.awake(timing):
        for _ in range(3):  # an agent loop's turns
            engine.generate(prompts, None, [0, 1], timing)
        with engine.awake(timing):  # nested: the outer one holds the weights
            engine.generate(prompts, None, [0, 1], timing)
    assert source.loads == 2 and timing["rollout/weight_loads"] == 2.0 and phases == ["rollout"] * 2
    assert timing["timing/rollout"] == 5.0 and timing["timing/reshard_to_train"] == 0.25


def test_dynamic_sampling_fills_the_train_batch_from_groups_that_disagree():
    """Prompts in batches of 4; the groups of prompts 1, 2, 5, 9, 10, 13 disagree. A train batch of 3 takes 2
    generation batches (prompts 0-7: 1, 2, 5 kept, 8 - 3 = 5 filtered, none surplus)."""
    mixed = {1, 2, 5, 9, 10, 13}
    rewards = {p: ([1.0, 0.0] if p in mixed else [1.0, 1.0] if p % 2 else [0.0, 0.0]) for p in range(100)}
    t = _Sampling(rewards, train_batch=3, max_batches=0)
    timing: dict[str, float] = {}
    batch, labels, scored, metrics, dropped = t.next(1, timing)
    assert t.rollout.calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [batch["responses"][2 * g, 0].item() for g in range(3)] == [1, 2, 5]
    assert scored.rewards == [1.0, 0.0] * 3 and len(labels) == 6
    assert metrics == {"train/num_gen_batches": 2.0, "train/generated_groups": 8.0, "train/filtered_groups": 5.0,
                       "train/filtered_groups_ratio": 5 / 8, "train/surplus_groups": 0.0,
                       "train/generated_reward_mean": 7 / 16}  # fmt: skip
    assert [r["dynamic_sampling"] for r in dropped] == ["filtered"] * 10
    assert timing["timing/rollout"] == 2.0 and timing["timing/rule_reward"] == 1.0
    assert scored.metrics["reward/acc_for_ppo/mean"] == 0.5
    # the next iteration continues with the prompts after the last generation batch: nothing is drawn twice
    _, _, _, metrics, dropped = t.next(2, {})
    assert t.rollout.calls[2:] == [[8, 9, 10, 11], [12, 13, 14, 15]] and metrics["train/filtered_groups"] == 5.0
    t.rollout.calls.clear()
    t2 = _Sampling(rewards, train_batch=1, max_batches=0)
    _, _, _, metrics, dropped = t2.next(1, {})
    assert metrics["train/surplus_groups"] == 1.0 and [r["dynamic_sampling"] for r in dropped][-2:] == ["surplus"] * 2


def test_dynamic_sampling_stops_after_filter_groups_max_batches():
    rewards = {p: [1.0, 1.0] for p in range(100)}
    t = _Sampling(rewards, train_batch=2, max_batches=3)
    with pytest.raises(TrainingAborted, match="kept 0 of the filter_groups_train_batch_size=2 prompts after "
                       "rl_config.filter_groups_max_batches=3 generation batches"):  # fmt: skip
        t.next(1, {})
    assert len(t.rollout.calls) == 3


class _FakeRewardModel:
    """Scores a prompt's sample j 0.5 * j for the prompts in `varied`, else 0 (the rule rewards tie everywhere)."""

    def __init__(self, varied: set[int]):
        self.varied, self.calls = varied, []

    def score_rows(self, prompts, responses):
        self.calls.append(len(responses))
        return [0.5 * (r[1] - 1) if p[0] in self.varied else 0.0 for p, r in zip(prompts, responses)], 0.25


def test_dynamic_sampling_filters_on_the_reward_with_the_reward_models_score():
    """With a reward model, seq_reward compares the mixed reward: groups whose rule rewards tie but whose reward-model
    scores differ are kept, and the Scores carry the raw scores (the scoring phase does not run the model again)."""
    from mindrl.rewards.model_scores import RewardModelMix

    t = _Sampling({p: [1.0, 1.0] for p in range(100)}, train_batch=2, max_batches=0)
    t.rl.filter_groups_metric = "seq_reward"
    t.rewards = Rewards(t.rewards.client, _FakeRewardModel({2, 5, 6}), RewardModelMix(weight=2.0), t.rl)
    timing: dict[str, float] = {}
    batch, _, scored, metrics, dropped = t.next(1, timing)
    assert t.rollout.calls == [[0, 1, 2, 3], [4, 5, 6, 7]] and t.rewards.scorer.calls == [8, 8]
    assert t.phases == ["rollout", "score"] * 2  # the reward model runs in its scoring phase
    assert [batch["responses"][2 * g, 0].item() for g in range(2)] == [2, 5]
    assert scored.model_scores == [0.0, 0.5, 0.0, 0.5] and scored.rewards == [1.0, 2.0, 1.0, 2.0]
    assert metrics["train/filtered_groups"] == 5 and metrics["train/surplus_groups"] == 1
    assert timing["timing/reward_model"] == 0.5
    assert [r["reward_model_score"] for r in dropped if r["dynamic_sampling"] == "surplus"] == [0.0, 0.5]


def test_the_rollout_gap_per_token_and_per_response():
    """The driver's gap metrics from recomputed old logprobs: per token over valid tokens, per response the |sum| of
    its differences (which cancel within a response), both as the worker computes them on-policy; and rollouts.jsonl
    rows carry the tokens and the rollout logprobs they were computed from."""
    from mindrl.trainer import experience
    from mindrl.workers.results import TokenCounts, UpdateResult

    samples = [[RolloutSample([5, 6], [-0.1, -0.2], "stop")], [RolloutSample([8, 9, 10], [-0.4, -0.5, -0.6], "stop")]]
    batch = make_batch([[1, 2], [3]], samples, 1, 0)
    # trainer - rollout: row 0: +0.1, -0.1 (they cancel); row 1: +0.3, 0, +0.2; padding carries garbage
    batch["old_log_prob"] = batch["rollout_log_prob"] + torch.tensor([[0.1, -0.1, 5.0], [0.3, 0.0, 0.2]])
    t = _bare_trainer(limit=3)
    t.cfg.rl_config.logprob_diff_warn = 10.0
    m = t._actor_metrics(batch, UpdateResult({}, TokenCounts(1.0, 1.0, 1.0, 0.0)))
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.7 / 5, abs=1e-6)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert m["rollout/seq_logprob_diff_mean"] == pytest.approx((0.0 + 0.5) / 2, abs=1e-6)
    assert m["rollout/seq_logprob_diff_max"] == pytest.approx(0.5, abs=1e-6)
    scored = Scores([1.0, 0.0], [[1.0], [0.0]], ["a", "b"], ["x", "y"], {})
    rows = experience.rollout_rows(batch, scored, NS(batch_decode=lambda ids, **kw: ["p"] * len(ids)), ["acc"])
    assert [r["response_ids"] for r in rows] == [[5, 6], [8, 9, 10]]
    assert [r["prompt_ids"] for r in rows] == [[1, 2], [3]]
    assert rows[1]["rollout_log_prob"] == pytest.approx([-0.4, -0.5, -0.6])


def test_the_loss_mask_keeps_observation_tokens_in_the_context_and_out_of_training():
    """An agent loop's response (`Response.loss_mask` 0 on a tool's observation): its tokens stay in the context
    (attention_mask; the reward model scores the response's last token), and are out of what trains or is counted:
    response_mask (the loss's mask), the rollout logprobs, the token-level scores, the advantages and their token
    counts, and the rollout-vs-trainer logprob gap."""
    from mindrl.trainer import experience
    from mindrl.trainer.experience import Response
    from mindrl.workers.reward_worker import scoring_batch

    agent = Response([5, 6, 7, 8], [-0.1, 0.0, 0.0, -0.4], "stop", [3, 3, 3, 3], loss_mask=[1, 0, 0, 1])
    plain = Response([9, 10], [-0.2, -0.3], "stop", [3, 3])
    b = make_batch([[1, 2]], [[agent, plain]], n=2, pad_token_id=0)
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert b.rows_meta["rollout_versions"] == [[3, 3, 3, 3], [3, 3]]
    assert torch.allclose(b["rollout_log_prob"][0], torch.tensor([-0.1, 0.0, 0.0, -0.4]))
    _, lengths = scoring_batch(b)
    assert lengths.tolist() == [4, 2]  # the reward model reads the value after the last response token
    rl = NS(kl_in_reward=False, adv_estimator="group_norm", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    experience.advantages(b, torch.tensor([1.0, 0.0]), None, rl, None)
    assert b["token_level_scores"].tolist()[0] == [0.0, 0.0, 0.0, 1.0]
    assert (b["advantages"][0, 1:3] == 0).all() and (b["advantages"][0, [0, 3]] != 0).all()
    scored = Scores([1.0, 0.0], [[1.0], [0.0]], ["a", "b"], ["x", "x"], {})
    metrics = experience.advantage_metrics(b, torch.tensor([1.0, 0.0]), scored, ["acc"])
    assert metrics["response_length/mean"] == 2.0  # the policy's own tokens: 2 and 2
    b["old_log_prob"] = b["rollout_log_prob"] + torch.tensor([[0.1, 9.0, 9.0, 0.1], [0.0, 0.0, 9.0, 9.0]])
    gap = experience.rollout_gap(b)
    assert gap.count == 4 and gap.max_abs == pytest.approx(0.1, abs=1e-6)
