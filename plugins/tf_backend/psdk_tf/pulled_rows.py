"""A table as a worker holds it on TensorFlow without a ``capacity x dim`` variable: the rows the ps sent, by id.

The bridge's tables (:mod:`psdk_tf.tables`) are variables of the whole
table that rows are scattered into; TensorFlow fills a variable when it
makes it, so a 10-million-row table of 16 floats costs 640 MB on every
worker before the first row arrives. :class:`PulledRows` keeps only the
rows written, sorted by id: a training step takes the rows of a batch's
distinct ids (:meth:`rows_of`, the held rows themselves when they are the
batch's) and gathers the lookups in the graph; predictions gather a
batch's rows in numpy (:meth:`gather`).

What it holds: the rows written since the last training step. psdk's loop
writes a batch's rows (one write per table, or one per chunk) before each
step, and an evaluation writes a set's rows, chunk by chunk, before its
predictions; so the first write after a step starts afresh (:meth:`retire`
marks the step), and writes in between add up, a later row of an id
replacing an earlier one. An id no write named reads zeros, as an id the ps
never trained reads.
"""

from __future__ import annotations

import numpy as np

from psdk.errors import PsdkError

_NO_IDS = np.zeros(0, np.int64)


class PulledRows:
    """The rows of table ``name`` (``dim`` wide, ids in ``[0, capacity)``) that the ps sent, and nothing else."""

    def __init__(self, name: str, dim: int, capacity: int):
        self.name, self.dim, self.capacity = name, int(dim), int(capacity)
        self._ids = _NO_IDS
        self._rows = np.zeros((1, self.dim), np.float32)
        """The rows of ``_ids`` in id order, then a row of zeros: where an id not written points."""
        self._written: list[tuple[np.ndarray, np.ndarray]] = []
        """Writes not yet merged into ``_ids`` and ``_rows`` (merged at the next gather, once), each with its rows
        followed by a row of zeros as ``_rows`` is."""
        self._retired = False

    @property
    def held(self) -> int:
        """How many rows it holds (after merging what was written)."""
        self._merge()
        return len(self._ids)

    @property
    def shape(self) -> tuple[int, int]:
        """The table's shape as the model declares it (``capacity x dim``); it holds :attr:`held` rows of it."""
        return self.capacity, self.dim

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep ``rows`` (copied) as the rows of ``ids``; the first write after :meth:`retire` drops the old rows."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        rows = np.asarray(rows, np.float32)
        if rows.shape != (len(ids), self.dim):
            raise PsdkError(
                f"table {self.name!r}: got rows of shape {rows.shape} for {len(ids)} ids of width {self.dim}"
            )
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.capacity):
            raise PsdkError(
                f"table {self.name!r}: ids must be in [0, {self.capacity}), got {int(ids.min())} .. "
                f"{int(ids.max())}; hash ids into [0, capacity) before the lookup"
            )
        if self._retired:
            self._ids, self._rows, self._written = _NO_IDS, self._rows[-1:], []
            self._retired = False
        padded = np.empty((len(ids) + 1, self.dim), np.float32)  # the one copy, with the zeros row after
        padded[:-1], padded[-1] = rows, 0.0
        self._written.append((ids.copy(), padded))

    def retire(self) -> None:
        """A training step used these rows: the next write brings the next batch's and replaces them."""
        self._retired = True

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (any shape, duplicates allowed), float32 ``ids.shape + (dim,)``."""
        self._merge()
        ids = np.asarray(ids, np.int64)
        # Searching the distinct ids, in order, costs less than searching every lookup (2 ms against 3 at
        # batch 1024); np.take is ten times faster than fancy indexing here.
        distinct, where = np.unique(ids.reshape(-1), return_inverse=True)
        rows = np.take(self._rows, np.take(self._places(distinct), where), axis=0)
        return rows.reshape(*ids.shape, self.dim)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (strictly increasing), zeros for an id not written: the held rows themselves
        when ``ids`` are the held ids (a training step's, as pulled), else gathered."""
        self._merge()
        if len(ids) == len(self._ids) and np.array_equal(ids, self._ids):
            return self._rows[:-1]
        return np.take(self._rows, self._places(ids), axis=0)

    def _places(self, distinct: np.ndarray) -> np.ndarray:
        """Where each of ``distinct`` (strictly increasing) is among the held rows; the zeros row if not held."""
        at = np.searchsorted(self._ids, distinct)
        if len(self._ids):
            np.minimum(at, len(self._ids) - 1, out=at)
            at[self._ids[at] != distinct] = len(self._ids)  # not written: the zeros row
        return at

    def _merge(self) -> None:
        """Fold the pending writes into the sorted rows; later writes of an id win."""
        if not self._written:
            return
        if not len(self._ids) and len(self._written) == 1 and _increasing(self._written[0][0]):
            ids, rows = self._written[0]  # a training step's one write: sorted already, as the ps sends them
        else:
            ids = np.concatenate([self._ids, *(i for i, _ in self._written)])
            rows = np.concatenate([self._rows[:-1], *(r[:-1] for _, r in self._written)])
            order = np.argsort(ids, kind="stable")
            ordered = ids[order]
            last = np.ones(len(ordered), bool)  # the last of each run of equal ids: the newest row
            last[:-1] = ordered[1:] != ordered[:-1]
            keep = order[last]
            ids, rows = ids[keep], np.concatenate([rows[keep], np.zeros((1, self.dim), np.float32)])
        self._ids, self._rows, self._written = ids, rows, []


def _increasing(ids: np.ndarray) -> bool:
    return bool(len(ids) < 2 or np.all(ids[1:] > ids[:-1]))
