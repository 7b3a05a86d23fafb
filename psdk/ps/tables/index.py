"""``RowIndex``: int64 id -> row slot, open addressing in numpy arrays, probed a whole batch at a time.

The index is one int32 array of positions (a power of two of them, at most half
in use, so probe chains stay short) holding slot numbers, plus ``slot_ids``, the
id of each slot. A position holds a slot, not an id: 4 bytes per position, and
the id is read back through ``slot_ids`` to confirm a match. Linear probing:
each round looks at one position for every id still unresolved, so a batch of a
million ids costs a few vectorised rounds, never a Python step per id, and no
Python object exists per row.

Slots are handed out in order (the row arrays they index are touched in order,
so Linux maps their pages as the table fills), and evicted slots go to a free
list that is drawn first. Deletion leaves a tombstone; when tombstones and live
entries reach half the positions, the positions are rebuilt (and doubled if the
live ones need it): this copies the index, never the rows.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from psdk.ps.tables.hashing import hash_ids

EMPTY = -1
TOMBSTONE = -2
MIN_POSITIONS = 1024
PROBE_TAIL = 16
"""Ids a probe resolves one by one in Python rather than in another vectorised round (see ``_probe``)."""
REBUILD_BLOCK = 1 << 16
"""Slots a rebuild re-places at a time: its temporaries (about 70 bytes an entry) stay this size, not the table's."""


def check_ids(ids: object) -> np.ndarray:
    """``ids`` if it is a 1-D int64 numpy array of non-negative ids; a clear ValueError otherwise."""
    if not isinstance(ids, np.ndarray):
        raise ValueError(f"table ids must be a numpy int64 array, not {type(ids).__name__}")
    if ids.dtype != np.int64:
        raise ValueError(f"table ids must be int64, not {ids.dtype}: hashed feature ids are int64")
    if ids.ndim != 1:
        raise ValueError(f"table ids must be one-dimensional, not of shape {ids.shape}")
    if len(ids) and int(ids.min()) < 0:
        raise ValueError(f"table ids must be non-negative, got {int(ids.min())}")
    return ids


def _positions_for(live: int) -> int:
    """The power of two of positions that leaves ``live`` entries at most a third full after a rebuild.

    A third, not a half: a full table that keeps evicting then makes room for
    at least ``live / 2`` tombstones before the next rebuild.
    """
    return max(MIN_POSITIONS, 1 << int(3 * max(live, 1) - 1).bit_length())


