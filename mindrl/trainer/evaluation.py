"""Held-out evaluation: greedy (and optionally pass@k) accuracy of a policy with the rollout engine, scored by the
training verifiers; the trainer's (every eval_interval) and mindrl-eval's. Reference: docs/evaluation.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mindrl.config.settings import SamplingConfig
from mindrl.rollout.base import RolloutSample
from mindrl.workers.from_config import end_token_ids
from mindrl.workers.results import Scores

logger = logging.getLogger("mindrl.trainer")

EVAL_DIR = "eval"
"""Under the run dir: one JSONL of responses per evaluation, `iter_{iteration:07d}.jsonl`."""

GenerateFn = Callable[[list[list[int]], SamplingConfig, list[int]], list[list[RolloutSample]]]
"""(prompts, sampling, one seed per prompt) -> per prompt, sampling.n samples."""
ScoreFn = Callable[[list[list[int]], list[list[int]]], Scores]
"""(response ids, label ids), one pair per row -> their Scores (decoded texts, rewards, per-verifier scores)."""
ModelScoreFn = Callable[[list[list[int]], list[list[int]], Scores], Scores]
"""(prompt ids, response ids, their rule Scores), one per row -> the Scores with the reward model's scores mixed into
the rewards and kept in `Scores.model_scores`."""


@dataclass
class EvalSet:
    """The held-out prompts an evaluation runs on, in dataset order."""

    prompts: list[list[int]]
    labels: list[list[int]]
    """Per prompt, its label's token ids ([] where the dataset has no labels)."""
    indices: list[int]
    """Per prompt, its document index in the packed dataset."""


@dataclass
class EvalSettings:
    verifier_names: tuple[str, ...]
    n_samples: int = 0
    """Sampled responses per prompt for pass@k, besides the greedy one; 0: greedy only."""
    temperature: float = 1.0
    """Temperature of the sampled responses."""
    seed: int = 1234
    """The sampled responses' seeds derive from it and the prompt's dataset index (the same at every evaluation)."""


def protocol_sampling(sampling: SamplingConfig, protocol: str, end_ids: Sequence[int]) -> SamplingConfig:
    """The sampling an evaluation decodes with. standard: the model's end tokens `end_ids` are the only stops (no
    stop strings, no other stop tokens); rollout: `sampling` as the rollout uses it. Temperature and n are
    `evaluate`'s."""
    if protocol == "rollout":
        return sampling
    if protocol != "standard":
        raise ValueError(f"unknown evaluation protocol {protocol!r}: standard or rollout")
    return dataclasses.replace(sampling, stop=[], stop_token_ids=sorted(set(end_ids)), detokenize=False,
                               ignore_eos=False)  # fmt: skip


def protocol_label(sampling: SamplingConfig, end_ids: Sequence[int]) -> str:
    """How the greedy responses were decoded, in words, to print next to the figure."""
    extra = sorted(set(sampling.stop_token_ids) - set(end_ids))
    if not sampling.stop and not extra and not sampling.ignore_eos:
        return (
            f"standard decoding: greedy, ends at the end token {sorted(set(end_ids))} or {sampling.max_tokens} tokens"
        )
    parts = [f"stop strings {sampling.stop!r}"] if sampling.stop else []
    parts += [f"extra stop tokens {extra}"] if extra else []
    parts += ["ignore_eos"] if sampling.ignore_eos else []
    return f"NOT standard decoding: greedy with {', '.join(parts)}, <= {sampling.max_tokens} tokens"


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rows: list[dict]
    """One per response: greedy first (sample -1), then the sampled ones; see `response_rows`."""


def load_eval_set(
    data_path: str, max_prompt_length: int | None, max_prompts: int | None, extra_keys: Sequence[str] = ("labels",)
) -> EvalSet:
    """The first `max_prompts` prompts (all when None) of a preprocessed dataset that fit max_prompt_length."""
    from mindrl.data.prompt_dataset import PromptDataset

    ds = PromptDataset(data_path, max_prompt_length, tuple(extra_keys))
    n = len(ds) if max_prompts is None else min(max_prompts, len(ds))
    batch = ds.batch(list(range(n)))
    labels = [lab.tolist() for lab in batch.extras.get("labels", [])] or [[] for _ in range(n)]
    return EvalSet([p.tolist() for p in batch.prompts], labels, [int(i) for i in batch.indices])


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n] if n >= 1 else []


