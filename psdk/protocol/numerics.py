"""Numeric checks shared by the ps's store, its update rules and its checks of what arrives."""

from __future__ import annotations

import math

import numpy as np

SAFE_MAGNITUDE = 1e30
"""Values below this cannot reach float32's limit (3.4e38) in the few operations of one update."""


def magnitude(values: np.ndarray) -> float:
    """An upper bound on the largest ``|x|`` of ``values``; ``inf`` exactly when one of them is NaN or Inf.

    One BLAS pass: the square root of the sum of squares (with 1% for the
    sum's rounding, and a little for values near zero). Only when that overflows (values beyond ~1.8e19) are
    the values looked at one by one, for the exact maximum.
    """
    flat = values.reshape(-1)
    if flat.size == 0:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        squares = float(np.dot(flat, flat)) if flat.dtype.kind == "f" else math.inf
    if math.isfinite(squares):
        return math.sqrt(squares) * 1.01 + 1e-15  # squares of values below ~1e-19 underflow to zero
    if not np.isfinite(flat).all():
        return math.inf
    return float(np.abs(flat).max())


def all_finite(values: np.ndarray) -> bool:
    """Whether no element is NaN or Inf."""
    return math.isfinite(magnitude(values))


def as_float32(values: np.ndarray) -> np.ndarray:
    """``values`` in float32; what does not fit becomes Inf (and is refused by :func:`all_finite`), silently."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, np.float32)
