"""VllmEngine inside a 4-rank gloo world via external_launcher: infer TP2 (2 DP replicas) and TP1."""

from __future__ import annotations

import pytest

from mindrl.rollout import SamplingConfig
from tests.rollout import helpers, rank_fns
from tests.rollout.helpers import PROMPTS

pytestmark = pytest.mark.slow  # ~100 s: 4 ranks import vLLM and build a TP2 and a TP1 engine each

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
    """vLLM-CPU's TP shm segments carry a per-engine name (no clash with other engines on the host) and are
    gone after shutdown."""
    idents = {r["results"][2]["shm"][0] for r in world_runs}
    assert len(idents) == 1  # one name shared by the whole world for this engine
    ident, during, after = world_runs[0]["results"][2]["shm"]
    assert during and all(ident in name for name in during)
    assert all(r["results"][2]["shm"][2] == [] and r["results"][1]["shm"][2] == [] for r in world_runs)
    assert world_runs[0]["results"][1]["shm"][0] != ident
