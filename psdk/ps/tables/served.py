"""One shard's part of a table as the ps serves it: checked ids in, rows out, a rule run on touched rows.

:class:`~psdk.ps.tables.table.RowTable` keeps the rows; this adds what the
protocol needs around it:

* **Checks on every id frame** before anything changes: int64, one
  dimension, strictly increasing (so duplicates cost one vector compare;
  the worker sums a batch's duplicates before it pushes), at most the
  table's ``max_ids``, and every id this shard's to hold (placement:
  :mod:`psdk.protocol.tables`). A row gradient must be float32 of
  ``len(ids) x dim`` and finite.
* **Rules on rows**: the job's update rule, the same object the dense
  variables use, runs on a block gathered from the touched rows and their
  slots, as if the block were a small flat shard (:func:`stage_update`). So
  SGD, momentum, Adagrad, Adam and any plugin's rule work on rows without
  a sparse variant, and a row's slots move only when the row is touched
  (lazy, as ``torch.optim.SparseAdam``). The rule's step count is the
  shard's: every shard applies every version, touched or not, so Adam's
  bias correction agrees across shards.
* **Two phases**: an update is staged into fresh blocks and checked finite
  (cheap: the block is the touched rows only), and written back only once
  the dense part of the same push was applied too, so a refused push
  changes neither.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from psdk.errors import NonFiniteError, RefusedError
from psdk.protocol.numerics import all_finite
from psdk.protocol.tables import TableSpec, owned_range, shard_of_ids
from psdk.ps.rules import RuleState, UpdateRule
from psdk.ps.tables.direct import DirectTable
from psdk.ps.tables.table import RowTable
from psdk.runtime.liveness import beat


@dataclass
class RowGrad:
    """One push's gradient for one table on one shard: checked ids and their rows."""

    ids: np.ndarray
    rows: np.ndarray


@dataclass
class StagedRows:
    """An update computed but not yet written: where the updated rows live, their new values and slots."""

    table: ServedTable
    where: np.ndarray
    """The rows' positions in the table (found once, when staged: nothing moves rows before the commit)."""
    rows: np.ndarray
    slots: dict[str, np.ndarray]


