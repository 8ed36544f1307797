"""The one_step_off pipeline without workers: which weights sample each batch (staleness), which seeds, prompts in
order and each once, nothing generated past the last iteration, and its checkpoint state continuing exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from mindrl.checkpoint.iterations import TrainerState
from mindrl.data.prompt_dataset import PromptBatch
from mindrl.rollout.base import RolloutSample
from mindrl.trainer.pipeline import one_step_off as async_rollout
from mindrl.trainer.pipeline.one_step_off import OneStepOff

N = 2  # samples per prompt


def prompt_stream():
    """Batches of 2 prompts, each a distinct id; labels as the dataset's extras."""
    for b in itertools.count():
        ids = [2 * b, 2 * b + 1]
        yield PromptBatch(
            [torch.tensor([7, i]) for i in ids], torch.tensor(ids), {"labels": [torch.tensor([i]) for i in ids]}
        )


class FakeTrainer:
    """Weights = the number of updates; a sample records (weights, seed iteration, prompt) in its tokens."""

    def __init__(self):
        self.version = 0
        self.calls = []

    def generate(self, prompts, iteration, timing):
        self.calls.append(iteration)
        timing["timing/rollout"] = timing.get("timing/rollout", 0.0) + 0.5
        return [
            [RolloutSample([self.version, iteration, int(i), k], [-0.25 * (k + 1), -1e-9, -3.0, 0.0], "stop")
             for k in range(N)]
            for i in prompts.indices
        ]  # fmt: skip


def run(depth, iterations, last=None, state=None, start=1, stream=None):
    fake = FakeTrainer()
    fake.version = start - 1
    pipe = OneStepOff(depth, last or iterations)
    if state is not None:
        async_rollout.restore(pipe, state)
    stream = stream or prompt_stream()
    out = []
    for it in range(start, iterations + 1):
        got, metrics = pipe.take(stream, fake.generate, it, {})
        out.append((got, metrics))
        fake.version += 1  # the update
    return out, pipe, fake, stream


def test_one_step_off_trains_each_batch_one_version_after_it_was_sampled():
    out, pipe, fake, _ = run(1, 5)
    stale = [m["async/staleness/max"] for _, m in out]
    assert stale == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [m["async/queue_depth"] for _, m in out] == [1.0, 1.0, 1.0, 1.0, 0.0]
    for it, (got, m) in enumerate(out, start=1):
        assert got.iteration == it and got.version == max(0, it - 2)
        s = got.samples[0][0].token_ids
        assert s[:2] == [got.version, it]  # sampled with those weights, with the training iteration's seeds
        assert m["async/dropped_stale"] == 0.0 and m["async/trainer_idle_s"] >= 0.0
    assert fake.calls == [1, 2, 3, 4, 5]  # nothing for iteration 6
    prompts = [int(i) for got, _ in out for i in got.prompts.indices]
    assert prompts == list(range(10))  # in order, each once
    assert not pipe.pending


def test_max_staleness_0_is_the_synchronous_order():
    out, _, fake, _ = run(0, 4)
    for it, (got, m) in enumerate(out, start=1):
        assert got.version == it - 1 and m["async/staleness/max"] == 0.0 and m["async/queue_depth"] == 0.0
        assert got.samples[1][1].token_ids == [it - 1, it, 2 * it - 1, 1]
    assert fake.calls == [1, 2, 3, 4]


def test_checkpoint_state_continues_exactly(tmp_path):
    straight, _, _, _ = run(1, 6)
    first, pipe, _, stream = run(1, 3, last=6)
    meta, blob = pipe.state_dict()
    assert len(meta["batches"]) == 1 and blob is not None
    state = TrainerState(iteration=3, loader={}, kl_ctrl={}, **async_rollout.trainer_state(pipe))
    d = tmp_path / "it"
    d.mkdir()
    state.write(str(d))
    back = TrainerState.read(str(d))
    assert back.async_pending == blob and back.async_rollout == meta
    # the loader's state has drawn the pending batch's prompts: the stream continues after them
    rest, _, _, _ = run(1, 6, state=back, start=4, stream=stream)
    for (a, ma), (b, mb) in zip(straight, first + rest):
        assert (a.iteration, a.version, a.prompts.indices.tolist()) == (
            b.iteration,
            b.version,
            b.prompts.indices.tolist(),
        )
        assert a.prompts.extras["labels"][0].tolist() == b.prompts.extras["labels"][0].tolist()
        assert [[(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in a.samples] == [
            [(s.token_ids, s.logprobs, s.finish_reason) for s in g] for g in b.samples
        ]
        assert ma["async/staleness/max"] == mb["async/staleness/max"]


def test_restore_refuses_other_settings():
    _, pipe, _, _ = run(1, 2, last=5)
    state = TrainerState(iteration=2, loader={}, kl_ctrl={}, **async_rollout.trainer_state(pipe))
    with pytest.raises(ValueError, match="resume with async_mode one_step_off"):
        async_rollout.restore(None, state)
    with pytest.raises(ValueError, match="resume with the same async settings"):
        async_rollout.restore(OneStepOff(0, 5), state)
    async_rollout.restore(None, TrainerState(iteration=2, loader={}, kl_ctrl={}))  # a synchronous checkpoint


def test_an_agent_loops_observation_mask_survives_the_checkpoint(tmp_path):
    """A pending multi-turn batch: its observation tokens stay out of training after a resume."""
    from mindrl.trainer.experience import Response

    masks = [[1, 0, 0, 1], [0, 1, 1, 0]]

    def generate(prompts, iteration, timing):
        return [[Response([int(i), k, 5, 6], [-0.5, 0.0, 0.0, -1.0], "stop", [], masks[k]) for k in range(N)]
                for i in prompts.indices]  # fmt: skip

    pipe = OneStepOff(1, 4)
    stream = prompt_stream()
    pipe.take(stream, generate, 1, {})
    meta, blob = pipe.state_dict()
    assert meta["batches"][0]["observations"] == [[[1, 3]], [[0, 1], [3, 4]]] * 2
    back = OneStepOff(1, 4)
    back.load_state_dict(meta, blob)
    [pending] = back.pending
    assert [[s.loss_mask for s in g] for g in pending.samples] == [masks, masks]
    assert pending.samples[1][1].token_ids == [3, 1, 5, 6]
