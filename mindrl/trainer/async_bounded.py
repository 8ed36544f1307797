"""rl_config.async_mode bounded in mindrl-train: the batches come from samplers over ZeroMQ (`Intake`), the actor's
weights are published every weight_sync_interval updates, and the prompt ledger goes into the checkpoint."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mindrl.batch import Batch
from mindrl.data.prompt_dataset import PromptBatch, PromptDataset
from mindrl.data.prompt_ledger import PromptLedger
from mindrl.serving.transport import TrainerEnd, ZmqTrainerEnd
from mindrl.trainer.async_intake import Intake, make_batch

logger = logging.getLogger(__name__)


@dataclass
class Bounded:
    """The trainer's end of `bounded`: `take` the next batch for an update, `publish` weights on cadence."""

    end: TrainerEnd
    intake: Intake
    sync_interval: int
    published: int | None = None
    """The newest weight version published (None: none yet; samplers wait for one)."""

    def take(
        self, version: int, dataset: PromptDataset, n: int, pad_token_id: int | None
    ) -> tuple[PromptBatch, Batch, dict[str, float]]:
        """The prompts (dataset rows, with their labels) and RL batch of the next `intake.groups` groups for the
        update of weight version `version`, with the batch's async/* metrics."""
        groups, metrics = self.intake.take(version)
        rows = [g[0].prompt_index for g in groups]
        prompts = dataset.batch(rows)
        for g, p in zip(groups, prompts.prompts):
            if g[0].prompt_ids.astype("int64").tolist() != p.tolist():
                raise ValueError(
                    f"sampler {g[0].sampler_id!r} sent prompt_index {g[0].prompt_index} whose prompt differs from "
                    "that row of megatron_training.data_path: samplers and trainer must read the same dataset with "
                    "the same max_prompt_length"
                )
        return prompts, make_batch(groups, n, pad_token_id), metrics

    def due(self, version: int) -> bool:
        """Whether weight version `version` (after that many updates) is published."""
        return self.published is None or version % self.sync_interval == 0

    def publish(self, version: int, tensors) -> None:
        self.end.publish_weights(version, tensors)
        self.published = version

    def state_dict(self) -> dict:
        return {"ledger": self.end.ledger_state()}

    def load_state_dict(self, state: dict) -> None:
        """The ledger of a checkpoint; the previous run's samplers are declared dead, so the prompts they held are
        re-issued (a group they deliver late still counts once)."""
        self.end.restore_ledger(state["ledger"])

    def close(self) -> None:
        self.end.close()


def bounded(cfg, num_prompts: int) -> Bounded | None:
    """The trainer's end of `cfg`'s bounded mode (binds the ZeroMQ ports), or None in the other modes."""
    mt, rl = cfg.megatron_training, cfg.rl_config
    if rl.async_mode != "bounded":
        return None
    ledger = PromptLedger(num_prompts, seed=mt.seed, shuffle=not mt.no_shuffle)
    end = ZmqTrainerEnd(ledger, rl.async_host, rl.async_data_port, rl.async_sync_port)
    # samplers run at most max_staleness batches ahead of what the trainer has received (one at max_staleness 0)
    end.max_in_flight = mt.global_batch_size * max(1, rl.max_staleness)
    logger.info("bounded: samplers connect to data %s, sync %s", end.data_address, end.sync_address)
    intake = Intake(end, mt.global_batch_size, rl.max_staleness, timeout_s=rl.async_timeout_s)
    return Bounded(end, intake, rl.weight_sync_interval)


def trainer_state(b: Bounded | None) -> dict:
    """TrainerState's async fields for bounded's end `b` (None: another mode, nothing of bounded's)."""
    return {} if b is None else {"async_rollout": {"bounded": b.state_dict()}}


def restore(b: Bounded | None, state) -> None:
    """The prompt ledger of a checkpoint's TrainerState `state` back into `b` (a checkpoint from another mode has
    none: the ledger starts at epoch 0)."""
    saved = (state.async_rollout or {}).get("bounded")
    if b is not None and saved is not None:
        b.load_state_dict(saved)
