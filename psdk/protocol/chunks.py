"""How a table travels in chunks (checkpoints and restores): the sizes both sides agree on, and the stamps' encoding.

Kept in the protocol so the ps (:mod:`psdk.ps.tables.chunks`) and the chief
(:mod:`psdk.client.tablestate`) share one definition without importing
each other's side.
"""

from __future__ import annotations

import numpy as np

MAX_CHUNK_ROWS = 1 << 20
"""The most rows one chunk may carry, whatever the chief asks (a flood bound, as ``MAX_IDS_PER_REQUEST``)."""
SKETCH_DEPTH, SKETCH_WIDTH = 4, 1 << 18
"""The admission sketch's shape: 4 MiB of counters, whatever the number of rows."""
SKETCH_PIECE_MIN = 1 << 16
"""The fewest counters a sketch piece may hold (256 KiB), so small chunks do not cut the 4 MiB sketch into
thousands of messages."""


def row_bytes(dim: int, slots: int) -> int:
    """One row in a chunk: its id, stamp, values and slots."""
    return 8 + 4 + 4 * dim * (1 + slots)


def sketch_piece(dim: int, slots: int, chunk_rows: int) -> int:
    """Counters per sketch piece: as many bytes as a chunk of rows, and at least :data:`SKETCH_PIECE_MIN`."""
    return max(chunk_rows * row_bytes(dim, slots) // 4, SKETCH_PIECE_MIN)


def as_wire(counts: np.ndarray) -> np.ndarray:
    """uint32 stamps and counters travel as the same bits in int32 (the wire takes no unsigned types but bytes)."""
    return counts.view(np.int32)


def from_wire(counts: np.ndarray) -> np.ndarray:
    """The uint32 values :func:`as_wire` sent; an array of another dtype is left as it is (and refused later)."""
    return counts.view(np.uint32) if counts.dtype == np.int32 else counts
