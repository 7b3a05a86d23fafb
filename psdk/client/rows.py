"""A worker's side of embedding tables: a batch's ids cut per shard, duplicates summed, rows put back in order.

The ps takes ids strictly increasing and each on its own shard
(:mod:`psdk.ps.tables.served`), so the worker does the sorting: one
``np.unique`` per table and step, which also sums a batch's duplicate ids'
gradients (as ``IndexedSlices`` are summed before TensorFlow's sparse apply,
and ``torch.sparse`` tensors are coalesced). Shards are cut from the unique,
sorted ids with one boolean mask each, which keeps each part sorted; where
every shard's ids are one run of them (a ``range`` table, whose shards hold
blocks of ids, or a single ps) each part is a slice instead: a view, found
by one binary search per shard, with nothing copied.

Ids that come unique and sorted already (a batch's ``ids.unique()``, as the
training loop pulls them and its backend's row gradients are keyed) are
recognised with one vector compare and neither sorted nor copied again,
and rows a single shard sent for every id are handed on as they came: on
a click batch's 10,000 rows that saves about a millisecond a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import PsdkError
from psdk.protocol.ids import unique_positions
from psdk.protocol.rowsio import put_rows
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.transport.wire import Message

RowPush = tuple[np.ndarray, np.ndarray]
"""(ids, row gradients): ``len(ids) x dim`` float32, ids int64 in any order, duplicates allowed."""
Part = slice | np.ndarray
"""Which of a table's unique, sorted ids a shard holds: a run of them, or a boolean mask."""


def as_ids(spec: TableSpec, ids: Any) -> np.ndarray:
    """``ids`` as a 1-D int64 array, or a PsdkError naming the table and what is wrong."""
    array = np.asarray(ids)
    if array.dtype.kind not in "iu":
        raise PsdkError(f"table {spec.name!r}: ids must be integers, not {array.dtype}")
    array = array.reshape(-1).astype(np.int64, copy=False)
    if len(array) and int(array.min()) < 0:
        raise PsdkError(f"table {spec.name!r}: ids must be non-negative, got {int(array.min())}")
    return array


def strictly_increasing(ids: np.ndarray) -> bool:
    """Whether ``ids`` are unique and sorted already (one vector compare, no sort)."""
    return len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))


def unique_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``np.unique(ids, return_inverse=True)``, with ``None`` for an inverse that would change nothing."""
    if strictly_increasing(ids):
        return ids, None
    return unique_positions(ids)


def sum_duplicates(spec: TableSpec, ids: Any, grads: Any) -> RowPush:
    """Each id once, strictly increasing, with the sum of its rows' gradients."""
    flat = as_ids(spec, ids)
    rows = np.asarray(grads, np.float32).reshape(len(flat), -1) if len(flat) else np.zeros((0, spec.dim), np.float32)
    if rows.shape[1] != spec.dim:
        raise PsdkError(f"table {spec.name!r}: row gradients have {rows.shape[1]} columns, the table {spec.dim}")
    if strictly_increasing(flat):
        return flat, np.ascontiguousarray(rows)
    unique, inverse = unique_positions(flat)
    if len(unique) == len(flat):  # no duplicates: each row goes where its id went
        ordered = np.empty_like(rows)
        ordered[inverse] = rows
        return unique, ordered
    # One bincount per column: 1.2 ms for a click batch's 26,624 rows of 16 (np.add.at: 12 ms; np.add.reduceat
    # over the rows sorted by id: 1.6 ms), summed in float64.
    summed = np.empty((len(unique), spec.dim), np.float32)
    for column in range(spec.dim):
        summed[:, column] = np.bincount(inverse, weights=rows[:, column], minlength=len(unique))
    return unique, summed


