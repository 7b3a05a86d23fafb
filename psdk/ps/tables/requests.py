"""The table part of a ``pull`` or ``push_pull``: which rows a request pushes and which it pulls.

A request names its tables in its ``tables`` field, in order, each entry
``{"table": name, "push": bool, "pull": bool, "read": bool}``; the array
frames after the dense gradient follow that order: for an entry that
pushes, its ids (int64) then its row gradients (float32, ids x dim); for one
that pulls, the ids whose rows the reply carries. ``read`` makes the pull a
plain read (evaluation, serving): it creates, counts and stamps nothing.
The reply carries, after the dense parameters, one float32 ``ids x dim``
array per pulling entry, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ProtocolError, RefusedError
from psdk.ps.tables.served import RowGrad, ServedTable

ENTRY_KEYS = frozenset({"table", "push", "pull", "read"})


@dataclass
class TablePull:
    """Rows a reply must carry: read when the reply leaves (after the push it answers was applied)."""

    table: ServedTable
    ids: np.ndarray
    create: bool


@dataclass
class TableRequest:
    rows: dict[str, RowGrad] = field(default_factory=dict)
    pulls: list[TablePull] = field(default_factory=list)


def table_request(
    entries: Any, arrays: Sequence[np.ndarray], tables: Mapping[str, ServedTable], pushes: bool
) -> TableRequest:
    """The checked table part of a request whose array frames (after the dense gradient, if any) are ``arrays``."""
    if entries is None:
        if arrays:
            raise ProtocolError(f"{len(arrays)} array frames more than the request names")
        return TableRequest()
    if not isinstance(entries, list):
        raise ProtocolError("tables must be a list of {table, push, pull, read}")
    request, at, seen = TableRequest(), 0, set()
    for entry in entries:
        if not isinstance(entry, dict) or not set(entry) <= ENTRY_KEYS or not isinstance(entry.get("table"), str):
            raise ProtocolError(f"a tables entry is {{table, push, pull, read}}, got {str(entry)[:80]}")
        name = entry["table"]
        flags = [entry.get(key, False) for key in ("push", "pull", "read")]
        if not all(isinstance(flag, bool) for flag in flags):
            raise ProtocolError("push, pull and read of a tables entry are true or false")
        push, pull, read = flags
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
        wanted = 2 * push + pull
        if at + wanted > len(arrays):
            raise ProtocolError(f"table {name!r} needs {wanted} more array frames than the request has")
        if push:
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
