"""The serial xdist groups ("lanes"): under `bash tests/run.sh` (2 pytest-xdist workers, --dist loadgroup) the tests
that start rank pools, Ray, servers or trainer runs run one after another within their lane, each lane on one worker;
the rest run beside them.

Two lanes, one per core: `SHARED` reads the session's shared runs (rl_helpers' straight, half, layout and
integrated-RM runs, and the quickstart's runs: quickstart_run, sft_assets, learning_run) and holds every serial module
not listed; `OWN` holds self-contained modules, which start all they use. Self-contained modules may go in either lane:
they are placed to balance the lanes' CPU seconds, measured with MINDRL_TEST_CPU (the suite is CPU-bound on 2 cores: a
third lane, tried, added contention and no speed). A shared run is built in its own lane only (`require_lane`): a test
reading it from another lane fails with the lane to put it in, rather than building the run a second time on its
worker."""

from __future__ import annotations

import os
import re

import pytest

# A test that requests one of these (directly or through another fixture) starts or uses the session's 4 gloo ranks
# or a trainer run's assets (built on those ranks).
SERIAL_FIXTURES = {"pool", "get_pool", "assets", "qwen3_assets", "sft_assets", "smollm2_hf"}

# Modules whose tests start processes of their own that use more than one core, or that look at the whole host.
SERIAL_MODULES = {
    "tests/agent/test_sandbox.py",  # looks for sandboxed processes host-wide: alone with the other sandbox user
    "tests/checkpoint/test_bad_input.py",  # a RankPool of its own
    "tests/checkpoint/test_legacy.py",  # replaces the shared pool
    "tests/models/test_qwen3.py",  # a RankPool of its own
    "tests/models/test_real_llama.py",  # RankPools of its own
    "tests/models/test_sdpa_attention.py",  # replaces the shared pool
    "tests/plan/test_plan_vs_megatron.py",  # shared_pool() in module fixtures
    "tests/platform/test_platform.py",  # RankPools of its own; counts its threads and process groups
    "tests/rollout/test_vllm_tp.py",  # a RankPool of its own
    "tests/serving/test_server.py",  # vLLM rollout servers (data-parallel engines)
    "tests/serving/test_transport_ray.py",  # Ray
    "tests/test_launchers.py",  # Ray clusters; checks that no Ray process is left on the host
    "tests/trainer/test_dpo.py",  # mindrl-train, shared_pool() in module fixtures
    "tests/trainer/test_evaluation.py",  # trainer runs (Ray)
    "tests/trainer/test_faults.py",  # trainer runs; checks the host's Ray processes and /dev/shm
    "tests/trainer/test_remote_rollout.py",  # rollout servers, trainer runs
    "tests/trainer/test_reward_model.py",  # mindrl-train, shared_pool() in module fixtures
    "tests/trainer/test_sft.py",  # replaces the shared pool
    "tests/workers/test_bf16_distopt.py",  # replaces the shared pool
    "tests/workers/test_collect.py",  # Ray
    "tests/workers/test_distopt_resume.py",  # replaces the shared pool
    "tests/workers/test_runtime_env.py",  # Ray
}

SHARED, OWN = "serial-shared", "serial-own"
LANES = (SHARED, OWN)
RUNS = QUICKSTART = SHARED  # the lane of rl_helpers' shared runs, and of the quickstart's

# Tests (a module, or module::function for all its parameters) placed in a lane; every other serial test is in SHARED.
LANE_OF = {
    # the readers of the quickstart's runs
    "tests/test_quickstart.py": QUICKSTART,
    "tests/test_rlhf_3stage.py": QUICKSTART,
    "tests/trainer/test_bf16_e2e.py": QUICKSTART,
    "tests/trainer/test_ppo_e2e.py::test_training_learns": QUICKSTART,
    "tests/trainer/test_lora_e2e.py": QUICKSTART,
    # self-contained modules
    "tests/agent/test_sandbox.py": OWN,  # beside test_agent_e2e's sandbox, never at the same time
    "tests/checkpoint/test_bad_input.py": OWN,
    "tests/checkpoint/test_convert.py": OWN,
    "tests/checkpoint/test_export_loads.py": OWN,
    "tests/checkpoint/test_legacy.py": OWN,
    "tests/models/test_qwen3.py": OWN,
    "tests/models/test_real_llama.py": OWN,
    "tests/plan/test_plan_vs_megatron.py": OWN,
    "tests/platform/test_platform.py": OWN,
    "tests/rollout/test_vllm_tp.py": OWN,
    "tests/serving/test_server.py": OWN,
    "tests/test_launchers.py": OWN,
    "tests/test_recipe_smollm2.py": OWN,
    "tests/test_rlhf_dpo_example.py": OWN,
    "tests/trainer/test_agent_e2e.py": OWN,
    "tests/trainer/test_async_bounded.py": OWN,
    "tests/trainer/test_bench_async.py": OWN,
    "tests/trainer/test_dapo_e2e.py": OWN,
    "tests/trainer/test_deepseek_v3_e2e.py": OWN,
    "tests/trainer/test_dpo.py": OWN,
    "tests/trainer/test_faults.py": OWN,
    "tests/trainer/test_partial_rollout_e2e.py": OWN,
    "tests/trainer/test_qwen3_e2e.py": OWN,
    "tests/trainer/test_ref_sync_e2e.py": OWN,
    "tests/trainer/test_reward_model.py": OWN,
    "tests/trainer/test_resume_distopt.py": OWN,
    "tests/workers/test_hybrid_engine.py": OWN,
}


def lane_of(nodeid: str) -> str:
    """The lane of a serial test's id (parameters and any lane suffix ignored)."""
    module, _, rest = nodeid.partition("::")
    function = re.split(r"[\[@]", rest, maxsplit=1)[0]
    return LANE_OF.get(f"{module}::{function}", LANE_OF.get(module, SHARED))


def require_lane(lane: str, what: str) -> None:
    """Fails when the running test, grouped by xdist, is not in `lane`: the shared run `what` is built there only."""
    current = re.search(r"@(\S+) \(", os.environ.get("PYTEST_CURRENT_TEST", ""))
    if current and current[1] != lane:
        test = os.environ["PYTEST_CURRENT_TEST"].split("@", 1)[0]
        raise RuntimeError(f"{test} reads {what}, which is built in the xdist lane {lane!r}, but runs in "
                           f"{current[1]!r}: list it under {lane} in tests/parallel.py LANE_OF")  # fmt: skip


def is_serial(item: pytest.Item) -> bool:
    return (
        item.get_closest_marker("slow") is not None
        or item.get_closest_marker("serial") is not None
        or item.nodeid.split("::", 1)[0] in SERIAL_MODULES
        or not SERIAL_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the serial tests `serial`; on an xdist worker under --dist loadgroup, also gives them their group's id
    suffix (its lane, "@serial-shared" or "@serial-own") by which xdist schedules a group. xdist 3.8 writes that suffix to `item._nodeid`, which pytest 9.2 no longer
    reads (the id is `item._id`), so it is written here."""
    grouped = config.getoption("loadgroup", False)  # set on the workers by xdist
    for item in items:
        if not is_serial(item):
            continue
        item.add_marker(pytest.mark.serial)
        suffix = "@" + lane_of(item.nodeid)
        if grouped and "@" not in item.nodeid:
            if hasattr(item, "_id"):
                item._id = type(item._id).parse(item.nodeid + suffix)
            else:
                item._nodeid = item.nodeid + suffix