@dataclass
class PullPlan:
    """Where a table's pulled ids went, to put the shards' rows back in the caller's order."""

    spec: TableSpec
    unique: np.ndarray
    inverse: np.ndarray | None
    """Where each id the caller gave is in ``unique``; ``None``: they were ``unique`` already."""
    masks: dict[int, Part]
    """Per shard, which of ``unique`` it was asked for."""
    read: bool = False
    """A plain read: the shards keep nothing of it, so no push may name it."""
    sent: np.ndarray | None = None
    """A training pull's: a private copy of ``unique`` (the caller may rewrite its own array), which a push of
    the same ids (a training step's, the step after) is compared with, to take this plan's parts and names."""
    parts: dict[int, np.ndarray] | None = None
    """Where the shards' parts are masks (a hash table's): each shard's part of ``unique`` (private copies), for
    that push to take instead of hashing the ids again."""
    answered: dict[int, int] = field(default_factory=dict)
    """Per shard, the request whose reply brought these rows (a training pull's): a push of these same ids
    names it instead of sending them (the ``pulled`` entry of :mod:`psdk.ps.tables.requests`)."""

    @property
    def ids(self) -> np.ndarray:
        """The ids as the caller gave them."""
        return self.unique if self.inverse is None else self.unique[self.inverse]

    def assemble(self, rows: Mapping[int, np.ndarray]) -> np.ndarray:
        """The rows of the ids as the caller gave them (duplicates repeated), from each shard's reply."""
        for shard, mask in self.masks.items():
            got = rows[shard]
            if got.shape != (part_size(mask), self.spec.dim):
                raise PsdkError(f"ps {shard} sent rows of table {self.spec.name!r} of shape {list(got.shape)}")
        if len(self.masks) == 1 and len(self.unique):  # one shard holds them all: its rows are in order
            out = rows[next(iter(self.masks))]
        else:
            out = np.empty((len(self.unique), self.spec.dim), np.float32)
            for shard, mask in self.masks.items():
                if isinstance(mask, slice):
                    out[mask] = rows[shard]
                else:  # rows as whole records, not out[mask] = ... (benchmarks/worker_rows.py)
                    put_rows(out, np.flatnonzero(mask), rows[shard])
        return out if self.inverse is None else out[self.inverse]


def split_by_shard(spec: TableSpec, ids: np.ndarray, num_ps: int) -> dict[int, Part]:
    """Per shard, which of ``ids`` (unique, sorted) it holds (empty parts left out)."""
    if spec.sharding == "range" and len(ids):
        shard_of_ids(spec, ids[[0, -1]], num_ps)  # ids the table cannot hold raise (sorted: its ends tell)
    if num_ps == 1:
        return {0: slice(0, len(ids))} if len(ids) else {}
    if spec.sharding == "range":  # each shard holds a block of ids: its part is a run of the sorted ids
        per = spec.shard_capacity(num_ps)
        ends = np.searchsorted(ids, np.arange(1, num_ps + 1, dtype=np.int64) * per)
        starts = np.concatenate([[0], ends[:-1]])
        return {s: slice(int(a), int(b)) for s, (a, b) in enumerate(zip(starts, ends, strict=True)) if b > a}
    where = shard_of_ids(spec, ids, num_ps)
    masks: dict[int, Part] = {}
    for shard in range(num_ps):
        mask = where == shard
        if mask.any():
            masks[shard] = mask
    return masks


def part_size(part: Part) -> int:
    """How many ids a shard's part holds."""
    return part.stop - part.start if isinstance(part, slice) else int(np.count_nonzero(part))


def row_room(
    tables: Mapping[str, TableSpec],
    name: str,
    ids: Any,
    num_ps: int,
    lend: Callable[[int, list[tuple[int, int]]], list[np.ndarray] | None],
) -> np.ndarray:
    """A ``len(ids) x dim`` float32 array to write the row gradients of ``ids`` into, for the next push of them.

    When one shard holds every id (``ids`` unique and sorted, as a pull's,
    by which a backward keys its rows), it is the room ``lend`` gives in
    what that shard is sent (shared memory: :meth:`psdk.transport.heap.Heap.lend`),
    and the push sends the rows from where they lie, as a dense gradient
    from its lent region; else a private array, copied as any rows are.
    The caller's until the next push leaves, whether it sends the rows from
    there or not (two tables' rooms for one push lie apart). The ids are not
    checked here: the push checks them (and sorts them, copying the rows,
    if they were not sorted).
    """
    _known(tables, {name})
    spec, flat = tables[name], np.asarray(ids).reshape(-1)
    shape = (len(flat), spec.dim)
    shard = 0 if num_ps == 1 else _only_shard(spec, flat, num_ps)
    room = lend(shard, [shape]) if shard is not None and len(flat) else None
    return room[0] if room is not None else np.empty(shape, np.float32)


