"""The prompt ledger: exactly-once per epoch across samplers, re-issue after a sampler dies, late duplicates
dropped and counted, and a checkpointed state that resumes exactly."""

import random

import pytest

from mindrl.data.prompt_ledger import Lease, PromptLedger


def test_each_prompt_once_per_epoch_across_samplers():
    ledger = PromptLedger(10, seed=3, num_epochs=2)
    got = []
    while True:
        leases = ledger.issue("a", 3) + ledger.issue("b", 2)
        if not leases:
            break
        for x in leases:
            assert ledger.complete("a" if x in ledger.in_flight("a") else "b", x.prompt_index, x.epoch)
        got += leases
    assert sorted((x.epoch, x.prompt_index) for x in got) == [(e, i) for e in range(2) for i in range(10)]
    assert ledger.epochs_closed == 2 and ledger.duplicates == 0
    assert [x.prompt_index for x in got[:10]] == list(ledger.order(0))  # the seeded order, in issue order
    assert list(ledger.order(0)) != list(ledger.order(1))


def test_dead_sampler_prompts_reissued_and_late_duplicates_dropped():
    ledger = PromptLedger(6, seed=0, num_epochs=1)
    a = ledger.issue("a", 3)
    b = ledger.issue("b", 2)
    assert ledger.complete("a", a[0].prompt_index, 0)
    back = ledger.sampler_dead("a")
    assert back == a[1:]
    again = ledger.issue("b", 4)  # re-issued first, then the one prompt left in the epoch
    assert again[:2] == a[1:] and len(again) == 3 and ledger.reissued == 2
    # a late experience of the dead sampler arrives first: it wins, the re-issued copy becomes the duplicate
    assert ledger.complete("a", a[1].prompt_index, 0)
    assert not ledger.complete("b", a[1].prompt_index, 0)
    for x in b + again[1:]:
        assert ledger.complete("b", x.prompt_index, x.epoch)
    assert not ledger.complete("b", b[0].prompt_index, 0)  # a second copy after the epoch closed
    assert not ledger.complete("b", 99, 0) and not ledger.complete("b", 0, 5)  # never issued
    assert ledger.duplicates == 4 and ledger.epochs_closed == 1 and ledger.in_flight() == []


def test_leases_run_ahead_into_next_epoch():
    ledger = PromptLedger(3, shuffle=False)
    first = ledger.issue("a", 3)
    nxt = ledger.issue("b", 2)
    assert [(x.prompt_index, x.epoch) for x in nxt] == [(0, 1), (1, 1)]
    assert ledger.complete("b", 0, 1) and ledger.epoch == 0 and ledger.epochs_closed == 0
    for x in first:
        ledger.complete("a", x.prompt_index, x.epoch)
    assert ledger.epochs_closed == 1 and ledger.done_in_epoch(0) == 3 and ledger.done_in_epoch(1) == 1


def run_random(ledger, rng, steps):
    """A random interleaving of issue / complete / death / duplicate; returns the event log."""
    log = []
    samplers = ["s0", "s1", "s2"]
    for _ in range(steps):
        op = rng.random()
        s = rng.choice(samplers)
        if op < 0.4:
            log.append(("issue", s, tuple(ledger.issue(s, rng.randint(1, 3)))))
        elif op < 0.85:
            held = ledger.in_flight(s)
            if held:
                x = rng.choice(held)
                log.append(("complete", s, x, ledger.complete(s, x.prompt_index, x.epoch)))
        elif op < 0.9:
            log.append(("dead", s, tuple(ledger.sampler_dead(s))))
        else:
            x = Lease(rng.randrange(7), rng.randrange(2))  # any sampler may deliver any (epoch, prompt), once
            log.append(("complete", s, x, ledger.complete(s, x.prompt_index, x.epoch)))
    return log


def test_state_dict_resumes_exactly():
    rng = random.Random(5)
    ledger = PromptLedger(7, seed=11)
    run_random(ledger, rng, 60)
    state = ledger.state_dict()
    rng_state = rng.getstate()
    tail = run_random(ledger, rng, 80)
    resumed = PromptLedger(7, seed=11)
    resumed.load_state_dict(state)
    rng.setstate(rng_state)
    assert run_random(resumed, rng, 80) == tail
    assert resumed.state_dict() == ledger.state_dict()


def test_exactly_once_under_random_interleavings():
    for seed in range(20):
        rng = random.Random(seed)
        ledger = PromptLedger(5, seed=seed, num_epochs=3)
        accepted = []
        for event in run_random(ledger, rng, 300):
            if event[0] == "complete" and event[3]:
                accepted.append((event[2].epoch, event[2].prompt_index))
        assert len(accepted) == len(set(accepted))
        for s in ("s0", "s1", "s2"):  # drain: everything left is re-issued to one survivor
            ledger.sampler_dead(s)
        while leases := ledger.issue("z", 4):
            for x in leases:
                if ledger.complete("z", x.prompt_index, x.epoch):
                    accepted.append((x.epoch, x.prompt_index))
        assert sorted(accepted) == [(e, i) for e in range(3) for i in range(5)], seed


def test_load_refuses_another_dataset():
    state = PromptLedger(5, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts=5 but this run has 6"):
        PromptLedger(6, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state version"):
        PromptLedger(5, seed=1).load_state_dict({**state, "version": 0})
    assert Lease(1, 0) == Lease(1, 0)
