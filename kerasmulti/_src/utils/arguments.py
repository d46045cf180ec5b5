"""Checks of user arguments that need no TensorFlow (the launcher uses them too)."""

from __future__ import annotations

import math
import numbers

import numpy as np


def is_int(value) -> bool:
    """True for ints, numpy's included; False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_positive_int(value) -> bool:
    """True for an int of at least 1; False for bools, floats and anything else."""
    return is_int(value) and value >= 1


def is_real(value) -> bool:
    """True for a finite real number, numpy's included; False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def is_positive_finite(value) -> bool:
    """True for a real number above 0 and below infinity, numpy's included; False for bools."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(value)
        and value > 0
    )


def check_bool(value, caller: str, name: str, meaning: str) -> None:
    """Refuses anything but True or False: a string such as 'no' would count as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{caller}'s {name} must be True or False ({meaning}). Received: {name}={value!r}"
        )