def _only_shard(spec: TableSpec, ids: np.ndarray, num_ps: int) -> int | None:
    """The shard holding all of ``ids`` (sorted) if it is one: a ``range`` table's, whose ends tell; else None
    (ids the table cannot hold too: the push refuses them)."""
    if spec.sharding != "range" or not len(ids) or ids.dtype.kind not in "iu":
        return None
    try:
        first, last = (int(shard) for shard in shard_of_ids(spec, ids[[0, -1]].astype(np.int64), num_ps))
    except ValueError:
        return None
    return first if first == last else None


def _known(tables: Mapping[str, TableSpec], names: set[str]) -> None:
    """A PsdkError naming any of ``names`` the job has no table of."""
    unknown = names - set(tables)
    if unknown:
        shown = repr(next(iter(unknown))) if len(unknown) == 1 else str(sorted(unknown))
        raise PsdkError(f"no table {shown} in this job (its tables: {sorted(tables) or 'none'})")


@dataclass
class ShardTables:
    """One request's table part for one shard: the entries and their arrays, in protocol order."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)
    pulled: int | None = None
    """The request whose pulled ids the entries marked ``pulled`` push the rows of."""
    named_ids: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """Per ``pulled`` entry, where in :attr:`arrays` its ids would go and the ids: sent if the shard refuses
    the name (:func:`without_names`)."""


def plan_tables(
    tables: Mapping[str, TableSpec],
    num_ps: int,
    push: Mapping[str, RowPush] | None = None,
    pull: Mapping[str, Any] | None = None,
    read: bool = False,
    copy: bool = False,
    previous: Mapping[str, PullPlan] | None = None,
) -> tuple[dict[int, ShardTables], dict[str, PullPlan]]:
    """Each shard's table entries for one request, and how to put the pulled rows back together.

    A shard's part may be a view of the caller's ids and row gradients (a run of
    them): the request carries them as they are until its reply, unless ``copy``.
    ``previous``: the plans of the last request's pulls, whose split a push of the
    same ids reuses, and whose answered pulls (a ``read`` is none) it names
    instead of sending the ids again.
    """

    def cut(array: np.ndarray, part: Part) -> np.ndarray:
        if isinstance(part, slice):
            return array[part].copy() if copy else array[part]
        # A mask's part is a copy either way; np.compress makes it for less than array[mask] (a click batch on
        # 2 shards: the cut 709 -> 391 us in all, benchmarks/worker_rows.py).
        return np.compress(part, array, axis=0)

    push, pull = push or {}, pull or {}
    _known(tables, set(push) | set(pull))
    parts: dict[int, ShardTables] = {i: ShardTables() for i in range(num_ps)}
    plans: dict[str, PullPlan] = {}
    for name in tables:
        spec = tables[name]
        pushing: dict[int, RowPush] = {}
        named: dict[int, int] = {}  # shard -> the request whose pull of these ids it answered
        if name in push:
            ids, grads = sum_duplicates(spec, *push[name])
            known = previous.get(name) if previous else None
            if known is not None and known.sent is not None and np.array_equal(ids, known.sent):
                if known.parts is not None:  # the ids the last pull named: cut as then, not hashed again
                    pushing = {s: (known.parts[s], cut(grads, m)) for s, m in known.masks.items()}
                else:
                    pushing = {s: (cut(ids, m), cut(grads, m)) for s, m in known.masks.items()}
                named = known.answered
            else:
                pushing = {s: (cut(ids, m), cut(grads, m)) for s, m in split_by_shard(spec, ids, num_ps).items()}
        pulling: dict[int, np.ndarray] = {}
        if name in pull:
            unique, inverse = unique_ids(as_ids(spec, pull[name]))
            masks = split_by_shard(spec, unique, num_ps)
            # A training pull's ids go from the plan's own copy: a shard keeps them past its reply (a push may
            # name them), and ZeroMQ may hand it the very memory sent (inproc), which the caller may rewrite.
            sent = None if read else unique.copy()
            pulling = {s: cut(unique if sent is None else sent, m) for s, m in masks.items()}
            spread = any(not isinstance(m, slice) for m in masks.values())
            plans[name] = PullPlan(spec, unique, inverse, masks, read, sent, pulling if spread else None)
        for shard in sorted(set(pushing) | set(pulling)):
            part = parts[shard]
            entry: dict[str, Any] = {"table": name}
            if shard in pushing:
                entry["push"] = True
                if shard in named:  # the shard holds these ids from the pull it answered: only the rows go
                    entry["pulled"] = True
                    part.pulled = named[shard]
                    part.named_ids.append((len(part.arrays), pushing[shard][0]))
                    part.arrays.append(pushing[shard][1])
                else:
                    part.arrays += [*pushing[shard]]
            if shard in pulling:
                entry["pull"] = True
                if read:
                    entry["read"] = True
                part.arrays.append(pulling[shard])
            part.entries.append(entry)
    return parts, plans


def without_names(part: ShardTables | None) -> ShardTables | None:
    """``part`` with each named push's ids sent after all, for a shard that no longer holds the named pull."""
    if part is None or part.pulled is None:
        return part
    arrays = list(part.arrays)
    for at, ids in reversed(part.named_ids):
        arrays.insert(at, ids)
    return ShardTables([{k: v for k, v in entry.items() if k != "pulled"} for entry in part.entries], arrays)


