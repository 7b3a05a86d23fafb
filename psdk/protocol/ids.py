"""A batch's distinct ids, sorted, and where each looked-up id sits among them: by one plain sort.

Every embedding step sorts ids: the worker pulls a batch's distinct ids in
increasing order (the ps takes them so), and a trainer that holds only the
pulled rows finds each lookup's row by its position among them. numpy 2's
``np.unique`` finds the distinct values by hashing first and sorts them after,
which on a click batch (26,624 ids over ten million, about 9,700 distinct)
takes 3.0 ms; ``np.unique(..., return_inverse=True)`` argsorts, 2.2 ms. A
plain ``np.sort`` of the same ids takes 0.3 ms, so both come here from one
plain sort of the ids packed with their own index into one int64 (id in the
high bits, index in the low), where ``argsort`` would be needed otherwise
(0.65-1.4 ms; ``python -m psdk.protocol.ids`` prints the figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def _sort(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ordered, order, first)``: ``flat`` sorted, the sorting permutation, and where each run of an id begins."""
    count = len(flat)
    bits = max((count - 1).bit_length(), 1)
    low, high = int(flat.min()), int(flat.max())
    if flat.dtype.kind in "iu" and low >= 0 and high < 1 << (63 - bits):
        packed = flat.astype(np.int64)  # a copy: sorted in place, then split in place
        packed <<= bits
        packed |= np.arange(count, dtype=np.int64)
        packed.sort()
        ordered = packed >> bits
        order = np.bitwise_and(packed, (1 << bits) - 1, out=packed)
    else:
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
    first = np.empty(count, bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered, order, first


def unique_positions(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique, positions)``: the distinct ids sorted, and where each of ``ids`` (flattened) is among them.

    ``unique[positions]`` is ``ids.reshape(-1)``: ``np.unique(ids, return_inverse=True)`` with the
    positions flattened and int64. Non-negative ids below ``2**(63 - b)`` (``b`` the bits of an index
    into ``ids``: below 2**48 for a batch of 32,768) are sorted packed with their index; others by argsort.
    """
    flat = np.asarray(ids).reshape(-1)
    count = len(flat)
    if count == 0:
        return flat.astype(np.int64), np.zeros(0, np.int64)
    ordered, order, first = _sort(flat)
    positions = np.empty(count, np.int64)
    positions[order] = np.cumsum(first) - 1
    return ordered[first].astype(flat.dtype, copy=False), positions


def _figures(repeats: int = 20) -> None:
    """Microseconds per click batch of each way (``python -m psdk.protocol.ids``)."""
    rng = np.random.default_rng(0)  # Zipf ids hashed over ten million, as a click batch's 26 fields of 1,024
    batches = [(rng.zipf(1.1, (1024, 26)) * 0x9E3779B1) % 10_000_000 for _ in range(repeats)]
    ways: dict[str, Callable[[np.ndarray], object]] = {
        "np.unique": np.unique,
        "np.unique(return_inverse=True)": lambda ids: np.unique(ids, return_inverse=True),
        "np.sort (the floor)": lambda ids: np.sort(ids, axis=None),
        "unique_positions": unique_positions,
    }
    for name, way in ways.items():
        started = time.thread_time()
        for ids in batches:
            way(ids)
        print(f"{name:32s} {(time.thread_time() - started) / repeats * 1e6:8.0f} µs CPU per batch of 26,624 ids")


if __name__ == "__main__":
    _figures()
