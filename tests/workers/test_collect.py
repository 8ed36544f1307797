"""`collect` names the rank behind a failure: when a rank's collective only reports a lost peer, the error names the
peer that died (Ray may report the death after the broken connection), within PEER_GRACE_S; any other error is
reported at once."""

from __future__ import annotations

import os
import time

import pytest


class _Rank:
    def run(self, action: str, delay: float):
        time.sleep(delay)
        if action == "peer":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        if action == "raise":
            raise ValueError("a rank's own error")
        if action == "die":
            os._exit(9)
        return action


@pytest.fixture(scope="module")
def ranks():
    import ray

    from mindrl.workers.group import start_ray, stop_ray

    assert start_ray(None, 1)
    try:
        yield lambda n: [ray.remote(num_cpus=0)(_Rank).remote() for _ in range(n)]
    finally:
        stop_ray()


def _collect_error(actors, plan, grace_s=None, monkeypatch=None):
    from mindrl.workers import group

    if grace_s is not None:
        monkeypatch.setattr(group, "PEER_GRACE_S", grace_s)
    refs = [a.run.remote(action, delay) for a, (action, delay) in zip(actors, plan)]
    start = time.monotonic()
    with pytest.raises(group.WorkerError) as e:
        group.collect(refs, "actor.update_actor", kill=actors)
    return str(e.value), time.monotonic() - start


def test_a_lost_peer_names_the_rank_that_died(ranks):
    msg, _ = _collect_error(ranks(2), [("peer", 0.0), ("die", 1.0)])
    assert msg.startswith("actor.update_actor: rank 1 failed: its process died"), msg


def test_a_lost_peer_names_the_rank_that_raised(ranks):
    msg, _ = _collect_error(ranks(3), [("peer", 0.0), ("ok", 0.0), ("raise", 1.0)])
    assert msg == "actor.update_actor: rank 2 failed: ValueError: a rank's own error", msg


def test_a_lost_peer_alone_is_reported_after_the_grace(ranks, monkeypatch):
    msg, elapsed = _collect_error(ranks(2), [("peer", 0.0), ("ok", 30.0)], grace_s=1.0, monkeypatch=monkeypatch)
    assert msg.startswith("actor.update_actor: rank 0 failed: RuntimeError: [gloo/transport"), msg
    assert elapsed < 20, elapsed


def test_an_own_error_is_reported_at_once(ranks):
    msg, elapsed = _collect_error(ranks(2), [("raise", 0.0), ("ok", 30.0)])
    assert msg == "actor.update_actor: rank 0 failed: ValueError: a rank's own error", msg
    assert elapsed < 10, elapsed