def with_tables(message: Message, part: ShardTables | None) -> Message:
    """``message`` with a shard's table entries and their arrays after its own (nothing when it has none)."""
    if part is not None and part.entries:
        message.fields["tables"] = part.entries
        if part.pulled is not None:
            message.fields["pulled"] = part.pulled
        message.arrays = [*message.arrays, *part.arrays]
    return message


def pulled_rows(plans: Mapping[str, PullPlan], replies: Mapping[int, Any]) -> dict[str, np.ndarray]:
    """Every pulled table's rows, in the caller's order, from the shards' replies (arrays after the dense one).

    Each plan then records which request every shard answered with its
    rows (:attr:`PullPlan.answered`), for the push of those ids to name.
    """
    by_shard: dict[str, dict[int, np.ndarray]] = {name: {} for name in plans}
    for shard, reply in replies.items():
        at = 1
        for name, plan in plans.items():
            if shard in plan.masks:
                if at >= len(reply.arrays):
                    raise PsdkError(f"ps {shard} sent fewer row arrays than were pulled")
                by_shard[name][shard] = reply.arrays[at]
                at += 1
    rows = {name: plan.assemble(by_shard[name]) for name, plan in plans.items()}
    for plan in plans.values():
        plan.answered = {} if plan.read else {shard: replies[shard].rid for shard in plan.masks}
    return rows


def table_specs(
    declared: Mapping[str, Any], options: Mapping[str, Mapping[str, Any]], seed: int
) -> dict[str, TableSpec]:
    """The ps's table for each table variable a model declares (``psdk.Rows``), with the user's settings for it."""
    unknown = set(options) - set(declared)
    if unknown:
        raise PsdkError(
            f"tables= names {sorted(unknown)}, which the model does not declare (it has {sorted(declared)})"
        )
    specs = {}
    for name, rows in declared.items():
        if not isinstance(options.get(name, {}), Mapping):
            raise PsdkError(
                f"tables.{name} must be settings by key (sharding, admit_after, ...), not {options[name]!r}"
            )
        fields: dict[str, Any] = {"capacity": rows.capacity, "initializer": rows.initializer,
                                  "init_scale": rows.init_scale, "seed": seed, **options.get(name, {})}  # fmt: skip
        try:
            specs[name] = TableSpec(name, rows.dim, **fields)
        except TypeError as exc:
            raise PsdkError(f"tables={{{name!r}: ...}}: {exc}") from None
    return specs
