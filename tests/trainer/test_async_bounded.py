"""rl_config.async_mode bounded in mindrl-train: two `mindrl-sampler` processes feed the tiny GRPO over ZeroMQ on
loopback; the trainer publishes its weights after every update, trains no experience older than max_staleness, and
every prompt exactly once; the prompt ledger is in the checkpoint, and a resume from it keeps that count."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import shutil

import pytest

from mindrl.checkpoint import mcore_ckpt
from mindrl.data.prompt_dataset import PromptDataset
from mindrl.data.tokenizer import load_tokenizer
from mindrl.launch import free_port
from tests.procs import stop_all
from tests.trainer.rl_helpers import PROFILE, STRAIGHT_EXTRA, _config, _train
from tests.trainer.test_async_samplers import start

pytestmark = pytest.mark.slow

N = 4  # grpo_tiny_cpu's n_samples_per_prompt
RESUME = [f"actor_config.{k}" for k in ("finetune=false", "no_load_optim=false", "no_load_rng=false")]


def _bounded(ports=None) -> list[str]:
    """bounded's overrides: over ZeroMQ on `ports` (data, sync), or with None the default Ray transport."""
    out = [
        "rl_config.use_tensorboard=false", *[x for x in STRAIGHT_EXTRA["grpo"] if x not in PROFILE],
        "rl_config.async_mode=bounded", "rl_config.max_staleness=1", "rl_config.async_timeout_s=300",
    ]  # fmt: skip
    if ports is not None:
        out += ["rl_config.async_transport=zmq", "rl_config.async_host=127.0.0.1",
                f"rl_config.async_data_port={ports[0]}", f"rl_config.async_sync_port={ports[1]}"]  # fmt: skip
    return out


@contextlib.contextmanager
def _two_samplers(assets, ports, tmp_path, extra=()):
    """mindrl-sampler processes A and B on `ports`, logging to tmp_path/sampler-{A,B}.log; stopped at the end."""
    with contextlib.ExitStack() as stack:
        logs = {k: stack.enter_context(open(tmp_path / f"sampler-{k}.log", "w")) for k in "AB"}
        procs = [start(k, assets, ports, logs[k], n=N, max_tokens=16, extra=extra) for k in "AB"]
        try:
            yield
        finally:
            stop_all(procs)


def _expected(assets, num_prompts: int, epochs: int) -> collections.Counter:
    """rollouts.jsonl's prompt texts when each prompt is trained once per epoch (N rows each; some texts occur twice
    in the dataset)."""
    tokenizer = load_tokenizer(str(assets / "hf"))
    rows = PromptDataset(str(assets / "data" / "train"), 64, ("labels",))
    texts = tokenizer.batch_decode([rows[i]["input_ids"].tolist() for i in range(num_prompts)])
    return collections.Counter({t: epochs * N * c for t, c in collections.Counter(texts).items()})


def _assert_exactly_once(assets, rollouts: list[dict], ledger: dict) -> None:
    """The groups in rollouts.jsonl (N rows each, tagged with their ledger epoch and dataset row) are the ledger's
    done prompts exactly: no (epoch, prompt) trained twice, none the ledger counts done missing; each row's prompt
    text is its dataset row's."""
    trained = collections.Counter((r["epoch"], r["prompt_index"]) for r in rollouts)
    assert set(trained.values()) == {N}, [k for k, v in trained.items() if v != N]
    done = {(e, p) for e in range(ledger["epochs_closed"]) for p in range(ledger["num_prompts"])}
    done |= {(int(e), p) for e, prompts in ledger["done"].items() for p in prompts}
    assert set(trained) == done, (sorted(set(trained) - done), sorted(done - set(trained)))
    tokenizer = load_tokenizer(str(assets / "hf"))
    rows = PromptDataset(str(assets / "data" / "train"), 64, ("labels",))
    for r in rollouts:
        assert r["prompt"] == tokenizer.decode(rows[r["prompt_index"]]["input_ids"].tolist()), r


