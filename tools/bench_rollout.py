#!/usr/bin/env python
"""Rollout throughput: VllmEngine vs bare vllm.LLM, and HFEngine vs bare HF generate, same model and batch.

Builds a ~30M-parameter Qwen2-architecture model (random weights), then times generate() on one batch of
random token-id prompts with fixed-length responses (ignore_eos), sampled at temperature 1 with sampled-token
logprobs on both sides of each comparison. Reports medians over --repeats, a table, and a final JSON line.

The headline ratios compare each engine with the bare library call on the *same* model instance, timed
alternately (engine, bare, engine, bare, ...) so that load from other processes hits both alike. A separately
built bare `vllm.LLM` (real weights read from disk, no reload) is timed too, as a sanity check.

    python tools/bench_rollout.py                       # 64 prompts x 64 new tokens, fp32, 2 threads
    python tools/bench_rollout.py --skip-hf --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="reuse/create the benchmark model here (default: a temp dir)")
    p.add_argument("--prompts", type=int, default=64, help="prompts in the batch")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="response tokens per prompt (fixed: ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per contender (median reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--skip-hf", action="store_true", help="only the vLLM comparison")
    p.add_argument("--skip-vllm", action="store_true", help="only the HF comparison")
    return p.parse_args(argv)


def build_model(model_dir: str) -> str:
    from tools.make_tiny_model import make_tiny_model

    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        make_tiny_model(
            model_dir,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1408,
            vocab_size=8192,
            seed=0,
        )
    return model_dir


def timed(fn, repeats: int) -> tuple[list[float], list[float], object]:
    """(wall seconds, process CPU seconds, last output) per repeat, after one warm-up call."""
    fn()  # warm-up (first-call allocations, lazy init)
    times, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu, out


def bench_bare_vllm(args, model_dir: str, prompts: list[list[int]], max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mindrl.platform import current_platform

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=max(8192, max_model_len),
        kv_cache_memory_bytes=current_platform().rollout_kv_cache_bytes(),
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        seed=0,
    )
    create_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0, ignore_eos=True, detokenize=False)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    times, cpu, outs = timed(lambda: llm.generate(reqs, params, use_tqdm=False), args.repeats)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()
    return dict(times=times, cpu=cpu, tokens=tokens, create_s=create_s)


def bench_engine_vs_bare(args, engine_cls, model_dir: str, prompts: list[list[int]], max_model_len: int) -> dict:
    """Engine.generate and the bare library call on the engine's own model, alternately."""
    from safetensors.torch import load_file

    from mindrl.rollout import RolloutConfig, SamplingConfig

    t0 = time.perf_counter()
    engine = engine_cls(
        RolloutConfig(
            model=model_dir,
            dtype=args.dtype,
            max_model_len=max_model_len,
            max_num_seqs=args.prompts,
            max_num_batched_tokens=max(8192, max_model_len),
            load_tokenizer=False,
            seed=0,
        )
    )
    create_s = time.perf_counter() - t0
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    t0 = time.perf_counter()
    engine.load_weights(state.items())
    load_s = time.perf_counter() - t0
    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    bare, count_bare = bare_call(args, engine, prompts)

    def through_engine():
        return sum(len(s.token_ids) for samples in engine.generate(prompts, sampling) for s in samples)

    through_engine(), bare()  # warm-up
    times, cpu, tokens = {"engine": [], "bare": []}, {"engine": [], "bare": []}, {}
    for i in range(args.repeats):
        pair = [("engine", through_engine), ("bare", bare)]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:  # ABBA order: no systematic first/second bias
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            tokens[name] = out if name == "engine" else count_bare(out)
    engine.shutdown()
    return dict(
        engine=dict(
            times=times["engine"], cpu=cpu["engine"], tokens=tokens["engine"], create_s=create_s, load_weights_s=load_s
        ),
        bare=dict(times=times["bare"], cpu=cpu["bare"], tokens=tokens["bare"]),
    )


def bare_call(args, engine, prompts: list[list[int]]):
    """(fn, token counter): the library's own generate on the engine's model, same sampling, with logprobs
    for vLLM (as the engine asks for) and without for HF (plain generate; the engine keeps per-step scores)."""
    import torch

    if hasattr(engine, "llm"):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, logprobs=0, ignore_eos=True, detokenize=False
        )
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return (lambda: engine.llm.generate(reqs, params, use_tqdm=False)), (
            lambda outs: sum(len(c.token_ids) for o in outs for c in o.outputs)
        )
    from transformers import GenerationConfig

    input_ids = torch.tensor(prompts)  # equal lengths: no padding
    gen = GenerationConfig(
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=engine.pad_token_id,
    )

    @torch.no_grad()
    def run():
        return engine.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen
        )

    return run, lambda out: int(out[:, input_ids.shape[1] :].numel())


