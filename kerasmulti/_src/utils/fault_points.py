"""Deterministic crash points, for the crash-safety tests.

Code that writes a file in several steps calls `reached(point)` between them.
Normally nothing happens. With `KERASMULTI_FAULT="point:n"` in the environment
(set by the tests only) the process ends at once, as SIGKILL would end it, the
n-th time it reaches `point`: the tests then check that what is on disk is the
old state or the new one, and that running again completes the work.
"""

from __future__ import annotations

import os

ENV = "KERASMULTI_FAULT"
EXIT_CODE = 137  # what a shell reports for SIGKILL

_seen: dict[str, int] = {}


def reached(point: str) -> None:
    """Ends the process here if the environment asks for a fault at `point` now."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, count = wanted.rpartition(":")
    if name != point:
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] == int(count):
        os._exit(EXIT_CODE)
