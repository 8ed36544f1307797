"""Train -> infer weight stream: bit-exact HF tensors on every rank at every train layout, bounded memory."""

from __future__ import annotations

import pytest
import torch

from mindrl.checkpoint import convert
from mindrl.checkpoint.hf_io import HFCheckpoint
from mindrl.models.hf_config import ModelSpec
from mindrl.models.weight_map import expected_hf_names
from tests.resharding import rank_fns

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


def assert_same_tensors(got: dict, want: dict, where: str) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want), f"{where}: names {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{where}: {k} {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}"
        )
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), f"{where}: {k} differs"


def peak_bound(s) -> int:
    """One gathered bucket (a parameter larger than the bucket gets its own) + one reassembled parameter
    + the previous item the consumer's for-loop still holds (a copy, at most one parameter)."""
    return max(s.bucket_bytes, s.largest_param_bytes) + 2 * s.largest_param_bytes


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory, get_pool):
    """untied / tied converted once at TP2 (the tests load them at every layout: dist-ckpt reshards)."""
    root = tmp_path_factory.mktemp("reshard_src")
    return {
        v: convert.hf2mcore(tiny_models[v], str(root / v), 2, 1, pool=get_pool()) and str(root / v)
        for v in ("untied", "tied")
    }


@pytest.mark.parametrize("variant", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_stream_is_bit_exact_on_every_rank(pool, tiny_models, saved, variant, tp, pp):
    spec = ModelSpec.from_hf_dir(tiny_models[variant])
    want = hf_tensors(tiny_models[variant])
    results = pool.run(rank_fns.stream_checkpoint, saved[variant], tp, pp, 0.05)
    for rank, res in enumerate(results):
        assert res["order"] == expected_hf_names(spec), f"rank {rank}: emitted order"
        assert ("lm_head.weight" in res["order"]) == (not spec.tie_word_embeddings)
        assert_same_tensors(res["tensors"], want, f"TP{tp}xPP{pp} rank {rank}")
        stats = res["stats"]
        assert stats.num_tensors == len(want) and stats.bytes_emitted == sum(t.nbytes for t in want.values())
        assert stats.peak_extra_bytes <= peak_bound(stats)


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 2)])
def test_gloo_and_shared_memory_transports_agree(pool, tiny_models, saved, tp, pp):
    """Same-host CPU ranks exchange buckets through shared memory; MINDRL_RESHARD_SHM=0 keeps gloo. Both
    are bit-exact, and shared memory leaves nothing in /dev/shm (the leak check) and stays in the bound."""
    want = hf_tensors(tiny_models["untied"])
    for shm, transport in ((True, "shm"), (False, "gloo")):
        for rank, res in enumerate(pool.run(rank_fns.stream_checkpoint, saved["untied"], tp, pp, 0.25, shm)):
            assert res["stats"].transport == transport, (rank, res["stats"].transport)
            assert_same_tensors(res["tensors"], want, f"TP{tp}xPP{pp} {transport} rank {rank}")
            assert res["stats"].peak_extra_bytes <= peak_bound(res["stats"])


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_stream_after_training_equals_mcore2hf_export(pool, tiny_models, saved, tmp_path, variant):
    """TP2xPP2 (tied embeddings split over stages): after K real optimizer steps the stream carries
    exactly the trained weights, i.e. it equals an mcore2hf export of the same model."""
    from mindrl.checkpoint import mcore_ckpt

    tp, pp, steps = 2, 2, 3
    root = str(tmp_path / "trained")
    it_dir = mcore_ckpt.iteration_dir(root, steps)
    results = pool.run(rank_fns.train_save_and_stream, saved[variant], tp, pp, steps, it_dir, 0.05)
    spec, _ = mcore_ckpt.read_model_meta(saved[variant])
    mcore_ckpt.write_model_meta(it_dir, spec, "actor", tp, pp, "float32")
    mcore_ckpt.write_tracker(root, steps)
    convert.mcore2hf(root, str(tmp_path / "hf"), pool=pool)
    want = hf_tensors(str(tmp_path / "hf"))
    before = hf_tensors(tiny_models[variant])
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results) and all(0 < x < 20 for x in losses), losses
    changed = [k for k in want if not torch.equal(want[k], before[k])]
    assert len(changed) == len(want), f"untrained tensors: {sorted(set(want) - set(changed))}"
    for rank, res in enumerate(results):
        assert_same_tensors(res["tensors"], want, f"trained TP{tp}xPP{pp} rank {rank}")


