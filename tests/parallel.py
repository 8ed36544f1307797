"""The serial xdist groups: under `bash tests/run.sh` (2 pytest-xdist workers, --dist loadgroup) the tests that start
rank pools, Ray, servers or trainer runs run one after another within their group, each group on one worker; the rest
run beside them.

Two groups, because one chain of them leaves a core idle most of the time (start-ups wait on imports and sockets,
one rank waits for the other): `serial` holds the tests that read the session's shared runs (tests/README.md), which
must be built once on one worker; `serial2` the self-contained modules, which start all they use."""

from __future__ import annotations

import pytest

GROUP = "serial"
SECOND_GROUP = "serial2"  # xdist --dist loadgroup sends the tests whose ids end in the same "@name" to one worker

# A test that requests one of these (directly or through another fixture) starts or uses the session's 4 gloo ranks
# or a trainer run's assets (built on those ranks).
SERIAL_FIXTURES = {"pool", "get_pool", "assets", "qwen3_assets", "sft_assets", "smollm2_hf"}

# Modules whose tests start processes of their own that use more than one core, or that look at the whole host.
SERIAL_MODULES = {
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

# Serial modules that use none of the shared runs (straight/half/layout/integrated-RM runs, the quickstart run and
# sft_assets): they run in the second group, beside the first. A session fixture they use (`assets`, `pool`) is built
# once per worker; the SmolLM2 checkpoint is cached on disk.
SECOND_GROUP_MODULES = {
    "tests/checkpoint/test_convert.py",
    "tests/checkpoint/test_export_loads.py",
    "tests/models/test_qwen3.py",
    "tests/models/test_real_llama.py",
    "tests/rollout/test_vllm_tp.py",
    "tests/serving/test_server.py",
    "tests/test_launchers.py",
    "tests/test_recipe_smollm2.py",
    "tests/test_rlhf_dpo_example.py",
    "tests/trainer/test_async_bounded.py",
    "tests/trainer/test_bench_async.py",
    "tests/trainer/test_dapo_e2e.py",
    "tests/trainer/test_faults.py",
    "tests/trainer/test_partial_rollout_e2e.py",
    "tests/trainer/test_qwen3_e2e.py",
    "tests/trainer/test_ref_sync_e2e.py",
    "tests/trainer/test_resume_distopt.py",
    "tests/trainer/test_separate_engines_e2e.py",
}


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
    suffix ("@serial" or "@serial2") by which xdist schedules a group. xdist 3.8 writes that suffix to `item._nodeid`, which pytest 9.2 no longer
    reads (the id is `item._id`), so it is written here."""
    grouped = config.getoption("loadgroup", False)  # set on the workers by xdist
    for item in items:
        if not is_serial(item):
            continue
        item.add_marker(pytest.mark.serial)
        module = item.nodeid.split("::", 1)[0]
        suffix = "@" + (SECOND_GROUP if module in SECOND_GROUP_MODULES else GROUP)
        if grouped and "@" not in item.nodeid:
            if hasattr(item, "_id"):
                item._id = type(item._id).parse(item.nodeid + suffix)
            else:
                item._nodeid = item.nodeid + suffix