def is_correct(score: float | None) -> bool:
    """A verifier's pass: every registered verifier gives 1.0 for a right answer and <= 0 otherwise."""
    return score is not None and score > 0


def eval_metrics(rows: Sequence[Mapping], verifier_names: Sequence[str], n_samples: int) -> dict[str, float]:
    """val/* from the response rows (as written to the eval JSONL): over the greedy rows, val/<verifier>/mean (a
    response whose scoring did not finish counts 0), val/reward/mean (the weighted reward), with a reward model
    val/reward_model/score/mean (its raw score), and val/response_length/mean; over the sampled rows,
    val/<verifier>/pass@k per prompt, averaged (and val/reward_model/sampled_score/mean)."""
    greedy = [r for r in rows if r["sample"] < 0]
    out: dict[str, float] = {"val/num_prompts": float(len(greedy))}
    if not greedy:
        return out
    for name in verifier_names:
        out[f"val/{name}/mean"] = sum(r[name] or 0.0 for r in greedy) / len(greedy)
    out["val/reward/mean"] = sum(r["reward"] for r in greedy) / len(greedy)
    with_model = "reward_model_score" in greedy[0]
    if with_model:
        out["val/reward_model/score/mean"] = sum(r["reward_model_score"] for r in greedy) / len(greedy)
    out["val/response_length/mean"] = sum(r["response_length"] for r in greedy) / len(greedy)
    if n_samples:
        by_prompt: dict[int, list[Mapping]] = {}
        for r in rows:
            if r["sample"] >= 0:
                by_prompt.setdefault(r["index"], []).append(r)
        for name in verifier_names:
            for k in pass_ks(n_samples):
                values = [pass_at_k(len(s), sum(is_correct(r[name]) for r in s), k) for s in by_prompt.values()]
                out[f"val/{name}/pass@{k}"] = sum(values) / len(values)
        sampled = [r for s in by_prompt.values() for r in s]
        if with_model:
            out["val/reward_model/sampled_score/mean"] = sum(r["reward_model_score"] for r in sampled) / len(sampled)
        out["val/sampled_response_length/mean"] = sum(r["response_length"] for r in sampled) / len(sampled)
    return out


def response_rows(
    eval_set: EvalSet,
    samples: list[list[RolloutSample]],
    scores: Scores,
    verifier_names: Sequence[str],
    prompt_texts: Sequence[str],
    sample_ids: Sequence[int],
) -> list[dict]:
    """The JSONL rows of one generate call: prompts[i]'s responses, flattened in order; `sample_ids` says which
    sample each response of a prompt is (-1: greedy). With a reward model also its raw score and the scored tokens
    (`prompt_ids`, `response_ids`), as rollouts.jsonl has them."""
    rows, flat = [], 0
    for i, group in enumerate(samples):
        for j, s in enumerate(group):
            per = scores.per_verifier[flat]
            row = {
                "index": eval_set.indices[i],
                "sample": sample_ids[j],
                "prompt": prompt_texts[i],
                "response": scores.texts[flat],
                "label": scores.labels[flat],
                "reward": scores.rewards[flat],
                **{name: (None if per is None else per[k]) for k, name in enumerate(verifier_names)},
                "response_length": len(s.token_ids),
                "finish_reason": s.finish_reason,
            }
            if scores.model_scores is not None:
                row["reward_model_score"] = scores.model_scores[flat]
                row["prompt_ids"], row["response_ids"] = list(eval_set.prompts[i]), list(s.token_ids)
            rows.append(row)
            flat += 1
    return rows


