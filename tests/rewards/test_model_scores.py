"""The reward model's scores into the reward: running moments against torch on the concatenation, clipping, weights."""

from __future__ import annotations

import pytest
import torch

from mindrl.rewards.model_scores import RewardModelMix, RunningMoments, mix_rewards, shaped_model_scores


def test_running_moments_equal_the_concatenation():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1).tolist() for n in (1, 5, 16, 2)]
    m = RunningMoments()
    seen: list[float] = []
    for b in batches:
        m.update(b)
        seen += b
        t = torch.tensor(seen, dtype=torch.float64)
        assert m.count == len(seen) and m.mean == pytest.approx(t.mean().item(), abs=1e-12)
        assert m.std == pytest.approx(t.std(unbiased=False).item(), abs=1e-12)
    again = RunningMoments()
    again.load_state_dict(m.state_dict())
    assert again == m


def test_shaped_scores_normalise_then_clip_then_weigh():
    scores = [0.0, 1.0, 2.0, 10.0]
    t = torch.tensor(scores, dtype=torch.float64)
    mix = RewardModelMix(weight=0.5, normalize=True, clip_range=(-1.0, 1.0))
    shaped = shaped_model_scores(scores, mix, RunningMoments())
    want = ((t - t.mean()) / t.std(unbiased=False)).clamp(-1, 1)
    assert shaped == pytest.approx(want.tolist(), abs=1e-12)
    assert mix_rewards([1.0, 0.0, 1.0, 0.0], shaped, mix) == pytest.approx(
        [r + 0.5 * s for r, s in zip([1.0, 0.0, 1.0, 0.0], want.tolist())], abs=1e-12
    )
    assert shaped_model_scores(scores, RewardModelMix(), RunningMoments()) == scores  # raw by default
    constant = shaped_model_scores([3.0, 3.0], RewardModelMix(normalize=True), RunningMoments())
    assert constant == [0.0, 0.0]  # no spread: centred, not divided by 0
    with pytest.raises(ValueError, match="2 rule rewards but 1 reward-model scores"):
        mix_rewards([0.0, 1.0], [0.0], mix)
    # update=False (the held-out evaluation): the statistics as they stand, left unchanged
    moments = RunningMoments()
    shaped_model_scores(scores, mix, moments)
    before = moments.state_dict()
    frozen = shaped_model_scores([5.0, -4.0], mix, moments, update=False)
    assert moments.state_dict() == before
    assert frozen == pytest.approx([min(max((x - t.mean().item()) / t.std(unbiased=False).item(), -1), 1)
                                    for x in (5.0, -4.0)], abs=1e-12)  # fmt: skip
