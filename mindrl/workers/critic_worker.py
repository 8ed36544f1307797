"""CriticWorker: the value model, a second process per device on the same placement-group bundles as the
integrated worker, with its own megatron world; on the device in the phases its `ResidencySchedule` says."""

from __future__ import annotations

import time

from mindrl.batch import Batch
from mindrl.workers.dispatch import Dispatch, register
from mindrl.workers.rank import MegatronRank, RankInfo
from mindrl.workers.results import UpdateResult, Values
from mindrl.workers.settings import CriticSettings


class CriticWorker(MegatronRank):
    def setup(self, s: CriticSettings) -> RankInfo:
        from mindrl.resharding import OffloadConfig, TrainStateOffloader

        c = s.critic
        info, self.critic = self._setup_trained(s, c)
        if getattr(self.critic.module, "mindrl_role", None) != "critic":
            raise ValueError(
                f"critic_config.load {c.load!r} holds an actor (LM head), not a critic: convert the reward model "
                "with `mindrl-convert hf2mcore --orm`"
            )
        self.offloader = TrainStateOffloader([self.critic], self.optimizer, OffloadConfig(True, True, True))
        self.offloader.place(s.residency.on_entry("critic", "rollout"))
        return info

    def _offloaders(self) -> dict:
        return {"critic": self.offloader}

    @register(Dispatch.DP_ROWS)
    def compute_values(self, shard: Batch | None) -> Values | None:
        from mindrl.workers.rl_model import response_values

        shard = self.receive(shard)
        t0 = time.perf_counter()
        with self.profiler.stage("critic_compute_values"), self.offloader.holding(["param"], read_only=True):
            values = response_values(self.critic, shard, self.settings.critic.micro_batching(True))
            self._note_held()
        return self.output(Values(values, time.perf_counter() - t0))

    @register(Dispatch.DP_OUTPUT)
    def update_critic(self, shard: Batch | None, num_mini_batches: int, epochs: int) -> UpdateResult | None:
        shard = self.receive(shard)
        with self.profiler.stage("critic_update"), self.offloader.holding():
            result = self._ppo_update(self.critic, shard, "critic", self.settings.critic, num_mini_batches, epochs)
            self._note_held()
        return self.output(result)

    @register(Dispatch.ALL)
    def save(self, it_dir: str, optim: bool, rng: bool) -> None:
        from mindrl.checkpoint.train_state import save_train_state

        c = self.settings.critic
        with self.offloader.holding():
            save_train_state(self.critic, self.optimizer, self.scheduler, self.spec, "critic", c, it_dir, optim, rng)