def evaluate(
    eval_set: EvalSet,
    sampling: SamplingConfig,
    settings: EvalSettings,
    generate: GenerateFn,
    score: ScoreFn,
    tokenizer,
    model_score: ModelScoreFn | None = None,
) -> EvalResult:
    """Greedy responses (temperature 0, one per prompt) and, with settings.n_samples, that many sampled ones, scored
    with `score` (and the reward model, `model_score`, where given). `sampling`: the rollout's (max_tokens, stop
    tokens, top_p ...); its temperature and n are replaced."""
    t0 = time.perf_counter()
    seeds = [(settings.seed * 1_000_003 + 2 * i + 1) % (2**31) for i in eval_set.indices]  # odd: not training's
    prompt_texts = tokenizer.batch_decode(eval_set.prompts, skip_special_tokens=False)
    runs = [(dataclasses.replace(sampling, temperature=0.0, n=1, seed=None), [-1])]
    if settings.n_samples:
        sampled = dataclasses.replace(sampling, temperature=settings.temperature, n=settings.n_samples, seed=None)
        runs.append((sampled, list(range(settings.n_samples))))
    rows: list[dict] = []
    for params, sample_ids in runs:
        samples = generate(eval_set.prompts, params, seeds)
        responses = [list(s.token_ids) for group in samples for s in group]
        labels = [eval_set.labels[i] for i, group in enumerate(samples) for _ in group]
        scores = score(responses, labels)
        if model_score is not None:
            scores = model_score(
                [eval_set.prompts[i] for i, group in enumerate(samples) for _ in group], responses, scores
            )
        rows += response_rows(eval_set, samples, scores, settings.verifier_names, prompt_texts, sample_ids)
    metrics = eval_metrics(rows, settings.verifier_names, settings.n_samples)
    metrics["timing/eval"] = time.perf_counter() - t0
    return EvalResult(metrics, rows)


def write_rows(path: str, rows: Sequence[Mapping], **tags) -> None:
    """The rows as JSON lines (each with `tags`, e.g. iteration=10) to `path`, replaced whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({**tags, **row}, allow_nan=False) + "\n")
    os.replace(tmp, path)


def eval_file(run_dir: str, iteration: int) -> str:
    return os.path.join(run_dir, EVAL_DIR, f"iter_{iteration:07d}.jsonl")


class Evaluator:
    """The trainer's evaluation schedule and set: before training (iteration 0, `before_train`), every `interval`
    iterations, and at `last` (train_iters). Each evaluation's responses go to `eval_file(run_dir, iteration)`."""

    def __init__(
        self,
        eval_set: EvalSet,
        settings: EvalSettings,
        run_dir: str,
        interval: int | None,
        before_train: bool,
        last: int,
        protocol: str = "standard",
    ):
        self.eval_set, self.settings, self.run_dir = eval_set, settings, run_dir
        self.interval, self.before_train, self.last = interval or 0, before_train, last
        self.protocol = protocol

    @classmethod
    def from_config(cls, cfg, run_dir: str) -> Evaluator | None:
        """None when the config has no rl_config.val_data_path."""
        mt, rl = cfg.megatron_training, cfg.rl_config
        if not rl.val_data_path:
            return None
        eval_set = load_eval_set(
            rl.val_data_path, rl.max_prompt_length, rl.val_max_prompts, mt.dataset_additional_keys or ("labels",)
        )
        settings = EvalSettings(rl.verifiers, rl.val_n_samples, rl.val_temperature, mt.seed)
        return cls(eval_set, settings, run_dir, mt.eval_interval, rl.val_before_train, mt.train_iters, rl.val_protocol)

    def forget_after(self, iteration: int) -> None:
        """Remove the responses of evaluations after `iteration` (a resumed run's start; -1: a fresh run, all), as
        metrics.jsonl drops their rows: what the run dir shows is this run's."""
        folder = os.path.join(self.run_dir, EVAL_DIR)
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            stem = name.removeprefix("iter_").removesuffix(".jsonl")
            if name.startswith("iter_") and stem.isdigit() and int(stem) > iteration:
                os.remove(os.path.join(folder, name))

    def due(self, iteration: int) -> bool:
        """Whether the weights after `iteration` (0: the starting ones) are evaluated."""
        if iteration == 0:
            return self.before_train
        return iteration == self.last or (self.interval > 0 and iteration % self.interval == 0)

    def run(
        self,
        iteration: int,
        sampling: SamplingConfig,
        generate: GenerateFn,
        score: ScoreFn,
        tokenizer,
        model_score: ModelScoreFn | None = None,
    ) -> dict:
        """`sampling`: the rollout's; decoded by `self.protocol` (`protocol_sampling`)."""
        ends = end_token_ids(tokenizer)
        sampling = protocol_sampling(sampling, self.protocol, ends)
        logger.info("held-out evaluation at iteration %d, %s", iteration, protocol_label(sampling, ends))
        result = evaluate(self.eval_set, sampling, self.settings, generate, score, tokenizer, model_score)
        write_rows(eval_file(self.run_dir, iteration), result.rows, iteration=iteration)
        return result.metrics