class SlotIndex(Protocol):
    """What a :class:`~psdk.ps.tables.table.RowTable` asks of its index: :class:`RowIndex` (hashed ids, any
    int64) or a preallocated block's direct one (:class:`psdk.ps.tables.direct.DirectIndex`, slot = id - low)."""

    rebuilds: int

    def __len__(self) -> int: ...
    @property
    def room(self) -> int: ...
    @property
    def next_slot(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def find(self, ids: np.ndarray) -> np.ndarray: ...
    def find_with_ends(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def live_slots(self) -> np.ndarray: ...
    def live_between(self, start: int, stop: int) -> np.ndarray: ...
    def ids_of(self, slots: np.ndarray) -> np.ndarray: ...
    def insert(self, ids: np.ndarray) -> np.ndarray: ...
    def insert_absent(self, ids: np.ndarray, ends: np.ndarray | None = None, rebuilds: int = -1) -> np.ndarray: ...
    def remove_slots(self, slots: np.ndarray) -> None: ...


class RowIndex:
    """Maps up to ``capacity`` distinct non-negative int64 ids to slots ``0 .. capacity-1``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1 or capacity >= 2**31:
            raise ValueError(f"a row index holds 1 to 2**31-1 rows, not {capacity}")
        self.capacity = capacity
        # np.empty, not np.zeros: allocated to the cap, never written until used (see RowTable), and
        # read only below next_slot (slot_ids) or _n_free (the free list).
        self.slot_ids = np.empty(capacity, np.int64)
        self._free = np.empty(capacity, np.int32)
        self._n_free = 0
        self._free_high = 0
        self.next_slot = 0
        self._live = 0
        self._tombstones = 0
        self._positions = np.full(MIN_POSITIONS, EMPTY, np.int32)
        self.rebuilds = 0
        """How many times the positions were rebuilt: a probe's chain ends are stale once it moves."""

    def __len__(self) -> int:
        return self._live

    @property
    def room(self) -> int:
        """How many more ids fit."""
        return self.capacity - self._live

    @property
    def nbytes(self) -> int:
        """Bytes the index has touched: its positions, the used part of ``slot_ids`` and of the free list."""
        return int(self._positions.nbytes + self.next_slot * 8 + self._free_high * 4)

    def _probe(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each id, its position and slot if present, else the empty position ending its chain and -1.

        Vectorised rounds, each one step along every unresolved chain, until
        :data:`PROBE_TAIL` ids are left; those few walk on in Python. A round
        costs about a dozen numpy calls whatever its size, and the last ids
        of a batch are those with the longest chains (8 rounds for ~1,000 of
        3,200 ids at 45% load): walked one by one, the tail costs less than
        its rounds did. A position below zero (empty, tombstone) reads
        ``slot_ids[0]`` (``mode="clip"``), which is then masked out.
        """
        positions, mask, slot_ids = self._positions, len(self._positions) - 1, self.slot_ids
        pos = (hash_ids(ids) & np.uint64(mask)).astype(np.intp)
        entry = positions.take(pos)
        found = (slot_ids.take(entry, mode="clip") == ids) & (entry >= 0)
        slot = np.where(found, entry, np.int32(-1))
        active = np.flatnonzero(~found & (entry != EMPTY))
        wanted, at = ids[active], pos[active]
        while len(active) > PROBE_TAIL:
            at = (at + 1) & mask
            entry = positions.take(at)
            found = (slot_ids.take(entry, mode="clip") == wanted) & (entry >= 0)
            slot[active[found]] = entry[found]
            stay = ~found & (entry != EMPTY)
            pos[active[~stay]] = at[~stay]
            active, wanted, at = active[stay], wanted[stay], at[stay]
        for i, want, p in zip(active.tolist(), wanted.tolist(), at.tolist(), strict=True):
            while True:  # ends: entries and tombstones fill at most half the positions, the rest are EMPTY
                p = (p + 1) & mask
                e = int(positions[p])
                if e == EMPTY or (e >= 0 and int(slot_ids[e]) == want):
                    pos[i] = p
                    slot[i] = e  # EMPTY is -1: absent
                    break
        return pos, slot

    def _place(self, ids: np.ndarray, slots: np.ndarray, ends: np.ndarray | None = None) -> None:
        """Write absent, distinct ``ids`` -> ``slots``; of ids racing for a position one wins, the rest probe on.

        The racers all write their slot and read back which one stayed: no sort
        needed to pick a winner, and whichever numpy lets win, each position
        ends up holding exactly one of them. ``ends``: where a probe of the
        same positions found each id's chain to end (an empty position), so
        neither the hash nor the chain is walked again.
        """
        positions, mask = self._positions, len(self._positions) - 1
        at = (hash_ids(ids) & np.uint64(mask)).astype(np.intp) if ends is None else ends
        todo = slots
        while len(todo):  # each round carries only the ids still to place (no index arrays back into the batch)
            entry = positions.take(at)
            free = entry < 0
            np.put(positions, at[free], todo[free])  # racers for one position: one stays
            placed = free & (positions.take(at) == todo)
            self._tombstones -= int(np.count_nonzero(entry[placed] == TOMBSTONE))
            left = ~placed
            todo, at = todo[left], (at[left] + 1) & mask

    def _rebuild(self, live_after: int) -> None:
        """New positions for the live entries, tombstones dropped, sized for ``live_after`` entries.

        The live slots are re-placed a block of :data:`REBUILD_BLOCK` slots at a
        time: placed whole, a rebuild at 4 million rows held about 300 MB of
        temporaries for a moment, more than the rows' own slots (docs/tables.md,
        Memory). Placing in blocks gives the same positions' contents.
        """
        self._positions = np.full(_positions_for(live_after), EMPTY, np.int32)
        self.rebuilds += 1
        self._tombstones = 0
        for start in range(0, self.next_slot, REBUILD_BLOCK):
            block = start + np.flatnonzero(self.slot_ids[start : min(start + REBUILD_BLOCK, self.next_slot)] >= 0)
            self._place(self.slot_ids[block], block.astype(np.int32))

    def live_slots(self) -> np.ndarray:
        """The slots in use, in slot order."""
        return np.flatnonzero(self.slot_ids[: self.next_slot] >= 0)

    def live_between(self, start: int, stop: int) -> np.ndarray:
        """The slots in use in ``[start, stop)``, in slot order (``stop`` at most ``next_slot``)."""
        return start + np.flatnonzero(self.slot_ids[start:stop] >= 0) if start < stop else np.zeros(0, np.intp)

    def ids_of(self, slots: np.ndarray) -> np.ndarray:
        """The id of each slot in use."""
        return self.slot_ids[slots]

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 where absent (duplicates allowed)."""
        return self._probe(check_ids(ids))[1]

    def find_with_ends(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each id's slot (-1 where absent), and each absent id's chain end, for :meth:`insert_absent`."""
        pos, slots = self._probe(check_ids(ids))
        return slots, pos

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, new slots for ids not yet present (duplicates and any order allowed)."""
        unique, inverse = np.unique(check_ids(ids), return_inverse=True)
        slots = self._probe(unique)[1]
        new = np.flatnonzero(slots < 0)
        slots[new] = self.insert_absent(unique[new])
        return slots[inverse]

    def insert_absent(self, ids: np.ndarray, ends: np.ndarray | None = None, rebuilds: int = -1) -> np.ndarray:
        """Slots for ``ids`` known to be distinct and absent (the caller has just probed them).

        ``ends`` (from :meth:`find_with_ends`, taken when ``rebuilds`` was this
        index's count, with at most :meth:`remove_slots` since) saves walking
        their chains again; a rebuild since makes them stale, and they are
        then not used.
        """
        if len(ids) > self.room:
            raise ValueError(f"{len(ids)} new ids do not fit: the index has room for {self.room} of {self.capacity}")
        if len(ids) == 0:
            return np.zeros(0, np.int32)
        if 2 * (self._live + self._tombstones + len(ids)) > len(self._positions):
            self._rebuild(self._live + len(ids))
        fresh = self._take_slots(len(ids))
        self.slot_ids[fresh] = ids
        self._place(ids, fresh, ends if rebuilds == self.rebuilds else None)
        self._live += len(ids)
        return fresh

    def _take_slots(self, count: int) -> np.ndarray:
        reused = min(count, self._n_free)
        from_free = self._free[self._n_free - reused : self._n_free].copy()
        self._n_free -= reused
        start = self.next_slot
        self.next_slot += count - reused
        return np.concatenate([from_free, np.arange(start, self.next_slot, dtype=np.int32)])

    def remove_slots(self, slots: np.ndarray) -> None:
        """Free distinct live ``slots``: tombstones in the positions, the slots onto the free list."""
        slots = np.asarray(slots, np.int32)
        if len(slots) == 0:
            return
        pos, found = self._probe(self.slot_ids[slots])
        if not np.array_equal(found, slots):
            raise ValueError("remove_slots was given slots that are not live")
        self._positions[pos] = TOMBSTONE
        self._tombstones += len(slots)
        self.slot_ids[slots] = -1
        self._free[self._n_free : self._n_free + len(slots)] = slots
        self._n_free += len(slots)
        self._free_high = max(self._free_high, self._n_free)
        self._live -= len(slots)
