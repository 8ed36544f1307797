"""ReferenceWorker: the reference model alone on its own bundles (separate placement, docs/placement.md), forward
only at the actor's TP x PP x CP, giving the same reference logprobs as IntegratedWorker's copy."""

from __future__ import annotations

import time

from mindrl.batch import Batch
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.rank import MegatronRank, RankInfo
from mindrl.workers.results import LogProbs
from mindrl.workers.settings import IntegratedSettings


class ReferenceWorker(MegatronRank):
    def setup(self, s: IntegratedSettings) -> RankInfo:
        """`s`: the actor's settings (the reference takes its layout, micro-batching and temperature)."""
        from mindrl.checkpoint.loading import build_and_load
        from mindrl.resharding import OffloadConfig, TrainStateOffloader
        from mindrl.workers.profiling import StageProfiler

        if s.ref_load is None:
            raise ValueError("a ReferenceWorker needs IntegratedSettings.ref_load (the run has no KL term)")
        a = s.actor
        self.settings = s
        self.profiler = StageProfiler(s.profile, self.rank)
        info = self.init_layout(a.tp, a.pp, a.seed, a.cp)
        _, _, self.ref = build_and_load(
            s.ref_load, a.tp, a.pp, a.dtype, cp=a.cp, ep=a.ep, layers_per_stage=a.layers_per_stage
        )
        self.ref.eval()
        self.offloader = TrainStateOffloader([self.ref], None, OffloadConfig(offload_train_param=True))
        self.offloader.place(s.residency.on_entry("reference", "rollout"))
        return info

    def _offloaders(self) -> dict:
        return {"reference": self.offloader}

    @register(Dispatch.DP_ROWS)
    def compute_log_prob(self, shard: Batch | None, reference: bool = True) -> LogProbs | None:
        """This DP shard's response logprobs under the reference model (`reference` must be True: the signature is
        IntegratedWorker's, so the trainer calls either the same way)."""
        from mindrl.workers.rl_model import response_logprobs

        if not reference:
            raise RuntimeError("the reference group computes reference logprobs only; old logprobs are the actor's")
        shard = self.receive(shard)
        t0 = time.perf_counter()
        s = self.settings
        with self.profiler.stage("reference_compute_log_prob"), self.offloader.holding(["param"], read_only=True):
            lp = response_logprobs(self.ref, shard, s.ref_micro_batching(), s.loss.temperature)
            self._note_held()
        return self.output(LogProbs(lp, time.perf_counter() - t0))
