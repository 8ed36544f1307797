"""Process checks shared by the tests that look for leftovers."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie (dead, not yet reaped: an orphan's new parent may never reap it) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
