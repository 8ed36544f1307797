"""`worker_threads`: $MINDRL_WORKER_THREADS pins the trainer's worker ranks' (and the training CLIs' rank pools')
torch threads (the suite pins 1, see tests/conftest.py); a bad value is an error naming the variable. (The per-node default, node CPUs / ranks there,
is exercised by every trainer run and by the benchmarks.)"""

from __future__ import annotations

import pytest

from mindrl.launch import THREADS_ENV, threads_from_env
from mindrl.workers.group import worker_threads


def test_the_variable_pins_every_rank(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert worker_threads(None, 2) == [3, 3]


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_value_is_an_error(monkeypatch, value):
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match=THREADS_ENV):
        worker_threads(None, 1)


def test_the_rank_pools_of_the_training_clis_read_it_too(monkeypatch):
    """mindrl-sft / -dpo / -rm size their rank pool by it (megatron_loop.train_loop), else by the node's CPUs."""
    monkeypatch.setenv(THREADS_ENV, "2")
    assert threads_from_env() == 2
    monkeypatch.delenv(THREADS_ENV)
    assert threads_from_env() is None
    monkeypatch.setenv(THREADS_ENV, "x")
    with pytest.raises(ValueError, match=THREADS_ENV):
        threads_from_env()
