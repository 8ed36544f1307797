"""The suite's lanes (tests/parallel.py): every listed module exists, a test's lane follows its id, and a shared run
read from another lane is an error naming the lane to use."""

from __future__ import annotations

import os

import pytest

from tests.parallel import LANE_OF, LANES, OWN, QUICKSTART, RUNS, SHARED, lane_of, require_lane

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_listed_tests_exist_and_lanes_are_known():
    for key, lane in LANE_OF.items():
        assert lane in LANES, key
        module, _, function = key.partition("::")
        path = os.path.join(ROOT, module)
        assert os.path.isfile(path), key
        if function:
            assert f"def {function}(" in open(path).read(), key


def test_lane_of_a_test_id():
    assert lane_of("tests/trainer/test_ppo_e2e.py::test_training_learns[ppo]") == QUICKSTART
    assert lane_of("tests/trainer/test_ppo_e2e.py::test_training_learns[grpo]@serial-shared") == QUICKSTART == SHARED
    assert lane_of("tests/trainer/test_ppo_e2e.py::test_first_iteration_is_layout_invariant[tp2]") == RUNS
    assert lane_of("tests/test_recipe_smollm2.py::test_recipe_short_form") == OWN
    assert lane_of("tests/trainer/test_not_listed.py::test_x") == RUNS


def test_a_shared_run_read_from_another_lane_is_an_error(monkeypatch):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/trainer/test_x.py::test_y@serial-own (call)")
    with pytest.raises(RuntimeError, match=r"test_y reads half_run, which is built in the xdist lane 'serial-shared', "
                                           r"but runs in 'serial-own': list it under serial-shared"):  # fmt: skip
        require_lane(RUNS, "half_run")
    require_lane(OWN, "a run of the own lane")  # its own lane: fine
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/trainer/test_x.py::test_y (call)")  # not grouped: fine
    require_lane(RUNS, "half_run")