def _ledger(ckpt, iteration: int) -> dict:
    state = json.loads((ckpt / f"iter_{iteration:07d}" / "trainer_state.json").read_text())
    return state["async_rollout"]["bounded"]["ledger"]


def test_bounded_trains_every_prompt_once_from_two_samplers(assets, tmp_path):
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    ports = (free_port(), free_port())
    iters = num_prompts // 8  # one epoch at global_batch_size 8
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, f"megatron_training.train_iters={iters}",
                  "megatron_training.save_interval=0", *_bounded(ports))  # fmt: skip
    with _two_samplers(assets, ports, tmp_path):
        run_dir, _, lines, rollouts = _train(cfg)
    assert len(lines) == iters
    for m in lines:
        assert 0 <= m["async/staleness/max"] <= 1, m
        assert m["timing/publish_weights"] > 0
    assert collections.Counter(r["prompt"] for r in rollouts) == _expected(assets, num_prompts, epochs=1)
    delivered = {k for m in lines for k in m if k.startswith("async/sampler_tps/")}
    print("samplers:", sorted(delivered), "staleness max per iteration:", [m["async/staleness/max"] for m in lines])
    ledger = _ledger(tmp_path / "ckpt_actor", iters)
    assert ledger["epochs_closed"] == 1 and ledger["num_prompts"] == num_prompts


def test_bounded_with_sampler_actors_on_the_ray_transport(assets, tmp_path):
    """bounded's default transport (Ray) with rl_config.async_samplers=2: two sampler actors in the trainer's Ray
    cluster, no external process, no port; every prompt trained once, none more than one version old, both actors
    delivering or one doing all (timing decides)."""
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    iters = num_prompts // 8
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, f"megatron_training.train_iters={iters}",
                  "megatron_training.save_interval=0", *_bounded(),
                  "rl_config.async_samplers=2")  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    assert len(lines) == iters
    for m in lines:
        assert 0 <= m["async/staleness/max"] <= 1 and m["async/queue_depth"] >= 0, m
    assert collections.Counter(r["prompt"] for r in rollouts) == _expected(assets, num_prompts, epochs=1)
    _assert_exactly_once(assets, rollouts, _ledger(tmp_path / "ckpt_actor", iters))
    delivered = {k.rsplit("/", 1)[1] for m in lines for k in m if k.startswith("async/sampler_tps/")}
    assert delivered and delivered <= {"ray0", "ray1"}, delivered
    assert _ledger(tmp_path / "ckpt_actor", iters)["epochs_closed"] == 1


def test_bounded_with_a_vllm_sampler_actor(assets, tmp_path):
    """async_sampler_engine vllm: one sampler actor holding a vLLM engine (in its own process, beside the trainer's
    two workers, which hold none in bounded); the epoch's prompts trained once each, none more than one version old,
    and the engine's logprobs of the freshly synced groups agree with the trainer's recomputation."""
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    iters = num_prompts // 8
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, f"megatron_training.train_iters={iters}",
                  "megatron_training.save_interval=0", *_bounded(), "rl_config.async_sampler_engine=vllm")  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    assert len(lines) == iters
    for m in lines:
        assert 0 <= m["async/staleness/max"] <= 1, m
        assert m["async/sampler_tps/ray0"] > 0, m
    _assert_exactly_once(assets, rollouts, _ledger(tmp_path / "ckpt_actor", iters))
    # iteration 1 trains groups sampled with version 0, the weights it recomputes with: only the engines' numerics
    # differ (the synchronous trainer's vLLM-vs-megatron gap, warned above logprob_diff_warn)
    assert lines[0]["async/staleness/max"] == 0
    assert lines[0]["rollout/logprob_diff_mean"] < cfg.rl_config.logprob_diff_warn, lines[0]


