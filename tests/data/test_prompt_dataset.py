"""Prompt dataset and sampler: length filter, batch contents, determinism, exact O(1) resume across epochs."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from mindrl.data.preprocess import preprocess
from mindrl.data.preprocess_config import PreprocessConfig
from mindrl.data.prompt_dataset import PromptDataLoader, PromptDataset, ResumableShuffleSampler
from mindrl.data.templates import get_template


@pytest.fixture(scope="module")
def prefix(deepscaler_json, tok_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("pd") / "data")
    cfg = PreprocessConfig(
        input=deepscaler_json,
        tokenizer_name_or_path=tok_dir,
        output_prefix=out,
        prompt_type="qwen_r1",
        map_keys={"prompt": "problem", "response": "answer"},
        dataset_additional_keys=["labels"],
    )
    preprocess(cfg, log=io.StringIO())
    return out


def test_dataset_filters_long_prompts_and_counts_them(prefix):
    full = PromptDataset(prefix)
    lengths = [len(full[i]["input_ids"]) for i in range(len(full))]
    limit = sorted(lengths)[len(lengths) // 2]
    ds = PromptDataset(prefix + "_packed_input_ids_document", max_prompt_length=limit)
    assert len(ds) == sum(n <= limit for n in lengths) and ds.num_dropped == sum(n > limit for n in lengths) > 0
    assert all(len(ds[i]["input_ids"]) <= limit for i in range(len(ds)))
    with pytest.raises(ValueError, match="longer than max_prompt_length=1"):
        PromptDataset(prefix, max_prompt_length=1)


def test_batches_hold_prompt_ids_and_labels(prefix, tokenizer, deepscaler_json):
    import json

    rows = [r for i, r in enumerate(json.load(open(deepscaler_json))) if i not in (5, 7, 9, 11)]
    ds = PromptDataset(prefix, max_prompt_length=10_000)
    batch = next(iter(PromptDataLoader(ds, batch_size=4, seed=3)))
    assert len(batch.prompts) == len(batch.extras["labels"]) == 4
    for doc, p, lab in zip(batch.indices.tolist(), batch.prompts, batch.extras["labels"]):
        assert tokenizer.decode(p) == get_template("qwen_r1").render_prompt(rows[doc]["problem"])
        assert tokenizer.decode(lab) == rows[doc]["answer"]
    ids, mask = batch.padded(pad_token_id=0)
    assert ids.shape == mask.shape == (4, int(batch.prompt_lengths.max()))
    assert torch.equal(mask.sum(1), batch.prompt_lengths) and (mask[:, -1] == 1).all()  # left padded


def test_missing_dataset_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="run mindrl-preprocess first"):
        PromptDataset(str(tmp_path / "nothing"))


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    a = _take(ResumableShuffleSampler(10, 3, seed=7), 9)
    assert a == _take(ResumableShuffleSampler(10, 3, seed=7), 9)
    assert a != _take(ResumableShuffleSampler(10, 3, seed=8), 9)
    epochs = [sorted(sum(a[i : i + 3], [])) for i in (0, 3, 6)]  # 3 batches of 3 per epoch, 1 sample dropped
    assert all(len(set(e)) == 9 for e in epochs)
    assert a[0:3] != a[3:6]  # a new order in epoch 1


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("consumed_batches", [0, 1, 3, 4, 7, 11])
def test_resume_at_consumed_samples_continues_the_original_order(consumed_batches, drop_last):
    # 10 samples, batch 3: epochs end after 3 (drop_last) or 4 batches, so these resume points cross epochs.
    original = ResumableShuffleSampler(10, 3, seed=5, drop_last=drop_last)
    stream = _take(original, 16)
    consumed = sum(len(b) for b in stream[:consumed_batches])
    resumed = ResumableShuffleSampler(10, 3, seed=5, drop_last=drop_last, consumed_samples=consumed)
    assert _take(resumed, 16 - consumed_batches) == stream[consumed_batches:]


def test_state_dict_round_trip_and_mismatch(prefix):
    ds = PromptDataset(prefix)
    loader = PromptDataLoader(ds, batch_size=8, seed=1)
    it = iter(loader)
    for _ in range(80):  # 596 // 8 = 74 batches per epoch: this crosses into epoch 1
        next(it)
    state = loader.state_dict()
    assert state["sampler"]["consumed_samples"] == 640 and loader.sampler.epoch == 1
    expected = [next(it).indices for _ in range(3)]
    fresh = PromptDataLoader(PromptDataset(prefix), batch_size=8, seed=1)
    fresh.load_state_dict(state)
    got = [b.indices for b in itertools.islice(iter(fresh), 3)]
    assert all(torch.equal(x, y) for x, y in zip(expected, got))
    with pytest.raises(ValueError, match="checkpoint has seed=1, this run has 2"):
        PromptDataLoader(ds, batch_size=8, seed=2).load_state_dict(state)


def test_resume_does_not_replay_skipped_batches(monkeypatch):
    s = ResumableShuffleSampler(1000, 10, seed=0, consumed_samples=10**12 + 30)
    calls = []
    real = s.epoch_order
    monkeypatch.setattr(s, "epoch_order", lambda e: calls.append(e) or real(e))
    batch = next(iter(s))
    assert calls == [10**9] and batch == real(10**9)[30:40].tolist()