def test_peak_extra_memory_is_one_bucket_not_a_model_copy(pool, saved, tiny_models):
    """Live streamer buffers stay within one bucket + two parameters whatever the bucket size (not a
    model copy); a smaller bucket means more buckets and a lower peak."""
    model_bytes = sum(t.nbytes for t in hf_tensors(tiny_models["untied"]).values())
    peaks, counts = [], []
    for mb in (0.05, 0.25, 1.0, 64.0):
        stats = [r["stats"] for r in pool.run(rank_fns.stream_checkpoint, saved["untied"], 2, 2, mb)]
        for s in stats:
            assert s.peak_extra_bytes <= peak_bound(s), (mb, s.peak_extra_bytes, peak_bound(s))
            assert max(s.bucket_sizes) <= max(s.bucket_bytes, s.largest_param_bytes)
        peaks.append(max(s.peak_extra_bytes for s in stats))
        counts.append(stats[0].num_buckets)
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts
    # Below the largest parameter's size the peak is set by that parameter, so only the ends are ordered.
    assert peaks[0] < peaks[-1] and peaks[0] < model_bytes / 2, (peaks, model_bytes)


@pytest.mark.parametrize("tp,pp,variant", [(2, 2, "untied"), (2, 2, "tied"), (2, 1, "untied"), (1, 2, "tied")])
def test_a_model_within_one_bucket_is_streamed_as_views_of_one_shared_copy(pool, tiny_models, saved, tp, pp, variant):
    """Same-host CPU ranks, the whole model within one bucket: the owner stage's ranks write their shards into one
    HF-layout copy in shared memory and every rank emits views of it (layout "hf"). The views stay right after the
    pass ends; the next pass carries changed weights; the own-shard stream is each rank's chunk of the same copy."""
    want = hf_tensors(tiny_models[variant])
    model_bytes = sum(t.nbytes for t in want.values())
    plus_one = {k: v + 1.0 for k, v in want.items()}
    for rank, res in enumerate(pool.run(rank_fns.stream_views_twice, saved[variant], tp, pp, 64.0)):
        stats, where = res["stats"], f"TP{tp}xPP{pp} {variant} rank {rank}"
        assert (stats.transport, stats.layout, stats.num_buckets) == ("shm", "hf", 1), where
        assert list(res["first"]) == expected_hf_names(ModelSpec.from_hf_dir(tiny_models[variant])), where
        assert model_bytes <= stats.peak_extra_bytes <= model_bytes + 64 * stats.num_tensors, where
        assert_same_tensors(res["first"], want, where + " first pass")
        assert_same_tensors(res["second"], plus_one, where + " after the update")
        assert sorted(res["shards"]) == sorted(want), where
        for name, (shard, dim) in res["shards"].items():
            ref = plus_one[name] if dim is None else plus_one[name].chunk(tp, dim)[res["tp_rank"]]
            assert shard.shape == ref.shape and torch.equal(shard, ref), (where, name, dim)


@pytest.mark.parametrize("bucket_mb", [64.0, 0.25])
def test_a_full_dev_shm_falls_back_to_gloo_with_a_warning(pool, tiny_models, saved, bucket_mb):
    """Segments whose pages /dev/shm cannot reserve (a container's small tmpfs) would SIGBUS at the first write
    past its size: the streamer reserves them up front and, when that fails, says so and uses gloo, bit-exact."""
    want = hf_tensors(tiny_models["untied"])
    for rank, res in enumerate(pool.run(rank_fns.stream_with_full_shm, saved["untied"], 2, 2, bucket_mb)):
        assert (res["stats"].transport, res["stats"].layout) == ("gloo", "buckets"), rank
        assert_same_tensors(res["tensors"], want, f"full /dev/shm, bucket {bucket_mb} MiB, rank {rank}")
        # TP rank 0 creates the files of layout "hf"; every rank creates its own segment in the bucket layout
        if bucket_mb < 1 or rank % 2 == 0:
            assert any("/dev/shm cannot hold" in w and "gloo" in w for w in res["warnings"]), (rank, res["warnings"])


@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1)])
def test_own_shard_stream_for_same_infer_tp(pool, tiny_models, saved, tp, pp):
    """Stretch goal: infer TP == train TP, each rank gets its own shard without the TP all-gather."""
    want = hf_tensors(tiny_models["untied"])
    for rank, res in enumerate(pool.run(rank_fns.stream_own_shards, saved["untied"], tp, pp)):
        assert sorted(res["shards"]) == sorted(want)
        for name, (shard, dim) in res["shards"].items():
            ref = want[name] if dim is None else want[name].chunk(tp, dim)[res["tp_rank"]]
            assert shard.shape == ref.shape and torch.equal(shard, ref), (rank, name, dim)
        assert res["stats"].bytes_emitted < sum(t.nbytes for t in want.values())


def test_consumer_stopping_early_does_not_desynchronise_ranks(pool, tiny_models, saved):
    results = pool.run(rank_fns.stream_after_early_stop, saved["untied"], 2, 2)
    assert [r["taken"] for r in results] == [1, 6, 11, 16]
    want = hf_tensors(tiny_models["untied"])
    for rank, res in enumerate(results):
        assert_same_tensors(res["tensors"], want, f"second pass, rank {rank}")


def test_critic_is_not_streamed(pool, tiny_models):
    msg = pool.run(rank_fns.stream_critic_error, tiny_models["orm"])[0]
    assert "critic" in msg and "not streamed" in msg, msg
