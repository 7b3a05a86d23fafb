"""Numeric checks shared by the ps's store, its update rules and its checks of what arrives."""

from __future__ import annotations

import math

import numpy as np


def all_finite(values: np.ndarray) -> bool:
    """Whether every element is finite: one BLAS pass, and an element-wise check only if it overflows.

    A NaN or Inf anywhere makes the sum of squares non-finite; so can large
    finite values (beyond ~1.8e19 in float32), which the exact check then clears.
    """
    flat = values.reshape(-1)
    if flat.size == 0:
        return True
    if flat.dtype.kind == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            if math.isfinite(float(np.dot(flat, flat))):
                return True
    return bool(np.isfinite(flat).all())


def as_float32(values: np.ndarray) -> np.ndarray:
    """``values`` in float32; what does not fit becomes Inf (and is refused by :func:`all_finite`), silently."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, np.float32)
