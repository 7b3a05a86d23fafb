"""The reference model's embedding tables: one shard's rows by id, in float64, and what requests do to them.

A table in the model is a dict ``id -> row`` with each row's rule slots, as
the ps should hold it (:mod:`psdk.ps.tables`), with the semantics written
out again here: a training pull creates the rows of the ids it names once
their id was pulled ``admit_after`` times (until then the id reads zeros),
a read creates nothing, and a push's rows go through the update rule's
formulas (:class:`psdk.fuzz.model.RuleModel`, the same float64 arithmetic
the dense model uses) on the touched rows only, at the shard's rule step;
gradients of ids without a row are dropped and counted. Only a row's
initial value is taken from psdk (:func:`psdk.ps.tables.hashing.initial_rows`):
it is a hash of (seed, table, id), nothing to restate.

Eviction is not modelled: which of several rows stamped in one lookup goes
first is the ps's choice. A table whose rows would pass its capacity stops
being followed from then on (:attr:`TableModel.followed`); the fuzzer then
checks only that the ps evicted, and that what it holds and answers is finite
and of the right shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from psdk.ps.tables.hashing import initial_rows, table_key


class RuleModel(Protocol):
    """What a table needs of :class:`psdk.fuzz.model.RuleModel` (named so, not imported: it imports this)."""

    def slot_names(self) -> tuple[str, ...]: ...

    def initial_slots(self, size: int) -> dict[str, np.ndarray]: ...

    def step(
        self, p: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray], t: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...


ROUNDING = 2.0**-20
"""As the dense model's: what float32 may lose on one update, relative to its largest value."""


@dataclass
class RowRequest:
    """The table part of a request as the fuzzer reads it: rows pushed by table, ids pulled in order."""

    pushes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    pulls: list[tuple[str, np.ndarray, bool]] = field(default_factory=list)
    """(table, ids, create): ``create`` for a training pull, not for a read."""


def row_request(
    entries: Any, arrays: list[np.ndarray], named: Mapping[str, np.ndarray] | None = None
) -> RowRequest | None:
    """The table part of a request whose arrays after the dense gradient are ``arrays``; ``None`` if unreadable.

    Lenient on purpose: a request the ps took must be readable here, and the
    model is told what the ps was sent, not what it should have checked.
    ``named``: by table, the ids of the pull a ``pulled`` entry names (its rows come without them).
    """
    request, at = RowRequest(), 0
    if entries is None:
        return request if not arrays else None
    if not isinstance(entries, list):
        return None
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("table"), str):
            return None
        name = entry["table"]
        if entry.get("push") and entry.get("pulled"):
            if named is None or name not in named or at >= len(arrays):
                return None
            request.pushes[name] = (np.asarray(named[name], np.int64), np.asarray(arrays[at], np.float64))
            at += 1
        elif entry.get("push"):
            if at + 2 > len(arrays):
                return None
            request.pushes[name] = (np.asarray(arrays[at], np.int64), np.asarray(arrays[at + 1], np.float64))
            at += 2
        if entry.get("pull"):
            if at >= len(arrays):
                return None
            request.pulls.append((name, np.asarray(arrays[at], np.int64), not entry.get("read")))
            at += 1
    return request if at == len(arrays) else None


@dataclass
class StagedRows:
    """A table's update computed but not yet written (the dense part of the same push may still be refused)."""

    table: TableModel
    ids: list[int]
    rows: np.ndarray
    slots: dict[str, np.ndarray]
    grad: np.ndarray


@dataclass
class TableState:
    """What the ps's shard holds of one table, read while it is idle: rows and slots by id, and its counters."""

    ids: np.ndarray
    rows: np.ndarray
    slots: dict[str, np.ndarray]
    evicted: int
    dropped: int