def test_bounded_resume_trains_every_prompt_once_per_epoch_across_the_two_runs(assets, tmp_path, caplog):
    """Run 1 saves at iteration 1 (half of epoch 0 done, prompts in flight) and is lost after iteration 2, before that
    save (its checkpoint removed: the state a kill leaves); run 2 resumes from iteration 1 and trains to 4 (two epochs)
    with the same two sampler processes, which outlive run 1 holding its version-2 weights.

    "Exact" here is prompt accounting, not bit-identity: which weights sample a prompt depends on when a sampler leases
    it, so the responses and metrics differ from an uninterrupted run (one_step_off's resume is bit-exact; this is not).
    What is exact: every prompt is trained once per epoch over run 1's checkpointed iterations and run 2 (run 1's
    unsaved iteration 2 is redone, as after any resume); the ledger is the checkpoint's, its in-flight prompts re-issued;
    nothing sampled with run 1's weights reaches run 2's updates (refused by its run id, the prompt re-issued), and the
    samplers take the resumed trainer's weights in their place."""
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    assert num_prompts == 16  # global_batch_size 8: two iterations per epoch
    ports = (free_port(), free_port())
    ckpt = tmp_path / "ckpt_actor"
    # short request timeouts: the samplers keep asking while no trainer listens (between the runs)
    with _two_samplers(assets, ports, tmp_path, extra=("--timeout", "10", "--idle-exit", "300")):
        run1 = _config("grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=2",
                       "megatron_training.save_interval=1", *_bounded(ports))  # fmt: skip
        _, results1, _, _ = _train(run1)
        assert [r.iteration for r in results1] == [1, 2]
        saved = _ledger(ckpt, 1)
        assert saved["epochs_closed"] == 0 and len(saved["done"]["0"]) == 8
        in_flight = {s: len(held) for s, held in saved["in_flight"].items() if held}
        shutil.rmtree(ckpt / "iter_0000002")  # run 1 "dies" after iteration 2, before its save
        mcore_ckpt.write_tracker(str(ckpt), 1)
        run2 = _config("grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=4",
                       "megatron_training.save_interval=0", *_bounded(ports), *RESUME, actor_load=ckpt)  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="mindrl.serving.transport"):
            _, results2, lines, rollouts = _train(run2)
    assert [r.iteration for r in results2] == [2, 3, 4]
    # the checkpoint's ledger was loaded: each sampler holding leases in it declared dead, those prompts re-issued
    dead = {r.getMessage() for r in caplog.records if "declared dead" in r.getMessage()}
    assert dead == {f"sampler {s} declared dead; {k} in-flight prompts re-issued" for s, k in in_flight.items()}, dead
    # metrics.jsonl and rollouts.jsonl were cut back to iteration 1: run 1's iteration 1, then run 2's 2-4
    assert [m["iteration"] for m in lines] == [1, 2, 3, 4]
    # the groups trained over run 1's iteration 1 and run 2's 2-4 are the final ledger's done prompts, each once
    final = _ledger(ckpt, 4)
    _assert_exactly_once(assets, rollouts, final)
    assert len(rollouts) == 4 * 8 * N and final["epochs_closed"] >= 1  # 32 groups: epoch 0 and most of epoch 1
    run1 = {(r["epoch"], r["prompt_index"]) for r in rollouts[: 8 * N]}
    assert run1 == {(0, p) for p in saved["done"]["0"]}  # iteration 1: the checkpoint's done prompts
    for m in lines[1:]:
        assert 0 <= m["async/staleness/mean"] <= m["async/staleness/max"] <= 1, m
    foreign = sum(m["async/dropped_foreign"] for m in lines[1:])
    print(f"in flight at the checkpoint {in_flight}; dropped as run 1's: {foreign}; final ledger: "
          f"duplicates {final['duplicates']}, re-issued {final['reissued']}")  # fmt: skip


