"""Benchmark rule-reward scoring: N typical R1-style responses scored with `acc` and `math_verify`
through compute_rule_rewards (process pool), against math-verify called directly in one process;
and answer extraction on pathological text at two sizes (the speed claims the tests leave out)."""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time

# the pathological inputs are the tests' own (tests/rewards), so the bench measures what they bound
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (gold, [equivalent ways a model writes it]) for the answer forms of MATH/GSM8K-style data; the
# weights below follow their rough mix (mostly integers), since parse cost differs 50x between forms
ANSWER_FORMS = [
    (lambda r: (f"\\frac{{{r}}}{{{r + 1}}}", [f"\\dfrac{{{r}}}{{{r + 1}}}", f"{r}/{r + 1}"])),
    (lambda r: (f"{r}", [f"{r}", f"{r}.0", f"{r:,}" if r >= 1000 else f"{r}"])),
    (lambda r: (f"{r}.5", [f"{r}.5", f"\\frac{{{2 * r + 1}}}{{2}}"])),
    (lambda r: (f"{r}\\sqrt{{2}}", [f"{r}\\sqrt{{2}}", f"\\sqrt{{{2 * r * r}}}"])),
    (lambda r: (f"[{r}, {r + 3})", [f"[{r},{r + 3})", f"\\left[{r}, {r + 3}\\right)"])),
    (lambda r: (f"\\{{{r}, {r + 1}\\}}", [f"\\{{{r + 1}, {r}\\}}"])),
    (lambda r: (f"{r}\\%", [f"{r}\\%", f"{r}"])),
    (lambda r: (f"{r}", [f"{r} \\text{{ cm}}", f"\\text{{{r}}}"])),
    (lambda r: ("ABCD"[r % 4], ["ABCD"[r % 4], f"({'ABCD'[r % 4]})", f"\\text{{{'ABCD'[r % 4]}}}"])),
    (lambda r: (f"x^2 + {2 * r}x + {r * r}", [f"(x+{r})^2", f"x^2+{2 * r}x+{r * r}"])),
]
# fraction, integer, decimal, sqrt, interval, set, percent, units/text, multiple choice, polynomial
FORM_WEIGHTS = [15, 45, 5, 7, 3, 3, 4, 5, 8, 5]

SENTENCES = [
    "First, we rewrite the expression so that the common factor {a} appears explicitly.",
    "Substituting x = {a} into the second equation gives {b}.",
    "Next, note that {a} + {b} = {c}, which simplifies the sum.",
    "We check the boundary case where n = {a}; the inequality still holds.",
    "Multiplying both sides by {b} and collecting terms yields {c}.",
    "So the remainder when dividing by {a} is {b}, as expected.",
    "Finally, we verify the candidate against the original constraint.",
    "Hmm, wait, let me double-check the arithmetic: {a} * {b} = {c}.",
]


def make_batch(n: int, samples_per_prompt: int, seed: int) -> tuple[list[str], list[str]]:
    """n responses in groups of samples_per_prompt sharing one gold answer; about half correct (in
    varied but equivalent forms), a third wrong, the rest without a final answer."""
    rng = random.Random(seed)
    responses, labels = [], []
    while len(responses) < n:
        r = rng.randint(2, 2_000)
        form = rng.choices(ANSWER_FORMS, weights=FORM_WEIGHTS)[0]
        gold, equivalents = form(r)
        # a wrong answer usually has the same shape as the right one
        _, wrong = form(r + rng.randint(1, 50))
        for _ in range(samples_per_prompt):
            steps = " ".join(
                rng.choice(SENTENCES).format(a=rng.randint(1, 999), b=rng.randint(1, 999), c=rng.randint(1, 9999))
                for _ in range(rng.randint(8, 20))
            )
            roll = rng.random()
            if roll < 0.5:
                tail = f"<answer>The final answer is \\boxed{{{rng.choice(equivalents)}}}.</answer>"
            elif roll < 0.85:
                tail = f"<answer>The final answer is \\boxed{{{rng.choice(wrong)}}}.</answer>"
            else:
                tail = "<answer>I could not finish the computation."
            responses.append(f"<think>{steps}</think>\n{tail}")
            labels.append(gold)
    return responses[:n], labels[:n]


def peer_math_verify(responses: list[str], labels: list[str]) -> list[float]:
    """The baseline: math-verify called directly in this process, one sample after another, with its
    own default (signal-based) timeouts, as a single-process reward function would do."""
    from math_verify import parse, verify

    return [1.0 if verify(parse(f"${label}$"), parse(response)) else 0.0 for response, label in zip(responses, labels)]


def bench_extraction(repeats: int, sizes: tuple[int, int] = (20_000, 200_000)) -> None:
    """Median CPU time of the four extraction checks on each pathological text family at two sizes."""
    from tests.rewards.test_extract import PATHOLOGICAL, _extract_all

    small, large = sizes
    header = f"{'extraction input':<18}{f'{small} chars ms':>18}{f'{large} chars ms':>18}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, make in sorted(PATHOLOGICAL.items()):
        medians = []
        for size in sizes:
            text, times = make(size), []
            for _ in range(repeats):
                t0 = time.process_time()
                _extract_all(text)
                times.append(time.process_time() - t0)
            medians.append(statistics.median(times))
        ratio = medians[1] / medians[0] if medians[0] > 0 else float("nan")
        print(f"{name:<18}{medians[0] * 1e3:>18.3f}{medians[1] * 1e3:>18.3f}{ratio:>8.1f}")
    print(f"(median of {repeats} runs, CPU time; linear scans give a ratio near {large // small})\n")


