"""Prompt accounting for asynchronous samplers: every prompt is consumed exactly once per epoch, even when a sampler
dies (its in-flight prompts are re-issued) or a late duplicate arrives (dropped and counted). Pure logic."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_VERSION = 1


@dataclass(frozen=True)
class Lease:
    """One prompt handed to a sampler: its dataset index and the epoch it belongs to."""

    prompt_index: int
    epoch: int


class PromptLedger:
    """Hands out prompt indices to samplers in a seeded per-epoch order (epoch e: permutation of
    range(num_prompts) drawn from (seed, e); or 0..n-1 when shuffle is False) and records completions.

    A prompt is *done* in an epoch when `complete` accepts it; the first completion wins, any later one for the
    same (epoch, prompt) is a duplicate. An epoch closes once all its prompts are done; leases run ahead into
    the next epoch while the previous one still has prompts in flight."""

    def __init__(self, num_prompts: int, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None):
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be positive, got {num_prompts}")
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be positive or None (unbounded), got {num_epochs}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self._epoch = 0  # the epoch the cursor reads from
        self._cursor = 0  # next position in that epoch's order
        self._order_cache: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, position of each)
        self._in_flight: dict[str, dict[Lease, None]] = {}  # sampler -> its leases (dict: insertion-ordered set)
        self._reissue: deque[Lease] = deque()  # leases of dead samplers, handed out before new ones
        self._done: dict[int, set[int]] = {}  # open epoch -> prompt indices done
        self.epochs_closed = 0
        self.duplicates = 0
        self.reissued = 0

    # ---- order -----------------------------------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's prompt order (deterministic in seed and epoch)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            else:
                perm = np.arange(self.num_prompts)
            position = np.empty_like(perm)
            position[perm] = np.arange(self.num_prompts)
            self._order_cache = (epoch, perm, position)
        return self._order_cache[1]

    def _exhausted(self) -> bool:
        return self.num_epochs is not None and self._epoch >= self.num_epochs

    # ---- leases ----------------------------------------------------------------------------------------------

    def issue(self, sampler_id: str, count: int) -> list[Lease]:
        """Up to `count` prompts for `sampler_id`: re-issued leases of dead samplers first, then the next in
        order. Fewer (possibly none) when num_epochs is reached."""
        held = self._in_flight.setdefault(sampler_id, {})
        out: list[Lease] = []
        while len(out) < count and self._reissue:
            lease = self._reissue.popleft()
            if not self._is_done(lease):
                out.append(lease)
                self.reissued += 1
        while len(out) < count and not self._exhausted():
            lease = Lease(int(self.order(self._epoch)[self._cursor]), self._epoch)
            self._done.setdefault(self._epoch, set())
            self._cursor += 1
            if self._cursor == self.num_prompts:
                self._epoch, self._cursor = self._epoch + 1, 0
            out.append(lease)
        for lease in out:
            held[lease] = None
        return out

    def complete(self, sampler_id: str, prompt_index: int, epoch: int) -> bool:
        """Record that `sampler_id` delivered the prompt's experiences. True: accepted (train on them);
        False: a duplicate or a prompt never issued (drop them; counted in `duplicates`)."""
        lease = Lease(int(prompt_index), int(epoch))
        self._in_flight.get(sampler_id, {}).pop(lease, None)
        if not self._was_issued(lease) or self._is_done(lease):
            self.duplicates += 1
            return False
        done = self._done[lease.epoch]
        done.add(lease.prompt_index)
        for other in self._in_flight.values():  # a re-issued copy still out elsewhere is now moot
            other.pop(lease, None)
        self._close_epochs()
        return True

    def sampler_dead(self, sampler_id: str) -> list[Lease]:
        """Forget `sampler_id`; its unfinished leases go back to the front of the queue (returned)."""
        held = self._in_flight.pop(sampler_id, {})
        back = [lease for lease in held if not self._is_done(lease)]
        self._reissue.extend(back)
        return back

    def give_back(self, sampler_id: str, prompt_index: int, epoch: int) -> bool:
        """`sampler_id` delivered the prompt's experiences but the trainer refuses them (too stale): the prompt is
        not done, and is re-issued first. False (nothing changes) for a prompt done already or never issued."""
        lease = Lease(int(prompt_index), int(epoch))
        self._in_flight.get(sampler_id, {}).pop(lease, None)
        if not self._was_issued(lease) or self._is_done(lease) or lease in self._reissue:
            return False
        if any(lease in held for held in self._in_flight.values()):  # a re-issued copy is out already
            return False
        self._reissue.appendleft(lease)
        return True

    def holders(self) -> list[str]:
        """The samplers holding leases (a resumed trainer declares them dead: their prompts are re-issued)."""
        return [s for s, held in self._in_flight.items() if held]

    def in_flight(self, sampler_id: str | None = None) -> list[Lease]:
        if sampler_id is not None:
            return list(self._in_flight.get(sampler_id, {}))
        return [lease for held in self._in_flight.values() for lease in held]

    @property
    def epoch(self) -> int:
        """The oldest epoch not yet closed."""
        return min(self._done) if self._done else self._epoch

    def done_in_epoch(self, epoch: int) -> int:
        if epoch < self.epochs_closed:
            return self.num_prompts
        return len(self._done.get(epoch, ()))

    def _was_issued(self, lease: Lease) -> bool:
        if not 0 <= lease.prompt_index < self.num_prompts or lease.epoch < 0:
            return False
        if lease.epoch < self._epoch:
            return True
        if lease.epoch > self._epoch:
            return False
        self.order(lease.epoch)
        return int(self._order_cache[2][lease.prompt_index]) < self._cursor

    def _is_done(self, lease: Lease) -> bool:
        return lease.epoch < self.epochs_closed or lease.prompt_index in self._done.get(lease.epoch, ())

    def _close_epochs(self) -> None:
        while len(self._done.get(self.epochs_closed, ())) == self.num_prompts:
            del self._done[self.epochs_closed]
            self.epochs_closed += 1

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain Python (ints, lists, strings): restoring it gives the same future leases and verdicts."""
        return {
            "version": STATE_VERSION,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_epochs": self.num_epochs,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "in_flight": {s: [[x.prompt_index, x.epoch] for x in held] for s, held in self._in_flight.items()},
            "reissue": [[x.prompt_index, x.epoch] for x in self._reissue],
            "done": {int(e): sorted(d) for e, d in self._done.items()},
            "epochs_closed": self.epochs_closed,
            "duplicates": self.duplicates,
            "reissued": self.reissued,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"prompt ledger state version {state.get('version')!r}; this build reads {STATE_VERSION}")
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"prompt ledger state has {key}={state[key]!r} but this run has {getattr(self, key)!r}: "
                    "the checkpoint belongs to another dataset or data seed"
                )
        self.num_epochs = state["num_epochs"]
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        self._in_flight = {s: {Lease(p, e): None for p, e in held} for s, held in state["in_flight"].items()}
        self._reissue = deque(Lease(p, e) for p, e in state["reissue"])
        self._done = {int(e): set(d) for e, d in state["done"].items()}
        self.epochs_closed = int(state["epochs_closed"])
        self.duplicates = int(state["duplicates"])
        self.reissued = int(state["reissued"])
