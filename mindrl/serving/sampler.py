"""An asynchronous sampler: leases prompts from the trainer, generates with the newest weights it has and sends each
prompt's group as experiences, over a transport's `SamplerEnd`. The trainer scores them (one place applies
rl_config's verifiers, weights and timeouts)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mindrl.data.prompt_ledger import Lease
from mindrl.rollout.base import RolloutEngine, SamplingConfig
from mindrl.serving.experience import FINISH_REASONS, GEN_SECONDS, REF_SECONDS, RUN_ID, Experience
from mindrl.serving.transport import SamplerEnd

PromptSource = Callable[[int], Sequence[int]]
"""dataset index -> prompt token ids."""
Reference = Callable[[Sequence[int], Sequence[Sequence[int]]], list[np.ndarray]]
"""(prompt ids, one group's response ids) -> per response, its tokens' reference logprobs (`HFReference.logprobs`)."""


@dataclass
class Sampler:
    sampler_id: str
    end: SamplerEnd
    engine: RolloutEngine
    prompts: PromptSource
    sampling: SamplingConfig
    seed: int = 0
    lease_size: int = 1
    timeout_s: float = 60.0
    version: int | None = None
    """The weight version the engine holds (None: none fetched yet; nothing is generated before)."""
    run_id: str | None = None
    """The run id of the trainer that published those weights (stamped on each group)."""
    unsent: list = field(default_factory=list)
    """Groups generated but not yet sent (their send timed out): sent first in the next round."""
    reference: Reference | None = None
    """The reference model (rl_config.async_sampler_ref): each experience carries its response's reference logprobs
    and each group's meta its seconds (REF_SECONDS); None: the trainer computes them."""

    def sync_weights(self) -> bool:
        """Load the trainer's newest weights if they are not the engine's version and run (older ones too: a trainer
        resumed from a checkpoint replaces the weights of the run before); True if it did."""
        update = self.end.fetch_weights(self.version, timeout_s=self.timeout_s, have_run=self.run_id)
        if update is None:
            return False
        self.engine.load_weights(update.tensors.items())
        self.version, self.run_id = update.version, update.run_id
        return True

    def seed_of(self, lease: Lease) -> int:
        """The prompt's sampling seed: from (seed, epoch, prompt) only, so it does not depend on which sampler got
        the lease or when."""
        return (self.seed * 1_000_003 + lease.epoch * 7919 + lease.prompt_index * self.sampling.n) % (2**31)

    def step(self) -> int:
        """One round: newest weights, up to lease_size prompts, generated together in one engine call and sent
        (blocking while the trainer's queue is full). Returns the groups sent (0: nothing published or nothing to
        lease). A send that times out raises TransportTimeout; its group and those after it are kept (`unsent`) and
        sent first next round, so no leased prompt is lost while the trainer is away."""
        self.sync_weights()
        if self.version is None:
            return 0
        sent = self._flush()  # raises while the trainer is still not reading: no new leases meanwhile
        leases = self.end.lease(self.lease_size, timeout_s=self.timeout_s)
        if leases:
            self.unsent.extend(self.sample_many(leases))
            sent += self._flush()
        return sent

    def _flush(self) -> int:
        sent = 0
        while self.unsent:
            self.end.send(self.unsent[0], timeout_s=self.timeout_s)
            self.unsent.pop(0)
            sent += 1
        return sent

    def sample_many(self, leases: Sequence[Lease]) -> list[list[Experience]]:
        """Per leased prompt, its group's experiences, all generated in one engine call with the current weights (each
        prompt with its own seed, so a group does not depend on which prompts shared the call). Each group's meta
        carries its share of the call's seconds, so a sampler's tokens/s sums to the call's."""
        prompts = [self.prompts(lease.prompt_index) for lease in leases]
        t0 = time.perf_counter()
        outs = self.engine.generate([list(ids) for ids in prompts], self.sampling,
                                    seeds=[self.seed_of(lease) for lease in leases])  # fmt: skip
        gen_s = (time.perf_counter() - t0) / len(leases)
        meta = {GEN_SECONDS: gen_s, **({RUN_ID: self.run_id} if self.run_id else {})}
        refs: list[list] = [[None] * len(samples) for samples in outs]
        metas = [dict(meta) for _ in outs]
        if self.reference is not None:  # one forward per group
            for k, (ids, samples) in enumerate(zip(prompts, outs)):
                t1 = time.perf_counter()
                refs[k] = self.reference(list(ids), [list(s.token_ids) for s in samples])
                metas[k][REF_SECONDS] = time.perf_counter() - t1
        return [
            [
                Experience(
                    prompt_ids=list(ids),
                    response_ids=list(s.token_ids),
                    behaviour_logprobs=np.asarray(s.logprobs, dtype=np.float64),
                    ref_logprobs=ref,
                    rewards={},  # the trainer scores
                    finish_reason=s.finish_reason if s.finish_reason in FINISH_REASONS else "abort",
                    prompt_index=lease.prompt_index,
                    epoch=lease.epoch,
                    sampler_id=self.sampler_id,
                    weight_version=self.version,
                    meta=dict(group_meta),
                )
                for s, ref in zip(samples, group_ref)
            ]
            for lease, ids, samples, group_ref, group_meta in zip(leases, prompts, outs, refs, metas)
        ]

    def run(self, stop: threading.Event, idle_s: float = 0.05) -> None:
        """step() until `stop` is set; idles `idle_s` between empty rounds."""
        while not stop.is_set():
            if self.step() == 0:
                stop.wait(idle_s)
