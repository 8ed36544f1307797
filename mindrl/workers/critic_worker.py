"""CriticWorker: the value model, a second process per device on the same placement-group bundles as the
integrated worker, with its own megatron world; offloaded between its own phases."""

from __future__ import annotations

import time

from mindrl.batch import Batch
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.profiling import StageProfiler
from mindrl.workers.rank import MegatronRank, RankInfo
from mindrl.workers.results import UpdateResult, Values
from mindrl.workers.settings import CriticSettings


class CriticWorker(MegatronRank):
    def setup(self, s: CriticSettings) -> RankInfo:
        from mindrl.checkpoint.train_state import load_train_state
        from mindrl.resharding import OffloadConfig, TrainStateOffloader
        from mindrl.workers.train_setup import build_model_and_optimizer

        c = s.critic
        self.settings = s
        self.profiler = StageProfiler(s.profile, self.rank)
        info = self.init_layout(c.tp, c.pp, c.seed)
        self.spec, self.critic, self.optimizer, self.scheduler = build_model_and_optimizer(
            c.load, c.tp, c.pp, c.optim, c.total_steps, c.dtype, c.sequence_parallel, c.load_iteration
        )
        if c.resume_dir is not None:
            load_train_state(self.critic, self.optimizer, self.scheduler, c.resume_dir, c.load_optim, c.load_rng)
        if getattr(self.critic.module, "mindrl_role", None) != "critic":
            raise ValueError(
                f"critic_config.load {c.load!r} holds an actor (LM head), not a critic: convert the reward model "
                "with `mindrl-convert hf2mcore --orm`"
            )
        self.offloader = TrainStateOffloader([self.critic], self.optimizer, OffloadConfig(True, True, True))
        self._offload()
        return info

    def _offload(self) -> None:
        if self.settings.offload:
            self.offloader.offload()

    def _onload(self) -> None:
        if self.settings.offload:
            self.offloader.onload()

    @register(Dispatch.DP_ROWS)
    def compute_values(self, shard: Batch | None) -> Values | None:
        from mindrl.workers.rl_model import response_values

        shard = self.receive(shard)
        t0 = time.perf_counter()
        with self.profiler.stage("critic_compute_values"):
            self._onload()
            try:
                values = response_values(self.critic, shard, self.settings.critic.forward_micro_batch_size)
            finally:
                self._offload()
        return self.output(Values(values, time.perf_counter() - t0))

    @register(Dispatch.DP_OUTPUT)
    def update_critic(self, shard: Batch | None, num_mini_batches: int, epochs: int) -> UpdateResult | None:
        from mindrl.workers.rl_model import ppo_update

        shard = self.receive(shard)
        s = self.settings
        with self.profiler.stage("critic_update"):
            self._onload()
            try:
                result = ppo_update(
                    self.critic,
                    self.optimizer,
                    self.scheduler,
                    shard,
                    "critic",
                    s.loss,
                    s.critic.micro_batch_size,
                    num_mini_batches,
                    epochs,
                )
            finally:
                self._offload()
        return self.output(result)

    @register(Dispatch.ALL)
    def save(self, it_dir: str, optim: bool, rng: bool) -> None:
        from mindrl.checkpoint.train_state import save_train_state

        self._onload()
        try:
            c = self.settings.critic
            save_train_state(self.critic, self.optimizer, self.scheduler, self.spec, "critic", c, it_dir, optim, rng)
        finally:
            self._offload()
