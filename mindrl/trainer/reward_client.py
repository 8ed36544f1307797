"""The driver's side of the rule-reward worker (a CPU Ray actor): start it, send it a batch, and supervise the call
(a worker that dies, hangs or outlives its samples' timeouts is replaced and that batch scores 0)."""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Sequence

from mindrl.trainer import leftovers
from mindrl.workers import reward_worker
from mindrl.workers.results import Scores

logger = logging.getLogger("mindrl.trainer")


class RewardClient:
    """One rule-reward worker at a time, with its temporary folder recorded in the run dir (`leftovers`)."""

    SLACK_S = 60.0
    """A rule-reward call may take this long beyond its samples' own timeouts before the worker counts as hung."""
    PING_S = 15.0
    """While a rule-reward call runs, the worker is pinged this often (and given as long to answer)."""
    EXIT_S = 5.0
    """At shutdown, how long the rule-reward worker's own exit may take to remove its temporary folder."""
    START_S = 300.0
    """A new rule-reward worker (a Ray worker process and its imports) may take this long to start; until
    it has started (its first ping answered), a missed ping means "still starting", not "hung". The worker has 2
    threads, so that first reply can come after later calls' replies: a worker that hangs before sending it counts as
    starting, and is replaced after this bound."""

    def __init__(self, settings: reward_worker.RewardSettings, run_dir: str, tokenizer):
        self.settings = settings
        self.run_dir = run_dir
        self.tokenizer = tokenizer  # decodes the responses and labels the worker scores
        self.actor = None
        self._start()

    def _start(self) -> None:
        import ray

        # 2 threads: `ping` is answered while `score` runs, so a hung worker is told from a slow batch.
        remote = ray.remote(num_cpus=0, max_concurrency=2)(reward_worker.RuleRewardWorker)
        self.actor = remote.remote(self.settings)
        self.started = self.actor.ping.remote()  # resolves once the actor's __init__ has returned
        self._temp = self.actor.temp_dir.remote()
        self._temp_recorded = False

    def score(self, responses: list[list[int]], labels: list[list[int]]):
        """Start scoring (responses and labels as token ids, decoded here); `collect` waits for it."""
        return self.actor.score.remote(*self._decode(responses, labels))

    def _decode(self, responses: Sequence[list[int]], labels: Sequence[list[int]]) -> tuple[list[str], list[str]]:
        decode = self.tokenizer.batch_decode
        return decode([list(r) for r in responses], skip_special_tokens=True), decode(
            [list(x) for x in labels], skip_special_tokens=True
        )

    def collect(self, ref, responses: Sequence[list[int]], labels: Sequence[list[int]], iteration: int) -> Scores:
        """The reward worker's answer. A worker that died, stops answering pings, or outlives the worst case of its
        samples' own timeouts (plus SLACK_S) is replaced; its samples score 0 and are counted in reward/crashes."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        s = self.settings
        deadline = self.SLACK_S + s.timeout * math.ceil(len(responses) / s.num_workers)
        t0 = time.perf_counter()
        while True:
            left = deadline - (time.perf_counter() - t0)
            try:
                scored = ray.get(ref, timeout=max(0.0, min(self.PING_S, left)))
            except RayActorError:
                what = "died"
                break
            except GetTimeoutError:
                if left <= self.PING_S:
                    what = f"did not answer within {deadline:.0f} s"
                    break
            else:
                self._record_temp()
                return scored
            if not ray.wait([self.started], timeout=0)[0]:
                # A replacement (or the first worker) still starting is not hung: wait for its start, which does
                # not count against the call's deadline.
                t_start = time.perf_counter()
                try:
                    ray.get(self.started, timeout=self.START_S)
                except RayActorError:
                    what = "died while starting"
                    break
                except GetTimeoutError:
                    what = f"did not start within {self.START_S:.0f} s"
                    break
                deadline += time.perf_counter() - t_start
                continue
            try:
                ray.get(self.actor.ping.remote(), timeout=self.PING_S)
            except (GetTimeoutError, RayActorError):
                what = f"stopped answering (no reply to a ping within {self.PING_S:.0f} s)"
                break
        logger.warning(
            "iteration %d: the rule-reward worker %s; it is replaced and this batch's %d samples score 0 "
            "(counted in reward/crashes)",
            iteration,
            what,
            len(responses),
        )
        self._kill()
        self._start()
        zeros = [0.0] * len(responses)
        texts, label_texts = self._decode(responses, labels)
        metrics = {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/crashes": float(len(responses))}
        metrics.update({"reward/worker_restarts": 1.0, "timing/rule_reward": time.perf_counter() - t0})
        metrics.update({f"reward/{name}/mean": 0.0 for name in s.verifier_function})
        return Scores(
            rewards=zeros,
            per_verifier=[None] * len(responses),
            texts=texts,
            labels=label_texts,
            metrics=metrics,
        )

    def _record_temp(self) -> None:
        """Once the (current) reward worker has answered: its temporary folder into TEMP_RECORD, for the next run
        should this driver be killed (`leftovers.remove_leftovers`)."""
        import ray

        if self._temp_recorded:
            return
        self._temp_recorded = True
        try:
            _, host, path = ray.get(self._temp, timeout=30)
        except Exception as e:  # died since it answered: the next call replaces it, and records the new one
            logger.warning("the rule-reward worker did not say where its temporary folder is: %s", e)
            return
        leftovers.record_temp(self.run_dir, host, path)

    def _kill(self, exiting: bool = False) -> None:
        """Kill the rule-reward worker and remove the multiprocessing folder it leaves behind in the temporary
        directory (killed, it runs no exit handler), when it ran on this node and had said where the folder is.
        exiting: the worker is ending through Python's exit (`shutdown`), whose handler removes the folder: wait a
        little for that first (removing it under the handler made the worker print a FileNotFoundError)."""
        import ray

        try:
            node, _, path = ray.get(self._temp, timeout=5)
        except Exception:  # it never answered (killed while starting): nothing known to remove
            node = path = None
        here = path is not None and node == ray.get_runtime_context().get_node_id()
        if here and exiting:
            until = time.monotonic() + self.EXIT_S
            while os.path.exists(path) and time.monotonic() < until:
                time.sleep(0.05)
        ray.kill(self.actor, no_restart=True)
        if path is None:
            return
        if here:
            shutil.rmtree(path, ignore_errors=True)
        leftovers.forget_temp(self.run_dir)

    def shutdown(self) -> None:
        """Let the worker exit (its exit handler removes its folder), then make sure it is gone."""
        import ray
        from ray.exceptions import RayActorError

        if self.actor is None:
            return
        exiting = False
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except RayActorError:  # the call ends with the actor's exit
            exiting = True
        except Exception:
            pass
        self._kill(exiting)
        self.actor = None
