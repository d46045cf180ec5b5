"""`Nesting`: whether this thread is inside a block, counting blocks inside blocks.

Replicas trace on threads of their own, so "inside an update made for all
replicas" or "inside the trace of a compiled call" is a property of a thread,
and such blocks nest (a call inside a call).
"""

from __future__ import annotations

import threading


class Nesting:
    """`with nesting:` enters a block on this thread; `nesting.inside()` says whether one is open."""

    def __init__(self):
        self._local = threading.local()

    def inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def __enter__(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        return self

    def __exit__(self, *exc_info):
        self._local.depth -= 1