class ServedTable:
    """The rows of one table that one ps shard holds."""

    def __init__(self, spec: TableSpec, shard: int, num_ps: int, rule: UpdateRule, fill: bool = True) -> None:
        """``fill=False`` leaves a preallocated table empty: a restore fills it (:meth:`fill` does it later)."""
        self.spec, self.shard, self.num_ps = spec, shard, num_ps
        initial = rule.new_state(1).slots
        slot_init = {name: float(values[0]) for name, values in initial.items()}
        self.rows: RowTable
        if spec.preallocate:  # every id of the block has its row: indexed directly (psdk/ps/tables/direct.py)
            low, high = owned_range(spec, shard, num_ps)
            self.rows = DirectTable(
                low, high, spec.dim, spec.initializer, spec.init_scale, spec.seed, tuple(initial), spec.name, slot_init,
                preallocate=False, capacity=spec.shard_capacity(num_ps),
            )  # fmt: skip
        else:
            self.rows = RowTable(
                spec.dim,
                spec.shard_capacity(num_ps),
                spec.initializer,
                spec.init_scale,
                spec.seed,
                tuple(initial),
                spec.admit_after,
                spec.name,
                slot_init=slot_init,
            )
        self.dropped_rows = 0
        """Row gradients dropped because their id had no row (not admitted yet, or evicted since its pull)."""
        self.find_s = 0.0
        """Wall seconds updates spent finding their rows (the index's share of an apply: psdk.jobs.timesplit)."""
        if fill:
            self.fill()

    def fill(self) -> None:
        """Create every row of a preallocated table's range from the seed (nothing for a lazy table).

        Not for a table a restore is about to fill: its rows would be made and
        then staged again beside them, twice the table's memory at once.
        """
        if self.spec.preallocate:
            assert isinstance(self.rows, DirectTable)
            self.rows.preallocate(beat)  # beats: progress, not a stuck loop (5 million rows take seconds)

    # ------------------------------------------------------------ checks
    def check_ids(self, ids: np.ndarray, what: str, most: int | None = None) -> np.ndarray:
        """``ids`` if this shard may be sent them; a :class:`RefusedError` naming the problem otherwise.

        ``most``: the most ids allowed (the table's ``max_ids`` unless given: a restore's chunk size).
        """
        name = self.spec.name
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise RefusedError(
                f"{what} of table {name!r}: ids must be a 1-D int64 array, not {ids.dtype}{list(ids.shape)}"
            )
        most = self.spec.max_ids if most is None else most
        if len(ids) > most:
            limit = f"max_ids={most}" if most == self.spec.max_ids else f"the restore's chunk_rows={most}"
            raise RefusedError(f"{what} of table {name!r}: {len(ids)} ids, more than its {limit}")
        if len(ids) == 0:
            return ids
        if len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise RefusedError(f"{what} of table {name!r}: ids must be strictly increasing (sum duplicates first)")
        if int(ids[0]) < 0:
            raise RefusedError(f"{what} of table {name!r}: ids must be non-negative, got {int(ids[0])}")
        if self.spec.sharding == "range":
            low, high = owned_range(self.spec, self.shard, self.num_ps)
            if int(ids[0]) < low or int(ids[-1]) >= high:
                raise RefusedError(f"{what} of table {name!r}: ids outside this shard's {low} .. {high - 1}")
        elif self.num_ps > 1 and bool(np.any(shard_of_ids(self.spec, ids, self.num_ps) != self.shard)):
            raise RefusedError(f"{what} of table {name!r}: ids that another shard holds (hash placement)")
        return ids

    def check_grad(self, ids: np.ndarray, rows: np.ndarray) -> RowGrad:
        """A push's (ids, rows) once both are shown to be what this table takes."""
        return self.check_rows(self.check_ids(ids, "a push"), rows)

    def check_rows(self, ids: np.ndarray, rows: np.ndarray) -> RowGrad:
        """A push's (ids, rows), its ids checked already (by :meth:`check_ids`), once its rows are shown fit."""
        expected = (len(ids), self.spec.dim)
        if rows.dtype != np.float32 or rows.shape != expected:
            raise RefusedError(
                f"a push of table {self.spec.name!r}: rows are {rows.dtype}{list(rows.shape)}, "
                f"expected float32{list(expected)}"
            )
        if not all_finite(rows):
            raise RefusedError(f"a push of table {self.spec.name!r}: row gradients hold NaN or Inf: not applied")
        return RowGrad(ids, rows)

    # ------------------------------------------------------------ rows
    def pull(self, ids: np.ndarray, create: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """The rows of ``ids`` (checked by :meth:`check_ids`), in ``out`` if given; a training pull (``create``)
        counts, stamps, creates."""
        return self.rows.lookup(ids, create=create, increasing=True, out=out)

    def stage_update(self, grad: RowGrad, rule: UpdateRule, step: int, scale: float = 1.0) -> StagedRows:
        """The touched rows and slots after ``rule`` (at the shard's ``step``), not yet written back.

        Ids without a row are dropped and counted. ``scale`` multiplies the
        gradient first (a sync round's mean). Raises NonFiniteError, with
        nothing changed, when a result would hold NaN or Inf.
        """
        started = time.perf_counter()
        where, rows = self.rows.slots_of_pushed(grad.ids), grad.rows
        self.find_s += time.perf_counter() - started
        keep = where >= 0
        if not bool(keep.all()):
            self.dropped_rows += int(len(where) - np.count_nonzero(keep))
            where, rows = where[keep], rows[keep]
        block, slots = self.rows.gather_slots(where)
        if not len(where):
            return StagedRows(self, where, block, slots)
        g = rows.reshape(-1) if scale == 1.0 else (rows * np.float32(scale)).reshape(-1)
        flat_slots = {name: values.reshape(-1) for name, values in slots.items()}
        scratch = [np.empty(block.size, np.float32) for _ in range(rule.scratch_count())]
        state = RuleState(step=step, slots=flat_slots, scratch=scratch)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a non-finite result is refused below
            rule.apply(block.reshape(-1), g, state)
        if not (all_finite(block) and all(all_finite(values) for values in slots.values())):
            raise NonFiniteError(
                f"the update of table {self.spec.name!r} would leave NaN or Inf in its rows: refused, rows unchanged"
            )
        return StagedRows(self, where, block, slots)

    def commit(self, staged: StagedRows) -> None:
        if len(staged.where):
            self.rows.scatter_slots(staged.where, staged.rows, staged.slots)

    def stats(self) -> dict[str, int | float]:
        table = self.rows
        return {
            "rows": len(table),
            "created": table.created,
            "evicted": table.evicted,
            "dropped_rows": self.dropped_rows,
            "capacity": table.capacity,
            "bytes_per_row": round(table.bytes_per_row(), 1),
        }


def stage_all(
    tables: Mapping[str, ServedTable], grads: Mapping[str, RowGrad], rule: UpdateRule, step: int, scale: float = 1.0
) -> list[StagedRows]:
    """Every table's staged update of one push (or round); nothing is written if any one is refused."""
    return [tables[name].stage_update(grad, rule, step, scale) for name, grad in grads.items()]


def merge_grads(grads: list[RowGrad]) -> RowGrad:
    """One table's row gradients of a sync round as one: each id once, its rows summed (sparse, never dense).

    The sum is float32 and may overflow to Inf: the rule's result is then
    non-finite and the round is refused, as a dense round's would be.
    """
    if len(grads) == 1:
        return grads[0]
    ids = np.concatenate([g.ids for g in grads])
    rows = np.concatenate([g.rows for g in grads])
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    unique, starts = np.unique(ids, return_index=True)
    with np.errstate(over="ignore", invalid="ignore"):
        summed = np.add.reduceat(rows, starts, axis=0) if len(ids) else rows
    return RowGrad(unique, summed.astype(np.float32, copy=False))
