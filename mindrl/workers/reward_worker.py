"""RuleRewardWorker: a CPU Ray actor that scores decoded responses with the rule verifiers (in its own process pool,
with per-sample timeouts), while the devices compute reference logprobs and values."""

from __future__ import annotations

import multiprocessing.util
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from mindrl.workers.results import Scores


@dataclass(frozen=True)
class RewardSettings:
    verifier_function: tuple[str, ...] = ("acc_for_ppo",)
    verifier_weight: tuple[float, ...] = (1.0,)
    timeout: float = 10.0
    num_workers: int = 1


class RuleRewardWorker:
    """Strings in, scores out: the driver decodes (it holds the tokenizer anyway), so this process imports neither
    torch nor transformers (some 370 MiB of a Ray worker's memory, docs/performance.md)."""

    def __init__(self, s: RewardSettings):
        from mindrl.rewards import get_shared_pool

        self.settings = s
        # multiprocessing's temporary folder (the verifier forkserver's socket goes there), made now, before the pool's
        # thread could make it too: a process killed instead of exiting leaves it, and `temp_dir` says where.
        self._temp_dir = multiprocessing.util.get_temp_dir()
        # Start the verifier processes now, so that they import and warm math-verify (~2 s) while the trainer's
        # workers build their models and engines, not in the first iteration's scoring. In a thread: the actor
        # answers no call (not even `ping`) until __init__ returns; `score` waits on the pool's lock meanwhile.
        threading.Thread(target=get_shared_pool, args=(s.num_workers,), name="verifier-pool-start", daemon=True).start()

    def score(self, texts: Sequence[str], label_texts: Sequence[str]) -> Scores:
        """Rewards (per response), scores per verifier, the texts and labels, and metrics; texts[i] pairs with
        label_texts[i] (the decoded responses and reference answers)."""
        from mindrl.rewards import score_rule_rewards

        s = self.settings
        texts, label_texts = list(texts), list(label_texts)
        scores = score_rule_rewards(
            texts,
            label_texts,
            list(s.verifier_function),
            list(s.verifier_weight),
            timeout=s.timeout,
            num_workers=s.num_workers,
        )
        return Scores(scores.rewards, scores.per_verifier, texts, label_texts, scores.metrics)

    def temp_dir(self) -> tuple[str, str, str]:
        """(Ray node id, host name, path) of this process's multiprocessing temporary folder: the trainer removes it
        after killing this worker (a killed process runs no exit handler), where it runs on the same node, and
        records it in the run dir for the next run, should the driver itself be killed."""
        import socket

        import ray

        return ray.get_runtime_context().get_node_id(), socket.gethostname(), self._temp_dir

    def ping(self) -> bool:
        """Answered while `score` runs (the actor has 2 threads): a worker that does not answer is hung."""
        return True

    def shutdown(self) -> None:
        """Stop the verifier processes, then end this actor through Python's exit (the caller sees the actor die, not
        a return value). A killed actor skips its exit handlers, so multiprocessing's temporary folder, which holds
        the verifier forkserver's socket, would be left in /tmp after every run."""
        import ray

        from mindrl.rewards import shutdown_shared_pool

        shutdown_shared_pool()
        ray.actor.exit_actor()
