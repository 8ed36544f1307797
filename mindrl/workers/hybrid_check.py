"""Policy-consistency check of the hybrid engine on every rank (train, reshard into a real rollout engine, sample,
recompute the logprobs with the actor, compare, for several cycles); used by tools/check_hybrid_engine.py and tests."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class CheckSettings:
    tp: int
    pp: int
    infer_tp: int
    steps: int = 2  # optimizer steps before each rollout
    cycles: int = 2  # train -> reshard -> rollout -> recompute rounds
    bucket_size_mb: float = 64
    num_prompts: int = 4
    prompt_len: int = 12
    max_tokens: int = 16
    n: int = 2
    temperature: float = 1.0
    seed: int = 0
    lr: float = 1e-2
    logprob_diff_warn: float = 0.05  # HybridEngine's warning threshold on the mean |diff|


class _CountWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Median time of one host memcpy of nbytes: the floor any reshard of that many bytes is compared with."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def check_rank(load_dir: str, engine_dir: str, s: CheckSettings, export_it_dir: str | None = None) -> dict:
    """One rank's part. engine_dir: an HF dir with config.json (weights unused: the engine starts dummy)."""
    from mindrl.checkpoint import mcore_ckpt
    from mindrl.resharding.stream import unwrap
    from mindrl.rollout import RolloutConfig, SamplingConfig, VllmEngine
    from mindrl.workers.hybrid_engine import HybridEngine
    from mindrl.workers.train_setup import build_trainer, train_steps

    spec, ddp, optimizer = build_trainer(load_dir, s.tp, s.pp, lr=s.lr)
    engine = VllmEngine(
        RolloutConfig(
            model=engine_dir,
            infer_tensor_parallel_size=s.infer_tp,
            dtype="float32",
            max_model_len=s.prompt_len + s.max_tokens + 16,
            max_num_seqs=max(8, s.num_prompts * s.n),
            load_tokenizer=False,
            seed=1000 + s.seed,
        )
    )
    hybrid = HybridEngine(
        ddp, spec, optimizer, engine, bucket_size_mb=s.bucket_size_mb, logprob_diff_warn=s.logprob_diff_warn
    )
    warnings = _CountWarnings()
    logging.getLogger("mindrl.hybrid_engine").addHandler(warnings)
    gen = torch.Generator().manual_seed(s.seed)
    prompts = torch.randint(0, spec.vocab_size, (s.num_prompts, s.prompt_len), generator=gen).tolist()
    sampling = SamplingConfig(max_tokens=s.max_tokens, temperature=s.temperature, n=s.n, ignore_eos=True)

    recorded: dict[str, torch.Tensor] = {}
    record = torch.distributed.get_rank() == 0 and export_it_dir is not None
    load = engine.load_weights
    cycles = []
    try:
        for cycle in range(s.cycles):
            losses = train_steps(ddp, optimizer, spec.vocab_size, s.steps, seed=s.seed, first_step=cycle * s.steps)
            if record and cycle == s.cycles - 1:  # keep what the engine received on the last reload

                def tee(weights, _load=load):
                    return _load((n, recorded.setdefault(n, t.detach().clone())) for n, t in weights)

                engine.load_weights = tee
            samples, stats = hybrid.generate(prompts, sampling)
            metrics = hybrid.logprob_diff_metrics(prompts, samples, sampling)
            last_samples = [(p, r.token_ids, r.logprobs) for p, group in zip(prompts, samples) for r in group]
            cycles.append({"losses": losses, **metrics, **asdict(stats), "tokens_per_s": stats.tokens_per_s})
        bytes_emitted = hybrid.manager.streamer.stats.bytes_emitted
        if export_it_dir is not None:  # the same weights, exported the direct way (a checkpoint)
            mcore_ckpt.save_model(unwrap(ddp), export_it_dir)
    finally:
        logging.getLogger("mindrl.hybrid_engine").removeHandler(warnings)
        engine.load_weights = load
        engine.shutdown()
    return {
        "warnings": warnings.count,
        "cycles": cycles,
        "memcpy_s": memcpy_seconds(bytes_emitted),
        "model_bytes": bytes_emitted,
        "recorded": recorded,
        "samples": last_samples,  # (prompt ids, response ids, engine logprobs) of this rank's engine, last cycle
    }
