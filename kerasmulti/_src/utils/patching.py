"""`patched`: functions set as attributes of single objects for the time of a block.

A step patches what it needs on the objects it meets (a replica context's
`all_reduce`, a seed generator's `next`), never on their classes, so other
objects and other threads' steps are untouched. Blocks nest: an inner block
that patches the same attribute puts the outer block's function back.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def patched(pairs):
    """Sets instance attributes (object, name, function), putting back what each object held on the way out."""
    done = []
    try:
        for obj, name, function in pairs:
            previous = vars(obj).get(name, patched)  # `patched`: the object held none
            object.__setattr__(obj, name, function)
            done.append((obj, name, previous))
        yield
    finally:
        for obj, name, previous in reversed(done):
            if previous is patched:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, previous)
