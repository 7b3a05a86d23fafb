"""A preallocated range table's rows, indexed directly: the row of id ``i`` is slot ``i - low``.

A ``range`` table with ``preallocate=true`` holds on each shard every id of
its block ``[low, high)`` from placement on (:mod:`psdk.protocol.tables`), as
TensorFlow 1.x's partitioned variable does. Such a table needs none of
:class:`~psdk.ps.tables.index.RowIndex`'s machinery: no hash probe (a batch's
slots are one subtraction), no row creation after placement, no admission
(:class:`~psdk.protocol.tables.TableSpec` refuses ``admit_after`` with
``preallocate``) and no eviction (the block fits its shard's capacity). So
:class:`DirectTable` keeps no LRU stamps either: a checkpoint's ``last_used``
is all zeros (the format stays the same, and a lazy table that restores it
sees rows of equal age). Everything else, rows, slots, counters, chunks,
restore, export, is :class:`~psdk.ps.tables.table.RowTable`'s, unchanged.

:class:`DirectIndex` still tracks which slots hold a row (one byte per id of
the block): a restore fills a staging table chunk by chunk, and a lazy
table's checkpoint may hold only some of the block, whose missing rows are
then created on their first training pull, as a lazy table would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from psdk.protocol.chunks import SKETCH_DEPTH, SKETCH_WIDTH
from psdk.ps.tables.index import check_ids
from psdk.ps.tables.table import RowTable

PREALLOCATE_CHUNK = 1 << 14
"""Rows initialised per step at placement, each step one tick of the clock (as a creating lookup of them was).
A step's temporaries (the ids, their initial values' hashes) cost a few hundred bytes a row: about 6 MB here,
where steps of a million rows held over 200 MB beside the table for a moment (docs/tables.md, Memory). The
whole fill takes as long in small steps as in large ones: its cost is per row."""


class DirectIndex:
    """Ids ``[low, high)`` -> slots ``0 .. high-low-1`` by subtraction, with which slots hold a row."""

    def __init__(self, low: int, high: int) -> None:
        if not 0 <= low <= high or high - low >= 2**31:  # a shard's block may be empty (capacity < num_ps blocks)
            raise ValueError(f"a direct index holds a block of 0 to 2**31-1 ids from >= 0, not [{low}, {high})")
        self.low, self.capacity = low, high - low
        self._held = np.zeros(self.capacity, bool)
        self._live = 0
        self.rebuilds = 0
        """Never moves: nothing is rebuilt (``RowIndex``'s counterpart)."""

    def __len__(self) -> int:
        return self._live

    @property
    def full(self) -> bool:
        """Every id of the block has a row: a lookup needs no look at ``_held``."""
        return self._live == self.capacity

    @property
    def room(self) -> int:
        return self.capacity - self._live

    @property
    def next_slot(self) -> int:
        """One past the last slot a row may be in (``RowTable.rows_from`` reads up to it)."""
        return self.capacity

    @property
    def nbytes(self) -> int:
        return int(self._held.nbytes)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 where it has no row or is outside the block (duplicates allowed)."""
        slots = check_ids(ids) - self.low
        outside = (slots < 0) | (slots >= self.capacity)
        if bool(outside.any()):
            slots[outside] = -1
        if not self.full:
            inside = slots >= 0
            slots[inside & ~self._held[np.where(inside, slots, 0)]] = -1
        return slots

    def find_with_ends(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``find``, and (as ``RowIndex``'s chain ends) the slots, which is all an insert needs."""
        slots = self.find(ids)
        return slots, slots

    def live_slots(self) -> np.ndarray:
        return np.arange(self.capacity) if self.full else np.flatnonzero(self._held)

    def live_between(self, start: int, stop: int) -> np.ndarray:
        if start >= stop:
            return np.zeros(0, np.intp)
        return np.arange(start, stop) if self.full else start + np.flatnonzero(self._held[start:stop])

    def ids_of(self, slots: np.ndarray) -> np.ndarray:
        return np.asarray(slots, np.int64) + self.low

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, marking those without a row as holding one (ids of the block only)."""
        slots = check_ids(ids) - self.low
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"ids outside this block {self.low} .. {self.low + self.capacity - 1}")
        new = np.unique(slots[~self._held[slots]])
        self._held[new] = True
        self._live += len(new)
        return slots

    def insert_absent(self, ids: np.ndarray, ends: np.ndarray | None = None, rebuilds: int = -1) -> np.ndarray:
        """Slots for ``ids`` known to be distinct, of the block, and without a row (the caller has just found them)."""
        slots = ids - self.low
        self._held[slots] = True
        self._live += len(slots)
        return slots

    def fill(self) -> None:
        """Every id of the block holds a row (the table has just initialised them all)."""
        self._held[:] = True
        self._live = self.capacity

    def remove_slots(self, slots: np.ndarray) -> None:
        if len(slots):
            raise ValueError("a direct index never evicts: its block fits the shard")


class DirectTable(RowTable):
    """:class:`~psdk.ps.tables.table.RowTable` over the ids ``[low, high)``, every row held from the start."""

    stamped = False
    remembers_pulls = False  # finding a push's slots is one subtraction

    def __init__(
        self,
        low: int,
        high: int,
        dim: int,
        initializer: str = "normal",
        init_scale: float = 0.01,
        seed: int = 0,
        slot_names: Sequence[str] = (),
        name: str = "",
        slot_init: Mapping[str, float] | None = None,
        preallocate: bool = True,
        capacity: int | None = None,
    ) -> None:
        """``capacity``: the shard's (``TableSpec.shard_capacity``), which reports show; at least the block."""
        self.low, self.high = low, high
        self.direct = DirectIndex(low, high)
        if capacity is not None and capacity < high - low:
            raise ValueError(f"a capacity of {capacity} rows cannot hold the block {low} .. {high - 1}")
        held = high - low if capacity is None else capacity
        super().__init__(
            dim, held, initializer, init_scale, seed, slot_names, 0, name, SKETCH_DEPTH, SKETCH_WIDTH, slot_init,
            index=self.direct,
        )  # fmt: skip
        if preallocate:
            self.preallocate()

    def preallocate(self, progress: Callable[[], None] | None = None) -> None:
        """Every row of the block, initialised in place from (seed, name, id), a chunk at a time.

        ``progress`` is called after each chunk (the ps's liveness beat: a fill of millions of rows takes
        seconds). Not for a table a restore is about to fill: its rows would be made, then staged again.
        """
        block = self.direct.capacity
        for start in range(0, block, PREALLOCATE_CHUNK):
            stop = min(start + PREALLOCATE_CHUNK, block)
            self._tick()
            self._initialise(slice(start, stop), np.arange(self.low + start, self.low + stop, dtype=np.int64))
            if progress is not None:
                progress()
        self.direct.fill()
        self.created += block

    def _stamp(self, slots: np.ndarray) -> None:
        """No stamps: nothing is ever evicted."""

    def _stamps_of(self, slots: np.ndarray) -> np.ndarray:
        return np.zeros(len(slots), np.uint32)

    def _set_stamps(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """A checkpoint's stamps are dropped: nothing is ever evicted."""

    def _tick(self) -> None:
        self.clock = self.clock + 1 if self.clock + 1 < np.iinfo(np.uint32).max else 1

    def bytes_per_row(self) -> float:
        return self.dim * 4 * (1 + len(self.slots)) + self.index.nbytes / max(len(self), 1)

    def _empty_like(self) -> DirectTable:
        return DirectTable(
            self.low, self.high, self.dim, self.initializer, self.init_scale, self.seed, tuple(self.slots), self.name,
            self.slot_init, preallocate=False, capacity=self.capacity,
        )  # fmt: skip