class TableModel:
    """One table as the shard should hold it (``num_ps=1``: every row is this shard's)."""

    def __init__(self, spec: dict[str, Any], rule: RuleModel) -> None:
        self.name, self.dim, self.capacity = str(spec["name"]), int(spec["dim"]), int(spec["capacity"])
        self.admit_after = int(spec.get("admit_after", 0))
        self.initializer, self.scale = str(spec.get("initializer", "normal")), float(spec.get("init_scale", 0.01))
        self.max_ids = int(spec.get("max_ids", 1 << 16))
        self.key = table_key(int(spec.get("seed", 0)), self.name)
        self.rule = rule
        self.rows: dict[int, np.ndarray] = {}
        self.slots: dict[int, dict[str, np.ndarray]] = {}
        self.seen: Counter[int] = Counter()
        """Training pulls of each id (the ps's sketch may count more only where ids collide in every row)."""
        self.followed = True
        self.dropped = 0
        self.slack = 0.0
        """Absolute error float32 may have gathered in the rows and slots (as the dense model's slack)."""

    # ------------------------------------------------------------ pulls
    def lookup(self, ids: np.ndarray, create: bool) -> np.ndarray | None:
        """The rows a pull of ``ids`` answers (zeros where no row); ``None`` once the table is not followed."""
        if create:
            absent = [int(i) for i in ids if int(i) not in self.rows]
            admitted = [i for i in absent if self.seen[i] + 1 >= self.admit_after]
            self.seen.update(int(i) for i in ids)
            if len(self.rows) + len(admitted) > self.capacity:
                self.followed = False  # the ps evicts: which rows is its choice among equal stamps
            elif admitted:
                fresh = initial_rows(np.array(admitted, np.int64), self.dim, self.key, self.initializer, self.scale)
                start = self.rule.initial_slots(self.dim)
                for i, row in zip(admitted, fresh, strict=True):
                    self.rows[i] = row.astype(np.float64)
                    self.slots[i] = {name: values.copy() for name, values in start.items()}
        if not self.followed:
            return None
        zeros = np.zeros(self.dim)
        return np.array([self.rows.get(int(i), zeros) for i in ids], np.float64).reshape(len(ids), self.dim)

    # ------------------------------------------------------------ pushes
    def stage(self, ids: np.ndarray, grad: np.ndarray, t: int) -> StagedRows | None:
        """The rule applied to the rows of ``ids`` that have one, at rule step ``t``; nothing written yet."""
        if not self.followed:
            return None
        keep = [k for k, i in enumerate(ids) if int(i) in self.rows]
        self.dropped += len(ids) - len(keep)
        kept = [int(ids[k]) for k in keep]
        g = np.asarray(grad, np.float64).reshape(len(ids), self.dim)[keep]
        p = np.array([self.rows[i] for i in kept], np.float64).reshape(len(kept), self.dim)
        slots = {
            name: np.array([self.slots[i][name] for i in kept], np.float64).reshape(len(kept), self.dim)
            for name in self.rule.slot_names()
        }
        with np.errstate(all="ignore"):
            rows, new = self.rule.step(p, g, slots, t)
        return StagedRows(self, kept, rows, new, g)

    def commit(self, staged: StagedRows) -> None:
        if not staged.ids:
            return
        largest = max(_abs_max(staged.rows), _abs_max(staged.grad), *map(_abs_max, staged.slots.values()))
        self.slack += ROUNDING * largest
        for k, i in enumerate(staged.ids):
            self.rows[i] = staged.rows[k]
            self.slots[i] = {name: values[k] for name, values in staged.slots.items()}

    # ------------------------------------------------------------ comparing
    def compare(self, held: TableState, rtol: float, atol: float) -> list[str]:
        """Where the ps's rows of this table differ from the model's."""
        what = f"table {self.name!r}"
        if not self.followed:
            problems = [] if held.evicted else [f"{what} holds more rows than its capacity, but evicted none"]
            if len(held.ids) > self.capacity:
                problems.append(f"{what} holds {len(held.ids)} rows, past its capacity {self.capacity}")
            return problems
        ids = sorted(self.rows)
        if held.ids.tolist() != ids:
            return [f"{what}: the ps holds rows of ids {held.ids.tolist()[:12]}, the model {ids[:12]}"]
        problems = []
        if held.dropped != self.dropped:
            problems.append(f"{what}: the ps dropped {held.dropped} row gradients, the model {self.dropped}")
        if not ids:
            return problems
        want = np.array([self.rows[i] for i in ids])
        problems += differs(f"{what}'s rows", held.rows, want, rtol, atol + self.slack)
        for name in self.rule.slot_names():
            if name not in held.slots:
                problems.append(f"{what} keeps no slot {name!r}")
                continue
            want = np.array([self.slots[i][name] for i in ids])
            problems += differs(f"{what}'s slot {name}", held.slots[name], want, rtol, atol + self.slack)
        return problems

    def check_reply(self, got: np.ndarray, want: np.ndarray | None, rtol: float, atol: float) -> list[str]:
        """A reply's rows of this table against the model's (shape and finiteness only once not followed)."""
        what = f"the rows of table {self.name!r} a reply carried"
        if got.dtype != np.float32 or got.ndim != 2 or got.shape[1] != self.dim:
            return [f"{what} are {got.dtype}{list(got.shape)}, not float32 [n, {self.dim}]"]
        if want is None:
            return [] if np.isfinite(got).all() else [f"{what} hold NaN or Inf"]
        if got.shape != want.shape:
            return [f"{what} are {list(got.shape)}, the model's {list(want.shape)}"]
        return differs(what, got, want, rtol, atol + self.slack)


def _abs_max(values: np.ndarray) -> float:
    return float(np.abs(values).max(initial=0.0))


def differs(what: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> list[str]:
    """Where ``got`` differs from ``want`` (same shape) beyond the tolerance, as one line; empty if nowhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return [f"{what} are {list(got.shape)}, the model's {list(want.shape)}"]
    with np.errstate(all="ignore"):
        bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
    if not bad.any():
        return []
    at = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return [f"{what} differ at {int(bad.sum())} of {got.size} values, e.g. {list(map(int, at))}: "
            f"ps {got[at]:.7g}, model {want[at]:.7g}"]  # fmt: skip
