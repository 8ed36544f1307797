"""The rollout's two ways to run a LoRA actor's current weights, timed on one engine each (docs/lora.md):

- **merged** (what the trainer does): each step every adapted linear's `W + scale * B A` is computed and the whole
  model is streamed into a plain engine (`VllmEngine.load_weights`), which then generates at the base model's cost;
- **vllm-lora**: vLLM's own engine with its LoRA layers (`enable_lora`; mindrl's engine kernels do not compose with
  them); each step the adapters are written as a PEFT
  directory and the next generation loads them (`LoRARequest(load_inplace=True)`), the base weights never move.

Each step is the weight update then one rollout batch (prompts x n samples, exactly `--max-tokens` new tokens). The
adapter changes every step, as in training. Both modes run in a child process of their own (one vLLM engine per
process), on the same model, adapters, prompts and seeds; the table gives medians over the steps after a warm-up,
wall and CPU seconds (CPU is the steadier figure on a shared host), and how many of a greedy probe's tokens each mode
shares with HF + peft (the adapter unmerged) before the first difference.

    python tools/bench_lora_rollout.py                      # SmolLM2-135M (tools/get_model.py smollm2), r 16
    python tools/bench_lora_rollout.py --hf-dir DIR --rank 8 --steps 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(hf_dir: str, rank: int, alpha: float, steps: int, out: str) -> list[str]:
    """`steps` PEFT adapter directories for `hf_dir` (every linear of every layer, B non-zero: a trained adapter's
    shape of effect), one per training step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(0)
    dirs = []
    for step in range(steps):
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 2e-3)
        path = os.path.join(out, f"adapter_{step}")
        peft.save_pretrained(path)
        dirs.append(path)
    return dirs


