"""The table part of a ``pull`` or ``push_pull``: which rows a request pushes and which it pulls.

A request names its tables in its ``tables`` field, in order, each entry
``{"table": name, "push": bool, "pull": bool, "read": bool, "pulled": bool}``;
the array frames after the dense gradient follow that order: for an entry
that pushes, its ids (int64) then its row gradients (float32, ids x dim); for
one that pulls, the ids whose rows the reply carries. ``read`` makes the pull
a plain read (evaluation, serving): it creates, counts and stamps nothing.

``pulled`` says a push's ids are those the same worker's ``push_pull``
request ``pulled`` (a field of the push) pulled from this shard, as a
training step pushes the rows of the ids it pulled one step before: the
entry then carries only the row gradients, and the shard takes the ids it
checked for that pull (:class:`NamedPulls`), so they are neither sent,
copied out nor checked again. A push naming a pull the shard does not hold
(another process of the worker pulled since, or the shard restarted) is
refused, applying nothing (kind ``pull_not_held``: the worker sends the push
again with its ids); a worker names only a pull whose answer it took.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ProtocolError, RefusedError
from psdk.protocol.ops import PULL_NOT_HELD
from psdk.ps.tables.served import RowGrad, ServedTable

ENTRY_KEYS = frozenset({"table", "push", "pull", "read", "pulled"})


@dataclass
class TablePull:
    """Rows a reply must carry: read when the reply leaves (after the push it answers was applied)."""

    table: ServedTable
    ids: np.ndarray
    create: bool


@dataclass
class NamedPulls:
    """The ids of each worker's last step's pull per table, which its next push may name instead of sending.

    Kept from ``push_pull`` replies only (a plain ``pull`` between two steps
    changes nothing), for the worker's connection that was answered them
    (``peer``) and the request that pulled them, so a push names only what
    its own process was sent; one entry per worker and table (the next
    step's pull replaces it).
    """

    kept: dict[tuple[int, str], tuple[bytes, int, np.ndarray]] = field(default_factory=dict)

    def answered(self, worker: int, peer: bytes, rid: int, pulls: Sequence[TablePull]) -> None:
        """Request ``rid`` of ``worker`` was answered the rows of ``pulls``: a training pull's ids are kept."""
        for pull in pulls:
            if pull.create:
                self.kept[(worker, pull.table.spec.name)] = (peer, rid, pull.ids)

    def ids(self, worker: int, peer: bytes, rid: Any, table: str) -> np.ndarray:
        """The ids ``worker``'s request ``rid`` pulled of ``table`` (checked then); RefusedError if not held."""
        held = self.kept.get((worker, table))
        if held is None or held[0] != peer or held[1] != rid:
            holds = "none" if held is None else f"request {held[1]}'s" if held[0] == peer else "another connection's"
            raise RefusedError(
                f"a push of table {table!r} names the ids of request {rid}'s pull, which this shard does not hold "
                f"for worker {worker} (it holds {holds}): not applied; push the ids",
                PULL_NOT_HELD,
            )
        return held[2]

    def forget(self, worker: int | None = None) -> None:
        """A worker's process went (``None``: the shard was rolled back): its pulls are no next push's."""
        for key in [key for key in self.kept if worker is None or key[0] == worker]:
            del self.kept[key]


@dataclass
class TableRequest:
    rows: dict[str, RowGrad] = field(default_factory=dict)
    pulls: list[TablePull] = field(default_factory=list)


def table_request(
    entries: Any,
    arrays: Sequence[np.ndarray],
    tables: Mapping[str, ServedTable],
    pushes: bool,
    named: Callable[[str], np.ndarray] | None = None,
) -> TableRequest:
    """The checked table part of a request whose array frames (after the dense gradient, if any) are ``arrays``.

    ``named(table)``: the checked ids of the pull a ``pulled`` entry names (its request's ``pulled`` field).
    """
    if entries is None:
        if arrays:
            raise ProtocolError(f"{len(arrays)} array frames more than the request names")
        return TableRequest()
    if not isinstance(entries, list):
        raise ProtocolError("tables must be a list of {table, push, pull, read, pulled}")
    request, at, seen = TableRequest(), 0, set()
    for entry in entries:
        if not isinstance(entry, dict) or not set(entry) <= ENTRY_KEYS or not isinstance(entry.get("table"), str):
            raise ProtocolError(f"a tables entry is {{table, push, pull, read, pulled}}, got {str(entry)[:80]}")
        name = entry["table"]
        flags = [entry.get(key, False) for key in ("push", "pull", "read", "pulled")]
        if not all(isinstance(flag, bool) for flag in flags):
            raise ProtocolError("push, pull, read and pulled of a tables entry are true or false")
        push, pull, read, again = flags
        table = tables.get(name)
        if table is None:
            raise RefusedError(f"this shard holds no table {name!r} (it holds {sorted(tables) or 'none'})")
        if name in seen:
            raise ProtocolError(f"table {name!r} is named twice in one request")
        seen.add(name)
        if push and not pushes:
            raise ProtocolError("only push_pull pushes rows")
        if read and not pull:
            raise ProtocolError(f"table {name!r}: read needs pull")
        if again and not push:
            raise ProtocolError(f"table {name!r}: pulled needs push")
        if again and named is None:
            raise ProtocolError(f"table {name!r}: pulled, but the request has no pulled field naming the pull")
        wanted = 2 * push - again + pull
        if at + wanted > len(arrays):
            raise ProtocolError(f"table {name!r} needs {wanted} more array frames than the request has")
        if again and named is not None:  # ids this shard checked when it answered them: not checked again
            request.rows[name] = table.check_rows(named(name), arrays[at])
            at += 1
        elif push:
            request.rows[name] = table.check_grad(arrays[at], arrays[at + 1])
            at += 2
        if pull:
            ids = table.check_ids(arrays[at], "a read" if read else "a pull")
            if not read and len(ids) > table.rows.capacity:
                raise RefusedError(f"a pull of {len(ids)} rows of table {name!r}, whose shard holds at most "
                                   f"{table.rows.capacity}")  # fmt: skip
            request.pulls.append(TablePull(table, ids, create=not read))
            at += 1
    if at != len(arrays):
        raise ProtocolError(f"{len(arrays) - at} array frames more than the tables entries name")
    return request


def pulled_rows(pulls: Sequence[TablePull], into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """The rows a reply carries, read now (a training pull creates the rows it names); gathered straight
    into ``into`` (one array per pull, of its shape) if given."""
    return [pull.table.pull(pull.ids, pull.create, into[i] if into else None) for i, pull in enumerate(pulls)]


def pulled_shapes(pulls: Sequence[TablePull]) -> list[tuple[int, int]]:
    """The shape of each pull's rows, for room to gather them into."""
    return [(len(pull.ids), pull.table.spec.dim) for pull in pulls]