def tok_s(r: dict, key: str = "times", stat=statistics.median) -> float:
    """Tokens per second of wall time ("times") or of process CPU time ("cpu"), by median (or min)."""
    return r["tokens"] / stat(r[key])


def ratios(engine: dict, bare: dict) -> dict:
    """engine / bare throughput: by median wall time (headline), best wall time, and median CPU time. On a
    shared machine the last two are the robust ones: other processes inflate wall times at random."""
    return dict(
        median_wall=tok_s(engine) / tok_s(bare),
        min_wall=tok_s(engine, stat=min) / tok_s(bare, stat=min),
        median_cpu=tok_s(engine, "cpu") / tok_s(bare, "cpu"),
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tools.scratch import scratch_dir

    model_dir = build_model(args.model_dir or os.path.join(scratch_dir(None, "bench_rollout_"), "model"))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    n_params = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * (
        cfg.hidden_size * cfg.hidden_size * 2  # q, o
        + 2 * cfg.hidden_size * (cfg.hidden_size // cfg.num_attention_heads) * cfg.num_key_value_heads  # k, v
        + 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size - 3, (args.prompts, args.prompt_len), generator=gen).tolist()
    max_model_len = args.prompt_len + args.max_tokens
    res: dict = {}
    if not args.skip_vllm:
        from mindrl.rollout.vllm_engine import VllmEngine

        res["bare_vllm_fresh"] = bench_bare_vllm(args, model_dir, prompts, max_model_len)
        r = bench_engine_vs_bare(args, VllmEngine, model_dir, prompts, max_model_len)
        res["VllmEngine"], res["bare_vllm"] = r["engine"], r["bare"]
    if not args.skip_hf:
        from mindrl.rollout.hf_engine import HFEngine

        r = bench_engine_vs_bare(args, HFEngine, model_dir, prompts, max_model_len)
        res["HFEngine"], res["bare_hf_generate"] = r["engine"], r["bare"]

    print(
        f"model: Qwen2 {n_params / 1e6:.1f}M params, {args.dtype}; batch {args.prompts} x ({args.prompt_len} prompt + "
        f"{args.max_tokens} new) tokens; {args.threads} threads; median of {args.repeats}"
    )
    print(
        f"{'contender':<18} {'tok/s':>8} {'med s':>7} {'min s':>7} {'max s':>7} {'tok/cpu-s':>9} {'create s':>8} {'load s':>7}"
    )
    for name, r in res.items():
        ts = r["times"]
        print(
            f"{name:<18} {tok_s(r):>8.1f} {statistics.median(ts):>7.3f} {min(ts):>7.3f} {max(ts):>7.3f} "
            f"{tok_s(r, 'cpu'):>9.1f} {r.get('create_s', float('nan')):>8.2f} {r.get('load_weights_s', float('nan')):>7.3f}"
        )
    summary: dict = dict(
        model_params=n_params, dtype=args.dtype, prompts=args.prompts, max_tokens=args.max_tokens, threads=args.threads
    )
    for name, r in res.items():
        summary[f"{name}_tok_s"] = round(tok_s(r), 1)
    for label, engine, bare in (("vllm", "VllmEngine", "bare_vllm"), ("hf", "HFEngine", "bare_hf_generate")):
        if engine not in res:
            continue
        rr = ratios(res[engine], res[bare])
        for k, v in rr.items():
            summary[f"{label}_engine_over_bare_{k}"] = round(v, 3)
        print(
            f"{engine} / {bare} (same instance, alternating): median wall {rr['median_wall']:.3f}, "
            f"best wall {rr['min_wall']:.3f}, median CPU {rr['median_cpu']:.3f} (1.0 = no overhead; target >= 0.9)"
        )
    if "VllmEngine" in res:
        summary["vllm_load_weights_s"] = round(res["VllmEngine"]["load_weights_s"], 4)
        fresh = tok_s(res["VllmEngine"], stat=min) / tok_s(res["bare_vllm_fresh"], stat=min)
        summary["vllm_engine_over_fresh_bare_min_wall"] = round(fresh, 3)
        print(f"VllmEngine / separately built bare vLLM (best wall; different phases) = {fresh:.3f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
