"""A sampler built from a `SamplerSpec` (the dataset's rows as prompts), and the Ray
actor that runs one inside the trainer's cluster on the Ray transport (rl_config.async_samplers)."""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import asdict, dataclass

from mindrl.serving.sampler import Sampler
from mindrl.serving.transport import SamplerEnd, TransportTimeout

logger = logging.getLogger(__name__)


@dataclass
class SamplerSpec:
    """What a sampler generates from: `model` (HF dir: config and tokenizer; the weights come from the trainer),
    the preprocessed dataset at `data_path`, and how it samples (the trainer scores the responses)."""

    model: str
    data_path: str
    max_prompt_length: int
    n: int
    max_tokens: int
    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    lease_size: int = 1
    timeout_s: float = 120.0
    ref_model: str | None = None
    """HF dir of the reference model: the sampler computes each response's reference logprobs (None: it does not)."""


def build_sampler(sampler_id: str, end: SamplerEnd, spec: SamplerSpec):
    """(the Sampler, its engine) of `spec` on the transport end `end`. Raises ValueError / FileNotFoundError for a
    dataset that cannot be read."""
    from mindrl.data.prompt_dataset import PromptDataset
    from mindrl.rollout import RolloutConfig, SamplingConfig

    dataset = PromptDataset(spec.data_path, spec.max_prompt_length, ("labels",))  # the trainer's data, with labels

    def prompt(i: int) -> list[int]:
        return dataset[i]["input_ids"].tolist()

    config = RolloutConfig(model=spec.model, dtype="float32", max_model_len=spec.max_prompt_length + spec.max_tokens)
    if spec.engine == "hf":
        from mindrl.rollout.hf_engine import HFEngine as Engine
    elif spec.engine == "vllm":
        from mindrl.rollout.vllm_engine import VllmEngine as Engine
    else:
        raise ValueError(f"sampler engine {spec.engine!r}: choose hf or vllm")
    engine = Engine(config)
    sampling = SamplingConfig(n=spec.n, max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p)
    sampler = Sampler(sampler_id, end, engine, prompt, sampling, spec.seed, spec.lease_size, spec.timeout_s)
    if spec.ref_model is not None:
        from mindrl.serving.reference import HFReference

        if not os.path.isfile(os.path.join(spec.ref_model, "config.json")):
            raise FileNotFoundError(f"reference model {spec.ref_model!r}: no HF model there (config.json)")
        # the trainer's reference pass: logits / the sampling temperature (1 for greedy)
        sampler.reference = HFReference(spec.ref_model, spec.temperature if spec.temperature > 0 else 1.0).logprobs
    return sampler, engine, len(dataset)


class SamplerActor:
    """A sampler in a Ray actor on the hub of a `RayTrainerEnd`: `start` runs it on a thread until `stop`;
    `status` reports the groups sent and the error that ended it, if one did."""

    def __init__(self, sampler_id: str, hub, spec: dict, threads: int = 1):
        import torch

        from mindrl.platform import current_platform, determinism_requested
        from mindrl.serving.transport import RaySamplerEnd

        if determinism_requested():  # before the engine's first kernel
            current_platform().enable_determinism()
        torch.set_num_threads(threads)
        self.sampler_id = sampler_id
        self.sampler, self.engine, _ = build_sampler(sampler_id, RaySamplerEnd(sampler_id, hub), SamplerSpec(**spec))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"sampler-{self.sampler_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    k = self.sampler.step()
                except TransportTimeout as e:  # the trainer is not reading: keep trying
                    logger.warning("sampler %s: %s; retrying", self.sampler_id, e)
                    k = 0
                self.sent += k
                if k == 0:
                    self._stop.wait(0.05)
        except BaseException:  # reported by status(); the trainer names it when its batch does not fill
            self.error = traceback.format_exc(limit=8)

    def status(self) -> dict:
        return {"sampler_id": self.sampler_id, "sent": self.sent, "version": self.sampler.version,
                "error": self.error}  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        self.engine.shutdown()


def spawn(count: int, hub, spec: SamplerSpec, prefix: str = "ray", pg=None, threads: int = 1) -> list:
    """`count` SamplerActors (named `{prefix}{k}`) on `hub`, started, each with `threads` torch threads. With `pg`
    (`reserve`) actor k runs on its bundle k and claims it; without, they ask for no CPUs of Ray's: the trainer's
    placement group holds its bundles' CPUs, and the samplers share the host with it."""
    import ray

    if pg is None:
        cls = ray.remote(num_cpus=0, max_concurrency=4)(SamplerActor)
        actors = [cls.remote(f"{prefix}{k}", hub, asdict(spec), threads) for k in range(count)]
    else:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(max_concurrency=4)(SamplerActor)
        claim = pg.bundle_specs[0]
        actors = [
            cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
                        **_claim_options(claim)).remote(f"{prefix}{k}", hub, asdict(spec), threads)
            for k in range(count)
        ]  # fmt: skip
    ray.get([a.start.remote() for a in actors])
    return actors


def bundle(cpus: float, devices: int) -> dict[str, float]:
    """One sampler actor's bundle: `cpus` CPUs and `devices` of the platform's devices (on a CPU host a device is a
    CPU stand-in, as in the trainer's bundles)."""
    from mindrl.platform import current_platform

    p = current_platform()
    out = {"CPU": float(cpus) + (devices if p.is_cpu else 0)}
    if devices and not p.is_cpu:
        out[p.ray_resource] = float(devices)
    return {k: v for k, v in out.items() if v > 0}


def _claim_options(claim: dict[str, float]) -> dict:
    """Ray actor options claiming the whole bundle `claim` (CUDA's devices as num_gpus, so Ray sets the visible ones)."""
    opts: dict = {"num_cpus": claim.get("CPU", 0)}
    rest = {k: v for k, v in claim.items() if k != "CPU"}
    if "GPU" in rest:
        opts["num_gpus"] = rest.pop("GPU")
    if rest:
        opts["resources"] = rest
    return opts


def reserve(count: int, cpus: float, devices: int, timeout_s: float):
    """A placement group of `count` bundles (`bundle(cpus, devices)`), one per sampler actor, or None when nothing is
    asked for (cpus and devices 0). Raises RuntimeError naming the keys when the cluster cannot hold it within
    `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    one = bundle(cpus, devices)
    if not one:
        return None
    pg = placement_group([dict(one) for _ in range(count)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not reserve {count} sampler bundle(s) of {one} (rl_config.async_samplers={count}, "
            f"async_sampler_cpus={cpus:g}, async_sampler_devices={devices}) within {timeout_s:g} s; the cluster has "
            f"{ray.available_resources()} free of {ray.cluster_resources()} (the trainer's bundles are taken first)"
        )
    return pg


def threads_of(cpus: float, devices: int) -> int:
    """Torch threads of a sampler actor on `bundle(cpus, devices)`: its CPUs (at least 1)."""
    return max(1, int(bundle(cpus, devices).get("CPU", 0)))
