"""Names a job gives the host-wide resources it creates (/dev/shm segments), so that two jobs on one host, or a test
suite beside a training run, can each find and clean up their own and only their own."""

from __future__ import annotations

import os

SHM_TAG_ENV = "MINDRL_SHM_TAG"
"""An optional tag (letters, digits, '_', '-') that every /dev/shm name of this job carries after `mindrl`; worker
processes inherit it from the driver's environment. Unset: plain `mindrl...` names."""


def shm_prefix() -> str:
    """The prefix of this job's /dev/shm names: `mindrl` plus the job's tag, if it has one."""
    tag = os.environ.get(SHM_TAG_ENV, "")
    if tag and not all(c.isalnum() or c in "_-" for c in tag):
        raise ValueError(f"{SHM_TAG_ENV}={tag!r}: use letters, digits, '_' or '-' only (it becomes part of file names)")
    return f"mindrl{tag}"
