"""The driver's rule rewards (RewardClient: the verifier pool from a background thread of the driver): scoring runs
while the driver goes on, a hung sample costs its timeout only, and shutdown leaves no process and no record."""

from __future__ import annotations

import json
import os
import time

from tests.procs import alive
from tests.rewards import pool_helpers  # noqa: F401  (registers the _test_* verifiers)

GOOD = "<think>t</think><answer>a</answer>"


def test_scores_in_the_background_then_shuts_down_without_leftovers(tmp_path):
    from transformers import AutoTokenizer

    from mindrl.rewards import RewardSettings, get_shared_pool
    from mindrl.trainer.leftovers import TEMP_RECORD
    from mindrl.trainer.reward_client import RewardClient
    from tools.make_tiny_model import make_tokenizer

    make_tokenizer(str(tmp_path / "tok"), vocab_size=1024)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    texts = [GOOD, "no tags", "HANG"]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    labels = [tok.encode(x, add_special_tokens=False) for x in ("a", "b", "c")]
    decoded = tok.batch_decode(ids, skip_special_tokens=True)
    settings = RewardSettings(("format", "_test_sleep_if_marked"), (1.0, 0.0), 3.0, 1)
    client = RewardClient(settings, str(tmp_path), tok)
    try:
        (entry,) = json.load(open(tmp_path / TEMP_RECORD))  # where a killed driver's forkserver socket stays
        assert os.path.basename(entry["path"]).startswith("pymp-") and os.path.isdir(entry["path"])
        t0 = time.perf_counter()
        pending = client.score(ids, labels)
        started = time.perf_counter() - t0
        scored = client.collect(pending, iteration=1)
        took = time.perf_counter() - t0
        assert started < 1.0 and took >= 3.0, (started, took)  # the driver went on while the hung sample ran out
        assert scored.texts == decoded and scored.labels == ["a", "b", "c"]
        assert scored.rewards == [float(t == GOOD) for t in decoded[:2]] + [0.0]
        assert scored.per_verifier[2] is None
        assert scored.metrics["reward/timeouts"] == 1.0 and scored.metrics["reward/worker_restarts"] == 1.0
        pids = get_shared_pool(1).worker_pids()
        again = client.collect(client.score(ids[:2], labels[:2]), iteration=2)
        assert again.rewards == scored.rewards[:2] and again.metrics["reward/worker_restarts"] == 0.0
    finally:
        client.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), pids
    assert not (tmp_path / TEMP_RECORD).exists()


def test_shutdown_stops_a_scoring_call_in_flight(tmp_path):
    """Ctrl-C during scoring: the trainer's shutdown does not wait for the batch (here one sample hangs for 600 s)."""
    from transformers import AutoTokenizer

    from mindrl.rewards import RewardSettings
    from mindrl.trainer.reward_client import RewardClient
    from tools.make_tiny_model import make_tokenizer

    make_tokenizer(str(tmp_path / "tok"), vocab_size=1024)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ids = [tok.encode("HANG", add_special_tokens=False)]
    client = RewardClient(RewardSettings(("_test_sleep_if_marked",), (1.0,), 600.0, 1), str(tmp_path), tok)
    pending = client.score(ids, ids)
    time.sleep(2.0)
    t0 = time.perf_counter()
    client.shutdown()
    assert time.perf_counter() - t0 < 10.0
    pending._thread.join(timeout=10)
    assert not pending._thread.is_alive()
