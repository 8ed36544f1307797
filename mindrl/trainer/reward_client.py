"""The driver's rule rewards: the verifier pool (its own processes, per-sample timeouts) run from a background thread
of the driver, so that scoring overlaps the reference / value forwards."""

from __future__ import annotations

import logging
import multiprocessing.util
import socket
import threading
import time
from collections.abc import Sequence

from mindrl.rewards import RewardSettings, get_shared_pool, score_rule_rewards, shutdown_shared_pool
from mindrl.rewards.verifiers import scored_inline, uses_math
from mindrl.trainer import leftovers
from mindrl.workers.results import Scores

logger = logging.getLogger("mindrl.trainer")


class PendingScores:
    """One batch being scored in a background thread (`RewardClient.score`); `RewardClient.collect` waits for it."""

    def __init__(self, settings: RewardSettings, texts: list[str], label_texts: list[str]) -> None:
        self.texts, self.label_texts = texts, label_texts
        self._settings = settings
        self._result: Scores | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rule-rewards", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        s = self._settings
        if not s.verifier_function:  # rule_reward false: the reward model alone gives the reward, mixed in later
            metrics = {k: 0.0 for k in ("reward/timeouts", "reward/errors", "reward/crashes", "timing/rule_reward")}
            zeros = [0.0] * len(self.texts)
            self._result = Scores(zeros, [[] for _ in self.texts], self.texts, self.label_texts, metrics)
            return
        try:
            scores = score_rule_rewards(
                self.texts,
                self.label_texts,
                list(s.verifier_function),
                list(s.verifier_weight),
                timeout=s.timeout,
                num_workers=s.num_workers,
            )
            self._result = Scores(scores.rewards, scores.per_verifier, self.texts, self.label_texts, scores.metrics)
        except BaseException as e:  # handed to the driver's thread by `wait`
            self._error = e

    def wait(self) -> Scores:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class RewardClient:
    """Rule rewards from the driver's process. The pool's processes enforce the per-sample timeouts (a sample past its
    deadline, or whose process dies, scores 0 and its process is replaced), so nothing here supervises them. The
    multiprocessing folder the pool's forkserver keeps its socket in is recorded in the run dir (`leftovers`), for
    the next run to remove should this driver be killed."""

    def __init__(self, settings: RewardSettings, run_dir: str, tokenizer) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.tokenizer = tokenizer  # decodes the responses and labels the verifiers score
        self.closed = False
        # made now, in this thread: the pool's start below would make it too, in another
        leftovers.record_temp(run_dir, socket.gethostname(), multiprocessing.util.get_temp_dir())
        # The verifier processes import and warm math-verify (~2 s) while the trainer's workers build their models
        # and engines, not in the first iteration's scoring; the first `score` waits on the pool's lock meanwhile.
        self._starting = threading.Thread(target=self._start_pool, name="verifier-pool-start", daemon=True)
        self._starting.start()

    def _start_pool(self) -> None:
        if not self.settings.verifier_function:  # rule_reward false: no verifier runs
            return
        if scored_inline(self.settings.verifier_function):
            return  # scored in this process: no pool (`score_rule_rewards`)
        try:
            get_shared_pool(self.settings.num_workers, math_verifiers=uses_math(self.settings.verifier_function))
        except Exception as e:  # the first `score` meets it again, and `collect` raises it
            logger.warning("the rule-reward verifier pool did not start: %s", e)

    def score(self, responses: list[list[int]], labels: list[list[int]]) -> PendingScores:
        """Start scoring (responses and labels as token ids, decoded here) in the background; `collect` waits for it."""
        return PendingScores(self.settings, *self._decode(responses, labels))

    def _decode(self, responses: Sequence[list[int]], labels: Sequence[list[int]]) -> tuple[list[str], list[str]]:
        decode = self.tokenizer.batch_decode
        return decode([list(r) for r in responses], skip_special_tokens=True), decode(
            [list(x) for x in labels], skip_special_tokens=True
        )

    def collect(self, pending: PendingScores, iteration: int) -> Scores:
        """The batch's Scores. Samples that timed out or whose process died score 0 and are counted in
        reward/timeouts and reward/crashes; an error of the pool itself (a verifier process that cannot start)
        ends the run with its message."""
        t0 = time.perf_counter()
        scored = pending.wait()
        waited = time.perf_counter() - t0
        if scored.metrics.get("reward/worker_restarts"):
            logger.warning(
                "iteration %d: %d rule-reward verifier process(es) replaced (%d samples timed out, %d crashed: they "
                "score 0); waited %.1f s for the scores",
                iteration,
                int(scored.metrics["reward/worker_restarts"]),
                int(scored.metrics["reward/timeouts"]),
                int(scored.metrics["reward/crashes"]),
                waited,
            )
        return scored

    def shutdown(self) -> None:
        """Stop the verifier processes (a scoring call in flight ends within half a second) and forget the record
        of the temporary folder, which multiprocessing removes when this process exits."""
        if self.closed:
            return
        self.closed = True
        self._starting.join(timeout=60)  # a pool it would make after this would outlive the shutdown
        shutdown_shared_pool()
        leftovers.forget_temp(self.run_dir)
