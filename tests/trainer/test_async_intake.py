"""The bounded trainer's intake over ZeroMQ on loopback, with two sampler threads: batches are never more than
max_staleness versions old, stale groups are refused and their prompts re-issued, a sampler that stops with a prompt
in flight has it re-issued, and every prompt is trained exactly once; the batch built from the groups."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from mindrl.data.prompt_ledger import PromptLedger
from mindrl.launch import free_port
from mindrl.serving.experience import Experience
from mindrl.serving.transport import ZmqSamplerEnd, ZmqTrainerEnd
from mindrl.trainer.pipeline.intake import GEN_SECONDS, Intake, make_batch, sampler_tps

N = 2


def group(lease, sampler_id, version, ref=False):
    return [
        Experience([5, lease.prompt_index + 1], np.arange(3 + k) + 7, -np.full(3 + k, 0.25 * (k + 1)), {},
                   "stop", lease.prompt_index, lease.epoch, sampler_id, version,
                   ref_logprobs=-np.full(3 + k, 0.5) if ref else None, meta={GEN_SECONDS: 0.5})
        for k in range(N)
    ]  # fmt: skip


def fast_sampler(ports, stop):
    """Leases one prompt at a time, always with the newest weights."""
    end = ZmqSamplerEnd("fast", "127.0.0.1", *ports)
    have = None
    try:
        while not stop.is_set():
            update = end.fetch_weights(have, timeout_s=10)
            if update is not None:
                have = update.version
            leases = end.lease(1, timeout_s=10) if have is not None else []
            if not leases:
                time.sleep(0.02)
                continue
            end.send(group(leases[0], "fast", have), timeout_s=10)
    finally:
        end.close()


def lagging_sampler(ports, go, held):
    """Leases two prompts with version 0, delivers the first only once the trainer is at version 2 (stale), and
    stops with the second in flight."""
    end = ZmqSamplerEnd("lag", "127.0.0.1", *ports)
    try:
        first, second = end.lease(2, timeout_s=10)
        held.extend([first, second])
        go.wait(30)
        end.send(group(first, "lag", 0), timeout_s=10)
    finally:
        end.close()


def test_bounded_intake_two_samplers_one_lagging_and_stopped():
    ports = (free_port(), free_port())
    ledger = PromptLedger(12, seed=3, num_epochs=1)
    trainer = ZmqTrainerEnd(ledger, "127.0.0.1", *ports, hwm=4)
    intake = Intake(trainer, groups=3, max_staleness=1, timeout_s=60, poll_s=0.2)
    stop, go, held = threading.Event(), threading.Event(), []
    lag = threading.Thread(target=lagging_sampler, args=(ports, go, held), daemon=True)
    lag.start()
    while len(held) < 2:  # the lagging sampler holds its prompts before the fast one starts
        time.sleep(0.01)
    trainer.publish_weights(0, {"w": torch.zeros(2)})
    fast = threading.Thread(target=fast_sampler, args=(ports, stop), daemon=True)
    fast.start()
    trained, stale_dropped, samplers = [], 0, set()
    try:
        for version in range(4):
            groups, metrics = intake.take(version)
            assert len(groups) == 3 and metrics["async/staleness/max"] <= 1
            assert 0 <= metrics["async/staleness/mean"] <= metrics["async/staleness/max"]
            assert metrics["async/trainer_idle_s"] >= 0 and metrics["async/sampler_tps/fast"] > 0
            stale_dropped += metrics["async/dropped_stale"]
            trained += [(g[0].epoch, g[0].prompt_index) for g in groups]
            samplers.update(g[0].sampler_id for g in groups)
            trainer.publish_weights(version + 1, {"w": torch.full((2,), float(version + 1))})
            if version + 1 == 2:
                go.set()  # the lagging sampler delivers its version-0 group now: two versions old
                lag.join(30)
                trainer.sampler_dead("lag")  # its second prompt is re-issued
    finally:
        stop.set()
        fast.join(30)
        trainer.close()
    assert sorted(trained) == [(0, i) for i in range(12)]  # none lost, none twice
    assert stale_dropped >= N and trainer.stats.dropped_stale == stale_dropped  # at least the lagging group
    assert ledger.reissued >= 2 and ledger.epochs_closed == 1
    assert {(x.epoch, x.prompt_index) for x in held} <= set(trained) and "lag" not in samplers  # from the fast one


def test_a_group_with_rewards_stops_the_intake():
    """The trainer scores every response with its own verifiers: a sampler that scores too (its verifiers may not be
    the trainer's) is an error naming it, not scores silently recomputed."""
    ports = (free_port(), free_port())
    trainer = ZmqTrainerEnd(PromptLedger(4, seed=0), "127.0.0.1", *ports)
    sampler = ZmqSamplerEnd("scoring", "127.0.0.1", *ports)
    try:
        trainer.publish_weights(0, {"w": torch.zeros(2)})
        (lease,) = sampler.lease(1, timeout_s=10)
        scored = group(lease, "scoring", 0)
        scored[1].rewards = {"acc": 1.0}
        sampler.send(scored, timeout_s=10)
        with pytest.raises(ValueError, match=r"sampler 'scoring' sent rewards for verifiers \['acc'\]") as e:
            Intake(trainer, groups=1, max_staleness=0, timeout_s=30, poll_s=0.2).take(0)
        assert "rl_config.verifier_function" in str(e.value)
    finally:
        sampler.close()
        trainer.close()


def test_give_back_re_issues_first_and_only_once():
    ledger = PromptLedger(4, seed=0, shuffle=False)
    a = ledger.issue("a", 2)
    assert ledger.give_back("a", a[1].prompt_index, a[1].epoch)
    assert not ledger.give_back("a", a[1].prompt_index, a[1].epoch)  # already queued
    assert ledger.issue("b", 1) == [a[1]]
    assert ledger.complete("b", a[1].prompt_index, a[1].epoch)
    assert not ledger.give_back("b", a[1].prompt_index, a[1].epoch)  # done
    assert not ledger.give_back("a", 3, 0)  # never issued


def test_batch_from_groups():
    from mindrl.data.prompt_ledger import Lease

    groups = [group(Lease(4, 0), "s", 3, ref=True), group(Lease(1, 0), "s", 2, ref=True)]
    batch = make_batch(groups, N, pad_token_id=0)
    assert batch.rows_meta["weight_version"] == [3, 3, 2, 2] and batch.rows_meta["prompt_index"] == [4, 4, 1, 1]
    mask = batch["response_mask"]
    assert mask.sum(-1).tolist() == [3, 4, 3, 4]
    assert batch["rollout_log_prob"][1, :4].tolist() == [-0.5] * 4 and batch["rollout_log_prob"][0, 3] == 0
    assert (batch["ref_log_prob"] == -0.5 * mask).all()
    assert batch["responses"][1, :4].tolist() == [7, 8, 9, 10]
    assert sampler_tps(groups) == {"async/sampler_tps/s": pytest.approx(14 / 1.0)}


def test_dynamic_sampling_over_bounded_samplers():
    """The filter composes with the bounded schedule: it takes the samplers' batches (real ZeroMQ transport, intake
    and ledger) until the train batch holds enough groups whose samples disagree, keeps their rows' prompt index,
    epoch and weight version, and reports the intake's metrics over every batch it took. Prompts with an odd index
    score [1, 0], the others [1, 1] (filtered)."""
    from types import SimpleNamespace as NS

    from mindrl.data.prompt_dataset import PromptBatch
    from mindrl.trainer.model_rewards import Rewards
    from mindrl.trainer.pipeline import Pipeline
    from mindrl.trainer.pipeline.bounded import Bounded
    from mindrl.trainer.pipeline.filter import DynamicSampling
    from mindrl.workers.results import Scores

    class Rows:  # the dataset rows the samplers' prompts come from: prompt [5, i + 1], label [i]
        def batch(self, rows):
            return PromptBatch([torch.tensor([5, i + 1]) for i in rows], torch.tensor(rows),
                               {"labels": [torch.tensor([i]) for i in rows]})  # fmt: skip

    class Verifier:
        def score(self, responses, labels):
            return labels

        def collect(self, labels, iteration):
            rewards = [0.0 if lab[0] % 2 and r % N else 1.0 for r, lab in enumerate(labels)]
            return Scores(rewards, [[x] for x in rewards], ["r"] * len(labels), ["l"] * len(labels), {})

    ports = (free_port(), free_port())
    ledger = PromptLedger(12, seed=3, num_epochs=1)
    end = ZmqTrainerEnd(ledger, "127.0.0.1", *ports, hwm=4)
    rl = NS(train_batch_size=3, filter_groups_max_batches=0, filter_groups_metric="acc", overlong_buffer_enable=False)
    bounded = Bounded(end, Intake(end, groups=2, max_staleness=1, timeout_s=60, poll_s=0.2), 1, Rows(), N,
                      export=lambda: {"w": torch.zeros(2)})  # fmt: skip
    keep = DynamicSampling(rl, N, ["acc"], Rewards(Verifier(), None, None, rl),
                           NS(pad_token_id=0, batch_decode=lambda ids, **kw: ["p"] * len(ids)), lambda *a: None)  # fmt: skip
    pipe = Pipeline(bounded, N, 0, keep)
    stop = threading.Event()
    fast = threading.Thread(target=fast_sampler, args=(ports, stop), daemon=True)
    try:
        pipe.after_update(0, {})  # the samplers start from version 0
        fast.start()
        got = pipe.next(1, {})
    finally:
        stop.set()
        fast.join(30)
        end.close()
    meta = got.batch.rows_meta
    assert len(got.batch) == 3 * N and all(i % 2 for i in meta["prompt_index"])
    assert meta["weight_version"] == [0] * (3 * N) and meta["epoch"] == [0] * (3 * N)
    taken = got.metrics["train/num_gen_batches"]
    assert taken >= 2 and got.metrics["train/generated_groups"] == 2 * taken
    assert got.metrics["async/staleness/max"] == 0 and got.metrics["async/trainer_idle_s"] >= 0
    rows = got.log_rows([{"reward": r} for r in got.scored.rewards])
    assert [r["prompt_index"] for r in rows[: 3 * N]] == meta["prompt_index"]
    assert {r["dynamic_sampling"] for r in rows} <= {"trained", "filtered", "surplus"}
