"""``RowTable``: one ps shard's rows of an embedding table, created on first touch, capped, LRU-evicted.

Layout (docs/tables.md): ``rows`` and one array per update-rule slot, each
``capacity x dim`` float32; ``last_used``, one uint32 stamp per slot from a
clock that ticks once per creating lookup; a ``RowIndex`` (id -> slot); and,
with ``admit_after``, a fixed-size count-min sketch of how often each id was
looked up. The per-slot arrays are allocated to the cap up front and never
copied as the table grows. They are ``np.empty``, not ``np.zeros``: Linux maps
a large allocation's pages on first write, so only the rows handed out cost
memory, whereas ``calloc`` clears (and so maps) whatever memory the allocator
reuses, which after a large free can be all of it. Every row, slot and stamp
is written when its slot is handed out, before anything reads it. numpy
advises huge pages (``MADV_HUGEPAGE``) for arrays this large: the random reads
of a batch's rows then miss the TLB less, and since slots are handed out from 0
upward at most one partly used 2 MiB page per array is mapped beyond the rows.
Rows move in and out by ``np.take`` and ``np.put`` (``psdk/protocol/rowsio.py``), not fancy
indexing.

Semantics:

- A row is created by ``lookup(ids, create=True)``, initialised from
  (seed, table name, id, column) alone (``psdk/ps/tables/hashing.py``), so a
  row starts the same on any shard, in any touch order, after any restore.
- With ``admit_after = N``, each creating lookup counts each occurrence of an
  id in the sketch; a row is created once its count reaches N. Until then the
  id reads as zeros (DeepRec's choice, not the initial value) and
  ``admitted(ids)`` is False for it, so its updates can be dropped.
- When a creating lookup needs more rows than are free, the least recently
  looked-up rows are evicted (never ones the same lookup touches) and counted
  in ``evicted``. Eviction does not reset the sketch: an admitted id that was
  evicted comes back at its next lookup, with its initial row and zero slots.
- ``state()`` and ``export_chunks()`` hand out the rows, slots, stamps, sketch
  and counters as plain numpy arrays by name; ``restore()`` takes them back one
  chunk at a time into a staging table and replaces this one only at ``commit``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np

from psdk.protocol.chunks import SKETCH_DEPTH, SKETCH_WIDTH
from psdk.protocol.rowsio import put_rows, take_rows
from psdk.ps.tables.hashing import INITIALIZERS, CountMinSketch, initial_rows, table_key
from psdk.ps.tables.index import RowIndex, SlotIndex, check_ids

SLOT = "slot."
"""The prefix of a rule slot's array in a state or chunk (``slot.m`` for Adam's first moment)."""
REFILL_SHARE = 16
"""Eviction finds the oldest ``capacity / REFILL_SHARE`` rows at once and draws on them until touched."""
PULLS_REMEMBERED = 8
"""Training pulls whose (ids, slots) a push of the same ids reuses instead of probing again (a few per worker)."""


class RowTable:
    """Up to ``capacity`` rows of ``dim`` float32 values by non-negative int64 id, with per-row rule slots."""

    stamped: ClassVar[bool] = True
    """Whether rows carry LRU stamps (``last_used``): a table that never evicts needs none."""
    remembers_pulls: ClassVar[bool] = True
    """Whether :meth:`slots_of_pushed` reuses recent pulls' slots (worth it where finding them costs a probe)."""

    def __init__(
        self,
        dim: int,
        capacity: int,
        initializer: str = "normal",
        init_scale: float = 0.01,
        seed: int = 0,
        slot_names: Sequence[str] = (),
        admit_after: int = 0,
        name: str = "",
        sketch_depth: int = SKETCH_DEPTH,
        sketch_width: int = SKETCH_WIDTH,
        slot_init: Mapping[str, float] | None = None,
        index: SlotIndex | None = None,
    ) -> None:
        if dim < 1:
            raise ValueError(f"a table's rows need dim >= 1, not {dim}")
        if initializer not in INITIALIZERS:
            raise ValueError(f"unknown initializer {initializer!r}: one of {', '.join(INITIALIZERS)}")
        if admit_after < 0:
            raise ValueError(f"admit_after counts lookups: 0 (admit at once) or more, not {admit_after}")
        if len(set(slot_names)) != len(slot_names):
            raise ValueError(f"slot names repeat: {list(slot_names)}")
        self.dim, self.capacity, self.admit_after, self.name = dim, capacity, admit_after, name
        self.initializer, self.init_scale, self.seed = initializer, init_scale, seed
        self._sketch_shape = (sketch_depth, sketch_width)
        self.index: SlotIndex = RowIndex(capacity) if index is None else index
        self.rows = np.empty((capacity, dim), np.float32)
        self.slots = {slot: np.empty((capacity, dim), np.float32) for slot in slot_names}
        self.slot_init = {slot: float((slot_init or {}).get(slot, 0.0)) for slot in slot_names}
        """What each slot of a new row starts at (Adagrad's initial accumulator; 0 for the others)."""
        self.last_used = np.empty(capacity if self.stamped else 0, np.uint32)
        self.sketch = CountMinSketch(sketch_depth, sketch_width) if admit_after else None
        self.clock = self.evicted = self.created = 0
        self._key = table_key(seed, name)
        self._candidates = np.zeros(0, np.int32)
        self._stamps = np.zeros(0, np.uint32)
        self._pulled: deque[tuple[np.ndarray, np.ndarray, int]] = deque(maxlen=PULLS_REMEMBERED)
        """(ids, slots, ``evicted`` then) of the latest training pulls of distinct sorted ids."""

    def __len__(self) -> int:
        return len(self.index)

    # -- rows ---------------------------------------------------------------------------------

    def lookup(
        self, ids: np.ndarray, create: bool = True, increasing: bool = False, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The rows of ``ids`` (``len(ids) x dim``, a copy, in ``out`` if given); zeros for ids without a row.

        ``create=True`` (a training pull) counts the ids, stamps their rows as
        used and creates the rows of admitted ids; ``create=False`` (a read)
        changes nothing. ``increasing``: the caller has checked that ``ids``
        are non-negative int64 and strictly increasing (a served pull), so
        they are not looked at again.
        """
        if increasing or len(check_ids(ids)) < 2 or bool(np.all(ids[1:] > ids[:-1])):  # unique, sorted: no sort
            unique, inverse = ids, None
        else:
            unique, inverse = np.unique(ids, return_inverse=True)
        if create:
            slots, ends = self.index.find_with_ends(unique)
            self._count_stamp_create(unique, inverse, slots, ends)
            if inverse is None and self.remembers_pulls:
                slots.flags.writeable = False  # shared with the memory of pulls
                self._pulled.append((unique.copy(), slots, self.evicted))  # a copy: ids may sit in a message buffer
        else:
            slots = self.index.find(unique)
        have = slots >= 0
        into = out if inverse is None else None  # with duplicates, the unique rows are gathered first
        if bool(have.all()):
            found = take_rows(self.rows, slots, into)
        else:
            if into is None:
                found = np.zeros((len(unique), self.dim), np.float32)
            else:
                found = into
                found.fill(0.0)
            found[have] = take_rows(self.rows, slots[have])
        return found if inverse is None else take_rows(found, inverse, out)

    def _count_stamp_create(
        self, unique: np.ndarray, inverse: np.ndarray | None, slots: np.ndarray, ends: np.ndarray
    ) -> None:
        """A creating lookup's changes, after the one check that can refuse it, so a refusal changes nothing.

        An id is admitted on its count before this lookup plus its occurrences
        in it: at least its true count, as the sketch's own estimate after
        adding would be (which may also include collisions within the batch).
        """
        present = slots >= 0
        wanted = ~present
        counts = None
        if self.sketch is not None:  # admit_after 0: no counting at all
            counts = np.ones(len(unique), np.int64) if inverse is None else np.bincount(inverse, minlength=len(unique))
            wanted &= self.sketch.estimate(unique).astype(np.int64) + counts >= self.admit_after
        new = np.flatnonzero(wanted)
        touched = len(unique) - len(new) if counts is None else int(np.count_nonzero(present))
        if len(new) + touched > self.capacity:
            raise ValueError(
                f"a lookup of {len(new) + touched} distinct ids with rows cannot fit a table capped at {self.capacity}"
            )
        self._tick()
        if self.sketch is not None and counts is not None:
            self.sketch.add(unique, counts)
        self._stamp(slots if touched == len(unique) else slots[present])
        if len(new):
            slots[new] = self._create(unique[new], ends[new], self.index.rebuilds)

    def slots_of_pushed(self, ids: np.ndarray) -> np.ndarray:
        """Each of a push's distinct sorted ``ids``' slot, -1 where it has no row (as ``index.find``).

        A push's ids are most often those of a recent training pull (the
        worker's previous batch): when nothing was evicted since, each id
        then still has the slot that pull found or gave it, and only the ids
        without one are probed again (they may have been admitted since). The
        result is read-only.
        """
        for pulled, slots, evicted in reversed(self._pulled):
            if (len(pulled) == len(ids) and evicted == self.evicted and (not len(ids) or pulled[0] == ids[0])
                    and np.array_equal(pulled, ids)):  # fmt: skip
                absent = slots < 0
                if bool(absent.any()):
                    slots = slots.copy()
                    slots[absent] = self.index.find(ids[absent])
                return slots
        return self.index.find(ids)

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        """Which ids have a row now: updates to the others are to be dropped."""
        return self.index.find(ids) >= 0

    def _slots_of(self, ids: np.ndarray) -> np.ndarray:
        slots = self.index.find(ids)
        if (slots < 0).any():
            missing = ids[slots < 0]
            raise ValueError(f"{len(missing)} ids have no row (e.g. {int(missing[0])}): drop them with admitted()")
        return slots

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Copies of the rows and slots of ``ids`` (all with rows), as one block for a rule to update."""
        slots = self._slots_of(ids)
        return take_rows(self.rows, slots), {slot: take_rows(values, slots) for slot, values in self.slots.items()}

    def gather_slots(self, where: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Copies of the rows and rule slots at slot positions ``where`` (from ``index.find``: all >= 0)."""
        return take_rows(self.rows, where), {slot: take_rows(values, where) for slot, values in self.slots.items()}

    def scatter_slots(self, where: np.ndarray, rows: np.ndarray, slots: Mapping[str, np.ndarray]) -> None:
        """Write a block from :meth:`gather_slots` back to the same distinct positions (nothing moved since)."""
        put_rows(self.rows, where, rows)
        for slot, values in slots.items():
            put_rows(self.slots[slot], where, values)

    def scatter(self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray] | None = None) -> None:
        """Write back a block from ``gather``: ``ids`` distinct and with rows, each array ``len(ids) x dim``."""
        where = self._slots_of(ids)
        if len(np.unique(ids)) != len(ids):
            raise ValueError("scatter needs distinct ids: a repeated id would keep only one of its values")
        given = slots or {}
        unknown = set(given) - set(self.slots)
        if unknown:
            raise ValueError(f"unknown slots {sorted(unknown)}: this table has {sorted(self.slots)}")
        for values in (rows, *given.values()):
            if values.shape != (len(ids), self.dim):
                raise ValueError(f"a block for {len(ids)} ids is {(len(ids), self.dim)}, not {values.shape}")
        put_rows(self.rows, where, rows)
        for slot, values in given.items():
            put_rows(self.slots[slot], where, values)

    def _tick(self) -> None:
        self.clock += 1
        if self.clock >= np.iinfo(np.uint32).max:  # renumber the stamps by rank, keeping their order
            live = self.index.live_slots()
            distinct, rank = np.unique(take_rows(self.last_used, live), return_inverse=True)
            put_rows(self.last_used, live, rank.astype(np.uint32) + 1)
            self.clock = len(distinct) + 1
            self._candidates, self._stamps = self._candidates[:0], self._stamps[:0]

    def _create(self, ids: np.ndarray, ends: np.ndarray | None = None, rebuilds: int = -1) -> np.ndarray:
        """New rows for absent ``ids``, evicting the oldest rows (those this lookup touched are the newest)."""
        short = len(ids) - self.index.room
        if short > 0:
            oldest = self._oldest(short)
            self.index.remove_slots(oldest)
            self.evicted += len(oldest)
        slots = self.index.insert_absent(ids, ends, rebuilds)
        self._initialise(slots, ids)
        self._stamp(slots)
        self.created += len(ids)
        return slots

    def _initialise(self, slots: np.ndarray | slice, ids: np.ndarray) -> None:
        """The initial rows and slots of ``ids`` into ``slots`` (distinct slots, or a slice: a block in order)."""
        initial = initial_rows(ids, self.dim, self._key, self.initializer, self.init_scale)
        if isinstance(slots, slice):
            self.rows[slots] = initial
            for slot, values in self.slots.items():
                values[slots] = self.slot_init[slot]
            return
        put_rows(self.rows, slots, initial)
        for slot, values in self.slots.items():
            put_rows(values, slots, self.slot_init[slot])

    # -- stamps (LRU): a table that never evicts overrides these to keep none ---------------------

    def _stamp(self, slots: np.ndarray) -> None:
        """Mark ``slots`` (distinct) as used now."""
        put_rows(self.last_used, slots, self.clock)

    def _stamps_of(self, slots: np.ndarray) -> np.ndarray:
        return take_rows(self.last_used, slots)

    def _set_stamps(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        put_rows(self.last_used, slots, stamps)

    def _oldest(self, count: int) -> np.ndarray:
        """The ``count`` least recently used rows, oldest first.

        The oldest ``capacity / REFILL_SHARE`` rows are found once
        (``np.argpartition``) and drawn on until used up: a candidate whose stamp
        has not moved is still older than every row outside the list.
        """
        chosen: list[np.ndarray] = []
        while count:
            valid = take_rows(self.last_used, self._candidates) == self._stamps
            candidates, stamps = self._candidates[valid], self._stamps[valid]
            take = candidates[:count]
            chosen.append(take)
            count -= len(take)
            self._candidates, self._stamps = candidates[len(take) :], stamps[len(take) :]
            if count:
                live = self.index.live_slots()
                live = live[take_rows(self.last_used, live) < self.clock]
                k = min(len(live), max(count, self.capacity // REFILL_SHARE))
                pick = live[np.argpartition(take_rows(self.last_used, live), k - 1)[:k]]
                pick = pick[np.argsort(take_rows(self.last_used, pick), kind="stable")]
                self._candidates, self._stamps = pick.astype(np.int32), take_rows(self.last_used, pick)
        return np.concatenate(chosen)

    # -- memory -------------------------------------------------------------------------------

    def bytes_per_row(self) -> float:
        """Bytes per live row by the table's own count: values, slots, stamp, and its share of the index.

        The sketch is fixed (``sketch.counts.nbytes``), whatever the number of rows, and not included.
        """
        values = self.dim * 4 * (1 + len(self.slots)) + (self.last_used.itemsize if self.stamped else 0)
        return values + self.index.nbytes / max(len(self), 1)

    # -- state ----------------------------------------------------------------------------------

    def _config(self) -> np.ndarray:
        depth, width = self.sketch.counts.shape if self.sketch is not None else (0, 0)
        return np.array([self.dim, depth, width], np.int64)

    def _header(self) -> dict[str, np.ndarray]:
        counters = [self.clock, self.evicted, self.created, len(self)]
        return {"config": self._config(), "counters": np.array(counters, np.int64)}

    def _row_chunk(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        chunk = {
            "ids": self.index.ids_of(slots),
            "rows": take_rows(self.rows, slots),
            "last_used": self._stamps_of(slots),
        }
        chunk.update({SLOT + slot: take_rows(values, slots) for slot, values in self.slots.items()})
        return chunk

    def state(self) -> dict[str, np.ndarray]:
        """Everything, as plain numpy arrays by name: ``from_state`` (or ``restore``) takes it back."""
        state = {**self._header(), **self._row_chunk(self.index.live_slots())}
        if self.sketch is not None:
            state.update(sketch=self.sketch.counts.reshape(-1).copy(), sketch_offset=np.array([0], np.int64))
        return state

    def header(self) -> dict[str, np.ndarray]:
        """``config`` ([dim, sketch depth, sketch width]) and ``counters`` ([clock, evicted, created, rows])."""
        return self._header()

    def rows_from(self, cursor: int, chunk_rows: int) -> tuple[dict[str, np.ndarray], int | None]:
        """The live rows of slots ``[cursor, cursor + chunk_rows)`` (copies), and the next chunk's cursor.

        ``None``: that was the last. A cursor is a slot position, so a reader
        can stop and go on later, as long as nothing changed the table since
        (the ps reads the chunks while paused).
        """
        if chunk_rows < 1 or cursor < 0:
            raise ValueError(f"a chunk needs chunk_rows >= 1 and cursor >= 0, not {chunk_rows} and {cursor}")
        end = self.index.next_slot  # slots past it were never handed out
        stop = min(cursor + chunk_rows, end)
        return self._row_chunk(self.index.live_between(cursor, stop)), (stop if stop < end else None)

    def sketch_from(self, offset: int, count: int) -> tuple[np.ndarray, int | None]:
        """Up to ``count`` sketch counters from ``offset`` (a copy) and the next piece's offset (``None``: the last)."""
        if self.sketch is None:
            return np.zeros(0, np.uint32), None
        flat = self.sketch.counts.reshape(-1)
        stop = min(offset + count, len(flat))
        return flat[offset:stop].copy(), (stop if stop < len(flat) else None)

    def export_chunks(self, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
        """The state in pieces of at most ``chunk_rows`` rows (or ``chunk_rows * dim`` sketch counters).

        The pieces read the live table: nothing may change it until the last
        one is taken (the ps reads them while paused).
        """
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be at least 1, not {chunk_rows}")
        yield self._header()
        cursor: int | None = 0
        while cursor is not None:
            chunk, cursor = self.rows_from(cursor, chunk_rows)
            if len(chunk["ids"]):
                yield chunk
        offset: int | None = 0 if self.sketch is not None else None
        while offset is not None:
            start = offset
            piece, offset = self.sketch_from(start, chunk_rows * self.dim)
            yield {"sketch": piece, "sketch_offset": np.array([start], np.int64)}

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every row, by increasing id: the table for serving."""
        live = self.index.live_slots()
        ids = self.index.ids_of(live)
        order = np.argsort(ids, kind="stable")
        return ids[order], take_rows(self.rows, live[order])

    def restore(self) -> TableRestore:
        """A restore into a staging table of this one's settings, which replaces it only at ``commit``."""
        return TableRestore(self)

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], **settings: object) -> RowTable:
        """A table built with ``settings`` (``RowTable``'s arguments) holding ``state``."""
        table = cls(**settings)  # type: ignore[arg-type]
        restore = table.restore()
        restore.add(state)
        restore.commit()
        return table

    def clear(self) -> None:
        """Drop every row, slot, stamp and count: the table is as new, and its arrays' memory goes back.

        A rollback calls it before the restore's chunks come, since the rows are
        replaced whatever happens: the staging table then fills beside an empty
        table, not beside the old rows (one table's memory at a time, not two).
        """
        self.__dict__.update(self._empty_like().__dict__)

    def _empty_like(self) -> RowTable:
        depth, width = self._sketch_shape
        return RowTable(
            self.dim, self.capacity, self.initializer, self.init_scale, self.seed, tuple(self.slots),
            self.admit_after, self.name, depth, width, self.slot_init,
        )  # fmt: skip


class TableRestore:
    """Chunks of a state, loaded one at a time into a staging table; the target changes only at ``commit``.

    A chunk that does not fit raises ValueError and the restore may go on or be
    dropped: until ``commit`` succeeds, the target table is as it was.
    """

    def __init__(self, target: RowTable) -> None:
        self._target = target
        self._staging = target._empty_like()
        self._counters: np.ndarray | None = None
        self._sketch_filled = 0

    def __len__(self) -> int:
        """The rows loaded so far."""
        return len(self._staging)

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        """Load one chunk (any of: header, rows, sketch piece)."""
        staging = self._staging
        if "config" in chunk and not np.array_equal(chunk["config"], staging._config()):
            raise ValueError(f"the state is of a table [dim, sketch depth, width] {chunk['config'].tolist()}, "
                             f"this one is {staging._config().tolist()}")  # fmt: skip
        if "counters" in chunk:
            self._counters = np.asarray(chunk["counters"], np.int64).copy()
        if "ids" in chunk:
            self._add_rows(chunk)
        if "sketch" in chunk:
            if staging.sketch is None:
                raise ValueError("the state has a sketch but this table admits every id (admit_after=0)")
            if "sketch_offset" not in chunk:
                raise ValueError("a sketch piece needs its sketch_offset")
            flat, start = staging.sketch.counts.reshape(-1), int(chunk["sketch_offset"][0])
            piece = np.asarray(chunk["sketch"], np.uint32)
            if start < 0 or start + len(piece) > len(flat):
                raise ValueError(f"a sketch piece at {start} of {len(piece)} counters overruns {len(flat)}")
            flat[start : start + len(piece)] = piece
            self._sketch_filled += len(piece)

    def _add_rows(self, chunk: dict[str, np.ndarray]) -> None:
        staging = self._staging
        ids = check_ids(chunk["ids"])
        expected = {"ids", "rows", "last_used", *(SLOT + slot for slot in staging.slots)}
        given = {key for key in chunk if key == "rows" or key == "last_used" or key.startswith(SLOT)} | {"ids"}
        if given != expected:
            raise ValueError(f"a row chunk holds {sorted(given)}, this table needs {sorted(expected)}")
        for key in ("rows", *(SLOT + slot for slot in staging.slots)):
            if np.shape(chunk[key]) != (len(ids), staging.dim):
                raise ValueError(f"{key} of a chunk of {len(ids)} rows is {np.shape(chunk[key])}, not "
                                 f"{(len(ids), staging.dim)}")  # fmt: skip
        if np.shape(chunk["last_used"]) != (len(ids),):
            raise ValueError(f"last_used of a chunk of {len(ids)} rows has shape {np.shape(chunk['last_used'])}")
        if len(np.unique(ids)) != len(ids) or (staging.index.find(ids) >= 0).any():
            raise ValueError("the state repeats ids")
        slots = staging.index.insert(ids)
        put_rows(staging.rows, slots, chunk["rows"])
        staging._set_stamps(slots, chunk["last_used"])
        for slot, values in staging.slots.items():
            put_rows(values, slots, chunk[SLOT + slot])

    def commit(self) -> None:
        """Check the state is whole and make it the target's."""
        staging, counters = self._staging, self._counters
        if counters is None:
            raise ValueError("the restore never got the state's counters: the header chunk is missing")
        if int(counters[3]) != len(staging):
            raise ValueError(f"the state has {int(counters[3])} rows, the restore got {len(staging)}")
        if staging.sketch is not None and self._sketch_filled < staging.sketch.counts.size:
            raise ValueError(f"the restore got {self._sketch_filled} of {staging.sketch.counts.size} sketch counters")
        staging.clock, staging.evicted, staging.created = (int(c) for c in counters[:3])
        self._target.__dict__.update(staging.__dict__)