def test_bounded_with_the_reference_in_the_sampler(assets, tmp_path, monkeypatch):
    """rl_config.async_sampler_ref: the sampler actor holds the reference model (the HF dir the trainer's reference
    checkpoint was converted from) and sends each response's reference logprobs; the trainer skips its reference pass.
    With async_sampler_cpus=1 the actor runs on a placement-group bundle of its own ({CPU: 1}, beside the trainer's).
    Each iteration the test also runs the trainer's own reference forward on the same batch: the samplers' values
    equal it within the two implementations' gap, measured here as each one's error against an fp64 forward of the same
    tokens (the sampler's no more than twice the trainer's), a gap below how far one update moves the policy. The
    epoch's prompts are trained exactly once."""
    import torch

    from mindrl.serving.reference import HFReference
    from mindrl.trainer import experience
    from mindrl.trainer.ppo_trainer import PPOTrainer

    seen, groups = [], []
    score = PPOTrainer._score

    def score_and_compare(self, batch, labels, timing, scored=None):
        if not groups:  # the placement groups alive while training
            from ray.util.placement_group import placement_group_table

            groups.extend(g["bundles"] for g in placement_group_table().values() if g["state"] == "CREATED")
        sent = batch["ref_log_prob"].clone() if "ref_log_prob" in batch else None
        out = score(self, batch, labels, timing, scored)
        own = (self.reference or self.actor).compute_log_prob(batch.select(experience.FORWARD_KEYS), reference=True)
        seen.append({"sent": sent, "own": own.tensor, "old": batch["old_log_prob"].clone(),
                     "mask": batch["response_mask"].clone(), "prompts": batch.rows_meta["prompt_ids"],
                     "responses": batch.rows_meta["response_ids"]})  # fmt: skip
        return out

    monkeypatch.setattr(PPOTrainer, "_score", score_and_compare)
    num_prompts = len(PromptDataset(str(assets / "data" / "train"), 64, ("labels",)))
    iters = num_prompts // 8
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, f"megatron_training.train_iters={iters}",
                  "megatron_training.save_interval=0", *_bounded(), "rl_config.async_sampler_ref=true",
                  "rl_config.async_sampler_cpus=1")  # fmt: skip
    _, _, lines, rollouts = _train(cfg)
    assert len(lines) == iters and len(seen) == iters
    shapes = sorted(list(b.values()) for b in groups)  # the sampler's bundle, the trainer's two (a device each)
    assert shapes == [[{"CPU": 1.0}], [{"CPU": 1.0}, {"CPU": 1.0}]], groups
    for m in lines:
        assert 0 <= m["async/staleness/max"] <= 1 and m["async/sampler_ref_s"] > 0, m
        assert "timing/reference_model" not in m, m  # the trainer's reference pass was skipped
    _assert_exactly_once(assets, rollouts, _ledger(tmp_path / "ckpt_actor", iters))
    exact = HFReference(str(assets / "hf"), cfg.generate_config.sampling_config.temperature, dtype=torch.float64)
    trainer_err = sampler_err = sampler_vs_trainer = moved = 0.0
    for it in seen:
        assert it["sent"] is not None
        mask = it["mask"].bool()
        for i, (p, r) in enumerate(zip(it["prompts"], it["responses"])):
            k = int(mask[i].sum())
            if k == 0:
                continue
            x = torch.from_numpy(exact.logprobs(p, [r[:k]])[0])
            trainer_err = max(trainer_err, (it["own"][i, :k].double() - x).abs().max().item())
            sampler_err = max(sampler_err, (it["sent"][i, :k].double() - x).abs().max().item())
        sampler_vs_trainer = max(sampler_vs_trainer, (it["sent"] - it["own"])[mask].abs().max().item())
        moved = max(moved, (it["old"] - it["own"])[mask].abs().max().item())
    print(f"max |sampler - trainer| {sampler_vs_trainer:.3g}; against fp64: trainer {trainer_err:.3g}, sampler "
          f"{sampler_err:.3g}; one update moves the policy by {moved:.3g}")  # fmt: skip
    # the two fp32 implementations' measured gap: each one's error against fp64 (the sampler's HF forward no less
    # accurate than the trainer's megatron TP2 one), far below what tells the reference from the updated policy
    assert 0 < sampler_err <= trainer_err * 2
    assert sampler_vs_trainer <= sampler_err + trainer_err < moved
