#!/usr/bin/env python
"""TRL's side of tools/bench_vs_trl.py: GRPO with `trl.GRPOTrainer` on the benchmark's model and prompts.

Runs in TRL's own environment (./.bench-venv/trl, made by bench_vs_trl.py), never in .venv; imports nothing
from mindrl but its rule verifiers (mindrl/rewards/extract.py and verifiers.py, loaded by path: no math_verify
there). Reads a job JSON (model dir, prompts as text + their token ids, optional labels, reward, n, new tokens,
lr, temperature, beta, iterations, threads, optional save_dir), checks that the tokenizer turns each prompt text
into exactly its ids, trains, saves the final model to save_dir if given, and writes one JSON: per-step wall
seconds and the split into generation / scoring (logprobs, reference, rewards) / update.

    .bench-venv/trl/bin/python tools/bench_trl_side.py --job job.json --out result.json
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import resource
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str):
    """A module of mindrl.rewards by path, under its own name (the package's __init__ imports math_verify, absent
    here), after the sibling modules it imports at its top (found in its source, so a new sibling needs no edit)."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(ROOT, *name.split(".")) + ".py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mindrl.rewards."):
            _load(node.module)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


for _pkg in ("mindrl", "mindrl.rewards"):  # empty parents: only the modules below (and their siblings) are loaded
    sys.modules.setdefault(_pkg, types.ModuleType(_pkg))
_EXTRACT = _load("mindrl.rewards.extract")
_VERIFIERS = _load("mindrl.rewards.verifiers")


def format_reward(completions: list[str], **kwargs) -> list[float]:
    """mindrl's `format` verifier: 1.0 for `<think>...</think> <answer>...</answer>` spanning the response."""
    return [1.0 if _EXTRACT.matches_think_answer_format(c) else 0.0 for c in completions]


def verifier_reward(name: str):
    """A TRL reward function scoring each completion against its row's `label` with mindrl's verifier `name`."""
    verify = _VERIFIERS.VERIFIERS[name]

    def reward(completions: list[str], label: list[str], **kwargs) -> list[float]:
        return [verify(c, lab) for c, lab in zip(completions, label)]

    reward.__name__ = name
    return reward


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="the job JSON written by bench_vs_trl.py")
    p.add_argument("--out", required=True, help="write the result JSON here")
    p.add_argument("--vllm-colocate", action="store_true", help="generate with TRL's vLLM colocate mode")
    a = p.parse_args(argv)
    with open(a.job) as f:
        job = json.load(f)

    import torch

    torch.set_num_threads(job["threads"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(job["model_dir"])
    for text, ids in zip(job["prompt_texts"], job["prompt_ids"]):
        got = tok(text)["input_ids"]
        if got != ids:
            raise SystemExit(f"TRL's tokenizer turns prompt {text!r} into {got}, not {ids}: the sides would differ")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    new_tokens, n, prompts_per_step = job["new_tokens"], job["n"], job["prompts_per_step"]
    rows = n * prompts_per_step
    micro = job["micro_batch_size"]
    cfg = GRPOConfig(
        output_dir=job["workdir"],
        use_cpu=True,
        bf16=job.get("dtype", "fp32") == "bf16",  # mixed precision: fp32 weights and optimizer, bf16 autocast
        fp16=False,
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        weight_decay=job["weight_decay"],
        max_grad_norm=job["clip_grad"],
        adam_beta1=job["adam_beta1"],
        adam_beta2=job["adam_beta2"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,  # one optimizer step per generation batch, as mindrl
        num_generations=n,
        max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": new_tokens},  # no early stop: exactly new_tokens each
        temperature=job.get("temperature", 1.0),
        top_p=1.0,
        beta=job["beta"],
        num_iterations=1,
        max_steps=job["iterations"],
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=1234,
        use_vllm=a.vllm_colocate,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=job["max_model_len"],
    )
    columns = {"prompt": job["prompt_texts"]}
    if job.get("labels"):
        columns["label"] = job["labels"]
    reward = job.get("reward", "format")
    reward_fn = format_reward if reward == "format" else verifier_reward(reward)
    data = Dataset.from_dict(columns)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data, processing_class=tok)

    phases = {"rollout": 0.0, "scoring": 0.0}
    gen, score = trainer._generate, trainer._generate_and_score_completions

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return gen(*args, **kwargs)
        finally:
            phases["rollout"] += time.perf_counter() - t0

    def timed_score(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            phases["scoring"] += time.perf_counter() - t0  # includes the generation; subtracted below

    trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_score
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            phases.update(rollout=0.0, scoring=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self.t0
            rollout, scoring = phases["rollout"], phases["scoring"] - phases["rollout"]
            steps.append(
                {
                    "step_s": wall,
                    "phases": {"rollout": rollout, "logprobs_ref_rewards": scoring, "update": wall - rollout - scoring},
                }
            )
            print(f"[trl] step {state.global_step}/{args.max_steps}: {wall:.2f} s (generation {rollout:.2f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip

    trainer.add_callback(StepTimer())
    trainer.train()
    if job.get("save_dir"):  # the final weights, for the held-out evaluation (mindrl-eval, in .venv)
        trainer.save_model(job["save_dir"])
    result = {
        "steps": steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": {
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },  # fmt: skip
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "bf16": cfg.bf16,
        "threads": torch.get_num_threads(),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
