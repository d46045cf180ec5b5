"""The device scopes open in this thread, innermost last.

`device_scope` opens one while a model is built; a layer called meanwhile
is placed on the innermost. `OnDevice` suspends them while it calls its
layer, so that the layer's own sub-layers are not wrapped a second time.
"""

from __future__ import annotations

import contextlib
import threading

from kerasmulti._src.keras_private import global_state

_local = threading.local()


def _stack() -> list[str]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def innermost() -> str | None:
    """The device of the innermost open scope, or None when none is open."""
    stack = _stack()
    return stack[-1] if stack else None


def opened_in():
    """The layer whose call was running when the innermost scope opened (a subclassed model's), or None."""
    owners = getattr(_local, "owners", [])
    return owners[-1] if owners else None


def calling():
    """The outermost layer whose call is running in this thread (Keras' call context), or None."""
    return getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer", None)


@contextlib.contextmanager
def opened(device: str):
    _stack().append(device)
    _local.owners = [*getattr(_local, "owners", []), calling()]
    try:
        yield
    finally:
        _stack().pop()
        _local.owners = _local.owners[:-1]


@contextlib.contextmanager
def suspended():
    """No scope is open inside this block; the open ones come back after it."""
    stack = _stack()
    saved = stack[:]
    stack.clear()
    try:
        yield
    finally:
        stack.extend(saved)
