"""Entry point of a verifier pool process: score samples sent over a pipe, one reply per sample.
Also the forkserver preload (with math-verify beside it only where a math verifier is used)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

# Imported here (not lazily) so a forkserver that preloads this module hands workers the verifiers imported; the
# math verifiers' modules (math-verify, sympy) are preloaded beside it only when they are used (VerifierPool).
import mindrl.rewards.verifiers as _verifiers


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when our parent exits: a worker stuck inside one C call (a huge power)
    holds the GIL, so no Python-level watchdog could stop it from outliving the trainer."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def worker_main(conn: Connection, math_verifiers: bool = False) -> None:
    """Loop: receive ("score", verifier_fns, [(idx, response, label), ...]), ("warm_math",) or None (exit); reply
    (idx, scores, error) per sample, where scores is a tuple of floats or None when a verifier raised, and
    ("ready", pid) once started and after each warm-up. math_verifiers: warm them up before the first "ready"."""
    _die_with_parent()
    # Ctrl-C goes to the whole process group; the parent decides what happens to the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "torch" in sys.modules:  # forked from a trainer: keep torch from spawning threads on 2 cores
        sys.modules["torch"].set_num_threads(1)
    # math-verify warns once that its own timeout is off (we enforce it from outside) and on every
    # internal parse failure; neither is actionable per sample.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    if math_verifiers:
        _verifiers.warm_up_math()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "warm_math":
            _verifiers.warm_up_math()
            conn.send(("ready", os.getpid()))
            continue
        _, fns, items = message
        for idx, response, label in items:
            conn.send((idx, *_verifiers.score_sample(fns, response, label)))
