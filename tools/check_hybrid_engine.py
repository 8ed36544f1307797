#!/usr/bin/env python
"""Check the hybrid engine on your own checkpoint: does the rollout sample from the policy being trained?

Converts --hf-dir into megatron at TP x PP, then on TP*PP local ranks, for --cycles rounds: runs --steps
optimizer steps on random tokens, reshards the weights into a real vLLM engine at --infer-tp, samples,
and recomputes the sampled tokens' logprobs with the megatron actor. Finally it checks that the weights
the engine received equal a direct HF export of the same trained weights. Works from token ids only (the
HF dir needs no tokenizer). The last line is one JSON object; the exit code is 1 when
logprob_diff_max > --tol or the export differs.

    python tools/check_hybrid_engine.py --hf-dir ./model_from_hf/qwen25-0.5b --tp 2 --pp 2 --infer-tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF causal-LM checkpoint (safetensors + config.json)")
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size")
    p.add_argument("--infer-tp", type=int, default=1, help="vLLM tensor-parallel size (must divide TP*PP)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps before each rollout")
    p.add_argument("--cycles", type=int, default=2, help="train -> reshard -> rollout rounds")
    p.add_argument(
        "--dtype", choices=["float32"], default="float32", help="trainer and engine dtype (parity needs fp32)"
    )
    p.add_argument("--tol", type=float, default=1e-4, help="max allowed |engine - actor| logprob difference")
    p.add_argument("--bucket-size-mb", type=float, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep the converted/exported checkpoints here (default: a temp dir, removed)")
    a = p.parse_args(argv)

    import torch

    from mindrl.checkpoint import convert, mcore_ckpt
    from mindrl.checkpoint.hf_io import CheckpointError, HFCheckpoint
    from mindrl.launch import RankPool
    from mindrl.models.hf_config import ModelConfigError, ModelSpec
    from mindrl.workers.hybrid_check import CheckSettings, check_rank

    world = a.tp * a.pp
    if world % a.infer_tp:
        p.error(f"--infer-tp {a.infer_tp} must divide the number of ranks TP*PP = {world}")
    try:
        spec = ModelSpec.from_hf_dir(a.hf_dir)
        if spec.is_value_model:
            raise ModelConfigError(f"{a.hf_dir} is a value model ({spec.architecture}); the rollout needs a causal LM")
        spec.validate_layout(a.tp, a.pp)
    except (ModelConfigError, CheckpointError) as e:
        print(f"check_hybrid_engine: error: {e}", file=sys.stderr)
        return 2
    work = a.workdir or tempfile.mkdtemp(prefix="check_hybrid_")
    settings = CheckSettings(
        a.tp, a.pp, a.infer_tp, a.steps, a.cycles, a.bucket_size_mb, a.num_prompts, a.prompt_len, a.max_tokens,
        a.n, a.temperature, a.seed, a.lr,
    )  # fmt: skip
    try:
        with RankPool(world) as pool:
            print(f"[check] converting {a.hf_dir} to megatron TP{a.tp} PP{a.pp}", flush=True)
            convert.hf2mcore(a.hf_dir, os.path.join(work, "mcore"), a.tp, a.pp, overwrite=True, pool=pool)
            export_root = os.path.join(work, "trained")
            shutil.rmtree(export_root, ignore_errors=True)
            it_dir = mcore_ckpt.iteration_dir(export_root, a.steps * a.cycles)
            print(f"[check] {a.cycles} x ({a.steps} steps -> reshard -> vLLM TP{a.infer_tp} rollout)", flush=True)
            results = pool.run(check_rank, os.path.join(work, "mcore"), a.hf_dir, settings, it_dir)
            mcore_ckpt.write_model_meta(it_dir, spec, "actor", a.tp, a.pp, a.dtype)
            mcore_ckpt.write_tracker(export_root, a.steps * a.cycles)
            convert.mcore2hf(export_root, os.path.join(work, "export"), overwrite=True, pool=pool)
        export = HFCheckpoint(os.path.join(work, "export"))
        recorded = results[0]["recorded"]
        mismatched = sorted(set(recorded) ^ set(export.keys()))
        mismatched += [n for n in recorded if n in export.keys() and not torch.equal(recorded[n], export.get(n))]
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)

    cycles = results[0]["cycles"]
    print(f"\n{'cycle':>5} {'loss':>9} {'diff_max':>10} {'diff_mean':>10} {'reshard_s':>10} {'rollout tok/s':>14}")
    for i, c in enumerate(cycles):
        print(f"{i:>5} {c['losses'][-1]:>9.4f} {c['rollout/logprob_diff_max']:>10.2e} "
              f"{c['rollout/logprob_diff_mean']:>10.2e} {c['reshard_s']:>10.3f} {c['tokens_per_s']:>14.0f}")  # fmt: skip
    reshard_s = statistics.median(max(r["cycles"][i]["reshard_s"] for r in results) for i in range(len(cycles)))
    summary = {
        "logprob_diff_max": max(c["rollout/logprob_diff_max"] for c in cycles),
        "logprob_diff_mean": statistics.mean(c["rollout/logprob_diff_mean"] for c in cycles),
        "reshard_s": reshard_s,
        "memcpy_s": max(r["memcpy_s"] for r in results),
        "peak_extra_bytes": max(c["peak_extra_bytes"] for r in results for c in r["cycles"]),
        # steady state: the last cycle (the first includes the engine's warm-up), summed over replicas
        "rollout_tokens_per_s": sum(r["cycles"][-1]["tokens_per_s"] for r in results) / a.infer_tp,
        "reshard_matches_export": not mismatched,
        "model_bytes": results[0]["model_bytes"],
        "train_layout": {"tp": a.tp, "pp": a.pp},
        "infer_tp": a.infer_tp,
        "steps": a.steps * a.cycles,
    }
    ok = summary["logprob_diff_max"] <= a.tol and not mismatched
    if mismatched:
        print(f"[check] streamed weights differ from the direct export: {mismatched[:5]}", file=sys.stderr)
    if summary["logprob_diff_max"] > a.tol:
        print(f"[check] FAIL: logprob_diff_max {summary['logprob_diff_max']:.3g} > --tol {a.tol}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