def hf_probe(hf_dir: str, adapter_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference: HF + peft, the adapter unmerged, greedy, exactly `max_tokens` new tokens per prompt."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), adapter_dir)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            out.append(gen[0, len(p) :].tolist())
    return out


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(vocab // 10, vocab - 100) for _ in range(length)] for _ in range(count)]


def run_mode(args) -> dict:
    """One mode's steps in this process (the child)."""
    import torch
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from mindrl.rollout import RolloutConfig

    torch.set_num_threads(args.threads)
    adapters = json.loads(args.adapters)
    lora = args.mode == "vllm-lora"
    kv_bytes = 1 << 30  # the same KV cache for both
    t0 = time.perf_counter()
    if lora:
        # vLLM's own engine and layers: mindrl's engine kernels (VllmEngine's linears, SwiGLU and sampler) do not
        # compose with vLLM's LoRA layers (its greedy tokens left HF + peft's at the first one: docs/lora.md)
        import os as _os

        from vllm import LLM

        _os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as VllmEngine runs it
        # vLLM takes max_lora_rank from a fixed list: the smallest that holds the adapters
        max_rank = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= args.rank)
        llm = LLM(model=args.hf_dir, dtype="float32", max_model_len=args.prompt_len + args.max_tokens,
                  max_num_seqs=args.prompts * args.n, max_num_batched_tokens=8192, enforce_eager=True,
                  skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=kv_bytes, enable_lora=True,
                  max_lora_rank=max_rank, max_loras=1)  # fmt: skip
        vocab = llm.llm_engine.model_config.get_vocab_size()
    else:
        from mindrl.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(
            RolloutConfig(
                model=args.hf_dir,
                dtype="float32",
                max_model_len=args.prompt_len + args.max_tokens,
                max_num_seqs=args.prompts * args.n,
                max_num_batched_tokens=8192,
                kv_cache_memory_bytes=kv_bytes,
                enforce_eager=True,
                load_tokenizer=False,
                seed=0,
            )
        )
        llm, vocab = engine.llm, engine.vocab_size
    create_s = time.perf_counter() - t0
    base = load_file(os.path.join(args.hf_dir, "model.safetensors"))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(args.prompts, args.prompt_len, vocab)]
    sample = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=1, detokenize=False
    )
    greedy = SamplingParams(n=1, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    from vllm.lora.request import LoRARequest

    def merged(adapter_dir: str) -> dict:
        """The trainer's stream: W + scale * B A per adapted linear (fp32), every other tensor as is."""
        cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
        scale = cfg["lora_alpha"] / cfg["r"]
        ad = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        out = dict(base)
        for key, a in ad.items():
            if ".lora_A." not in key:
                continue
            module = key.split("base_model.model.", 1)[1].rsplit(".lora_A.", 1)[0]
            b = ad[key.replace(".lora_A.", ".lora_B.")]
            out[module + ".weight"] = base[module + ".weight"] + scale * (b @ a)
        return out

    def request(step: int):
        return LoRARequest(f"actor_{step}", 1, adapters[step], load_inplace=True) if lora else None

    def update(step: int) -> None:
        if not lora:
            engine.load_weights(merged(adapters[step]).items())
        # vllm-lora: the adapter directory is what the trainer writes each step (peft_io); its load happens in the
        # next generate, so the step's time counts it there

    steps, probe = [], None
    for step in range(len(adapters)):
        t0, c0 = time.perf_counter(), time.process_time()
        update(step)
        t1, c1 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, sample, lora_request=request(step), use_tqdm=False)
        t2, c2 = time.perf_counter(), time.process_time()
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        steps.append(dict(update_s=t1 - t0, update_cpu_s=c1 - c0, generate_s=t2 - t1, generate_cpu_s=c2 - c1,
                          step_s=t2 - t0, step_cpu_s=c2 - c0, tokens=tokens))  # fmt: skip
    probe_out = llm.generate(prompts[:4], greedy, lora_request=request(len(adapters) - 1), use_tqdm=False)
    probe = [list(o.outputs[0].token_ids) for o in probe_out]
    if not lora:
        engine.shutdown()
    return dict(mode=args.mode, create_s=create_s, steps=steps, probe=probe)


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", help="the base HF model (default: tools/get_model.py smollm2)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first is the warm-up)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--mode", choices=["merged", "vllm-lora"], help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--adapters", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        with open(args.result, "w") as f:
            json.dump(run_mode(args), f)
        return 0
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first is the warm-up)")
    if args.hf_dir is None:
        out = subprocess.run([sys.executable, "tools/get_model.py", "smollm2"], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"tools/get_model.py smollm2 failed; pass --hf-dir\n{out.stderr}")
        args.hf_dir = out.stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        adapters = make_adapters(args.hf_dir, args.rank, args.alpha, args.steps, tmp)
        results = {}
        for mode in ("merged", "vllm-lora"):
            path = os.path.join(tmp, f"{mode}.json")
            child = [sys.executable, __file__, "--mode", mode, "--adapters", json.dumps(adapters), "--result", path]
            for key in ("hf_dir", "rank", "prompts", "n", "prompt_len", "max_tokens", "threads"):
                child += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            subprocess.run(child, check=True)
            results[mode] = json.load(open(path))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.hf_dir).vocab_size
        reference = hf_probe(
            args.hf_dir, adapters[-1], _prompts(args.prompts, args.prompt_len, vocab)[:4], args.max_tokens
        )

    def agree(probe: list[list[int]]) -> int:  # tokens equal to HF + peft's up to the first difference per prompt
        n = 0
        for a, b in zip(probe, reference):
            for x, y in zip(a, b):
                if x != y:
                    break
                n += 1
        return n

    total = sum(len(r) for r in reference)
    print(f"\nLoRA rollout, {args.hf_dir}: r {args.rank} on every linear, {args.prompts} prompts x {args.n} samples x "
          f"{args.max_tokens} tokens, medians of steps 2..{args.steps} (seconds)")  # fmt: skip
    print(f"{'mode':<11}{'engine start':>13}{'update':>9}{'update CPU':>11}{'generate':>10}{'gen CPU':>9}"
          f"{'step':>8}{'step CPU':>10}{'tokens/s':>10}")  # fmt: skip
    summary = {}
    for mode, r in results.items():
        rows = r["steps"][1:]
        s = {k: _median(rows, k) for k in rows[0] if k != "tokens"}
        s["tokens_per_s"] = rows[0]["tokens"] / s["step_s"]
        s["create_s"] = r["create_s"]
        summary[mode] = s
        print(f"{mode:<11}{r['create_s']:>13.1f}{s['update_s']:>9.2f}{s['update_cpu_s']:>11.2f}{s['generate_s']:>10.2f}"
              f"{s['generate_cpu_s']:>9.2f}{s['step_s']:>8.2f}{s['step_cpu_s']:>10.2f}{s['tokens_per_s']:>10.0f}")  # fmt: skip
    faster = min(summary, key=lambda m: summary[m]["step_cpu_s"])
    same = {m: agree(r["probe"]) for m, r in results.items()}
    print("greedy probe (4 prompts, the last adapter), tokens equal to HF + peft's before the first difference: "
          + ", ".join(f"{m} {n}/{total}" for m, n in same.items()) + f"; faster by step CPU: {faster}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(args=vars(args), summary=summary, results=results, agree=same, probe_tokens=total), f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
