"""mindrl-convert: HF <-> megatron checkpoint conversion (`hf2mcore`, `mcore2hf`, also from legacy mp_rank_*
checkpoints), GGUF -> HF (`gguf2hf`) and a numerical check of the result (`check`); `mindrl-convert COMMAND -h` gives
a command's options."""

from __future__ import annotations

import argparse
import json
import sys

from mindrl.checkpoint.hf_io import CheckpointError
from mindrl.models.hf_config import ModelConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mindrl-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf2mcore", help="HF safetensors checkpoint -> megatron checkpoint at TP x PP")
    a.add_argument("--hf-dir", required=True, help="HF checkpoint directory (config.json + safetensors)")
    a.add_argument("--save-dir", required=True, help="megatron checkpoint directory to create (actor_config.load)")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size of a MoE model (default 1)")
    a.add_argument(
        "--orm",
        action="store_true",
        help="the HF side is a *ForSequenceClassification (num_labels=1) "
        "reward model; the megatron side gets a value head (critic)",
    )
    a.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="param dtype (default: the checkpoint's)"
    )
    a.add_argument(
        "--adapter",
        help="a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for --hf-dir's model: the "
        "checkpoint gets mindrl's LoRA layers holding its adapters, for a LoRA run (actor_config.lora_r, "
        "lora_alpha and lora_target_modules must be the adapter's) to train on",
    )
    a.add_argument("--overwrite", action="store_true", help="replace a non-empty --save-dir")

    b = sub.add_parser("mcore2hf", help="megatron checkpoint (latest iteration) -> HF safetensors checkpoint")
    b.add_argument("--load-dir", required=True, help="megatron checkpoint directory")
    b.add_argument("--save-dir", required=True, help="HF directory to create")
    b.add_argument("--orm", action="store_true", help="the checkpoint holds a value-head (critic/reward) model")
    b.add_argument(
        "--hf-config",
        help="HF model dir (config.json, tokenizer) describing a legacy megatron checkpoint (mp_rank_XX[_YYY] "
        "files from MindSpeed-LLM / MindSpeed-RL), which records no architecture; its files are carried over",
    )
    b.add_argument("--max-shard-size-mb", type=int, default=5120, help="safetensors shard size cap (default 5120)")
    b.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA checkpoint's adapters alone, as a PEFT directory (adapter_config.json + "
        "adapter_model.safetensors) for the base model; without it a LoRA checkpoint is written merged",
    )
    b.add_argument("--overwrite", action="store_true", help="replace a non-empty --save-dir")

    g = sub.add_parser(
        "gguf2hf",
        help="GGUF model file (llama.cpp format, quantised or not) -> fp32 HF checkpoint with tokenizer and chat "
        "template; needs the optional packages: pip install 'mindrl[gguf]'",
    )
    g.add_argument("--gguf", required=True, help="the .gguf file")
    g.add_argument("--save-dir", required=True, help="HF directory to create")
    g.add_argument("--overwrite", action="store_true", help="replace a non-empty --save-dir")

    c = sub.add_parser(
        "check",
        help="max |logits(megatron) - logits(HF)| on random tokens, both in fp64; passes below 1e-3 x HF's own fp32 "
        "error (max |HF fp32 - HF fp64|, measured on the same tokens) unless --tol is given",
    )
    c.add_argument("--hf-dir", required=True)
    c.add_argument("--load-dir", required=True)
    c.add_argument("--tp", type=int, help="load at this TP (default: as saved)")
    c.add_argument("--pp", type=int, help="load at this PP (default: as saved)")
    c.add_argument("--ep", type=int, default=1, help="load a MoE model at this expert-parallel size (default 1)")
    c.add_argument(
        "--tol",
        type=float,
        help="exit 1 above this max abs difference in fp64 (default: 1e-3 x HF's fp32-vs-fp64 gap on the same tokens)",
    )
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=64)
    c.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from mindrl.cli import fast_exit

    fast_exit()  # no final garbage collection at exit
    args = _parser().parse_args(argv)
    from mindrl.checkpoint import convert

    try:
        if args.command == "hf2mcore":
            stats = convert.hf2mcore(
                args.hf_dir, args.save_dir, args.tp, args.pp, args.orm, args.dtype, args.overwrite, ep=args.ep,
                adapter=args.adapter,
            )  # fmt: skip
            print(
                f"hf2mcore: {stats.num_params / 1e6:.1f}M params at TP{args.tp} PP{args.pp} -> {args.save_dir} "
                f"in {stats.seconds:.1f} s; peak RSS per rank {max(stats.peak_rss_bytes) / 2**20:.0f} MiB"
            )
        elif args.command == "mcore2hf":
            stats = convert.mcore2hf(
                args.load_dir,
                args.save_dir,
                args.orm,
                args.max_shard_size_mb,
                args.overwrite,
                hf_config=args.hf_config,
                adapter_only=args.adapter_only,
            )
            print(
                f"mcore2hf: {stats.num_params / 1e6:.1f}M params -> {args.save_dir} in {stats.seconds:.1f} s; "
                f"peak RSS {max(stats.peak_rss_bytes) / 2**20:.0f} MiB"
            )
        elif args.command == "gguf2hf":
            from mindrl.checkpoint.gguf import gguf_to_hf

            info = gguf_to_hf(args.gguf, args.save_dir, args.overwrite)
            types = ", ".join(f"{n} {k}" for k, n in sorted(info["tensor_types"].items()))
            print(
                f"gguf2hf: {info['architecture']} {info['num_params'] / 1e6:.1f}M params (tensors: {types}) -> "
                f"{args.save_dir} (fp32) in {info['seconds']:.1f} s"
            )
        else:
            res = convert.check(
                args.hf_dir,
                args.load_dir,
                args.tp,
                args.pp,
                args.batch,
                args.seq_len,
                args.seed,
                tol=args.tol,
                ep=args.ep,
            )
            print(
                json.dumps(
                    {
                        "max_abs_logit_diff": res.max_abs_diff,
                        "reference_gap_fp32": res.reference_gap,
                        "max_abs_logit": res.max_abs_output,
                        "tol": res.tol,
                        "dtype": "float64",
                        "ok": res.ok,
                    }
                )
            )
            return 0 if res.ok else 1
    except (ModelConfigError, CheckpointError) as e:
        print(f"mindrl-convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