def bench_pathological(repeats: int, workers: int) -> None:
    """Median wall time of each pathological response through the pool, all verifiers, 10 s timeout."""
    from mindrl.rewards import score_rule_rewards
    from tests.rewards.test_scoring import ALL, PATHOLOGICAL

    header = f"{'pathological (pool)':<20}{'median s':>10}{'max s':>8}{'timed out':>11}"
    print(header)
    print("-" * len(header))
    for name, (response, label, _) in sorted(PATHOLOGICAL.items()):
        times, timeouts = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            scores = score_rule_rewards([response], [label], ALL, [1.0] * len(ALL), timeout=1.0, num_workers=workers)
            times.append(time.perf_counter() - t0)
            timeouts += int(scores.metrics["reward/timeouts"])
        print(f"{name:<20}{statistics.median(times):>10.3f}{max(times):>8.3f}{timeouts:>11}")
    print(f"(median of {repeats} runs, 1 s timeout, {workers} workers)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite",
        choices=("all", "scoring", "extraction"),
        default="all",
        help="scoring: batches through the pool vs in-process math-verify; extraction: pathological inputs "
        "(in-process extraction at two sizes, and through the pool); default all",
    )
    parser.add_argument("--n", type=int, default=2000, help="responses per batch (default 2000)")
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="responses sharing one label (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row; the median is reported (default 5)")
    parser.add_argument("--workers", type=int, default=2, help="verifier pool processes (default 2)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-sample timeout in seconds (default 10)")
    parser.add_argument("--no-peer", action="store_true", help="skip the in-process math-verify baseline")
    args = parser.parse_args()

    from mindrl.rewards import compute_rule_rewards, get_shared_pool, shutdown_shared_pool

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    if args.suite in ("all", "extraction"):
        bench_extraction(args.repeats)
        bench_pathological(args.repeats, args.workers)
        if args.suite == "extraction":
            shutdown_shared_pool()
            return
    start = time.perf_counter()
    get_shared_pool(args.workers, math_verifiers=True)  # as the trainer starts it for acc / math_verify
    compute_rule_rewards(["\\boxed{1}"] * args.workers, ["1"] * args.workers, ["acc"], [1.0], num_workers=args.workers)
    startup = time.perf_counter() - start

    # every timed run scores a fresh batch (new seed), so no cache carries answers between runs
    rows = []
    for names in (["acc"], ["math_verify"], ["acc", "math_verify"]):
        times, timeouts, means = [], 0.0, []
        for rep in range(args.repeats):
            responses, labels = make_batch(args.n, args.samples_per_prompt, seed=1000 * len(rows) + rep)
            t0 = time.perf_counter()
            _, metrics = compute_rule_rewards(
                responses, labels, names, [1.0] * len(names), timeout=args.timeout, num_workers=args.workers
            )
            times.append(time.perf_counter() - t0)
            timeouts += metrics["reward/timeouts"] + metrics["reward/crashes"] + metrics["reward/errors"]
            means.append(metrics[f"reward/{names[-1]}/mean"])
        rows.append((f"pool[{args.workers}] " + "+".join(names), times, timeouts, statistics.fmean(means)))
    if not args.no_peer:
        times, means = [], []
        for rep in range(args.repeats):
            responses, labels = make_batch(args.n, args.samples_per_prompt, seed=1000 * 1 + rep)
            t0 = time.perf_counter()
            scores = peer_math_verify(responses, labels)
            times.append(time.perf_counter() - t0)
            means.append(statistics.fmean(scores))
        rows.append(("peer: math_verify in-process", times, float("nan"), statistics.fmean(means)))
    shutdown_shared_pool()

    print(f"pool startup (first call, {args.workers} workers): {startup:.2f}s")
    print(f"{args.n} responses per run, {args.repeats} runs, median reported\n")
    header = f"{'scorer':<34}{'median s':>10}{'min s':>8}{'max s':>8}{'resp/s':>10}{'failed':>8}{'mean score':>12}"
    print(header)
    print("-" * len(header))
    rates = {}
    for label, times, failed, mean in rows:
        median = statistics.median(times)
        rates[label] = args.n / median
        failed_text = "-" if failed != failed else f"{int(failed)}"
        print(
            f"{label:<34}{median:>10.3f}{min(times):>8.3f}{max(times):>8.3f}{rates[label]:>10.0f}"
            f"{failed_text:>8}{mean:>12.3f}"
        )
    if not args.no_peer:
        pool_mv = rates[f"pool[{args.workers}] math_verify"]
        print(f"\npool math_verify vs peer: {pool_mv / rates['peer: math_verify in-process']:.2f}x")


if __name__ == "__main__":
    main()
