"""A shard's tables over the protocol in chunks: read while the checkpoint pause holds, restored in retryable steps.

No message carries a whole table. ``table_state`` hands the chief one chunk
at a time: the live rows of a range of slot positions (a cursor the reply
advances), or a piece of the admission sketch, with the table's header
(config and counters), which is small. A restore goes the other way: the
chief's ``init`` names the tables it restores (``restore.tables``) and the
chunk size (``restore.chunk_rows``); each ``table_restore`` loads one chunk
into a staging table (:class:`~psdk.ps.tables.table.TableRestore`), and the
commit swaps it in. A chunk number already taken is acknowledged and not
loaded again, so a chief that lost a reply sends the chunk again safely;
until the commit the table is as it was, and the ps holds its workers'
``wait_init`` so no worker trains on a half-restored table. The ps's cap on
incoming messages follows the chunk size (:func:`chunk_bytes`), not the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ProtocolError, RefusedError
from psdk.protocol.chunks import MAX_CHUNK_ROWS, as_wire, from_wire, row_bytes, sketch_piece
from psdk.protocol.numerics import all_finite
from psdk.ps.rules import UpdateRule
from psdk.ps.tables.served import ServedTable
from psdk.ps.tables.table import SLOT, TableRestore
from psdk.transport.wire import MAX_HEADER_BYTES

PARTS = ("rows", "sketch")


def chunk_bytes(tables: Sequence[ServedTable], chunk_rows: int) -> int:
    """The largest ``table_restore`` of ``chunk_rows`` rows of any of ``tables``: ids, stamps, rows and slots."""
    most = 0
    for table in tables:
        dim, slots = table.spec.dim, len(table.rows.slots)
        sketch = 4 * sketch_piece(dim, slots, chunk_rows) if table.rows.sketch is not None else 0
        most = max(most, chunk_rows * row_bytes(dim, slots), sketch)
    return most + MAX_HEADER_BYTES


def checked_chunk_rows(value: Any) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CHUNK_ROWS):
        raise ProtocolError(f"chunk_rows must be an integer in 1 .. {MAX_CHUNK_ROWS}, not {str(value)[:40]}")
    return value


def state_chunk(table: ServedTable, part: str, cursor: int, rows: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One ``table_state`` reply's fields and arrays (see the module docstring)."""
    if part not in PARTS:
        raise ProtocolError(f"part must be one of {', '.join(PARTS)}, not {part[:40]!r}")
    rows = checked_chunk_rows(rows)
    held = table.rows
    header = held.header()
    fields: dict[str, Any] = {
        "table": table.spec.name,
        "part": part,
        "config": header["config"].tolist(),
        "counters": header["counters"].tolist(),
        "slots": list(held.slots),
        "cursor": cursor,
    }
    if part == "rows":
        chunk, after = held.rows_from(cursor, rows)
        stamps = as_wire(chunk["last_used"])
        arrays = [chunk["ids"], chunk["rows"], stamps, *(chunk[SLOT + slot] for slot in held.slots)]
    else:
        piece, after = held.sketch_from(cursor, sketch_piece(held.dim, len(held.slots), rows))
        arrays = [as_wire(piece)]
    fields["next"] = after
    return fields, arrays


@dataclass
class ChunkedRestore:
    """One table's restore in progress on a shard: the staging table, and the chunk numbers it took."""

    table: ServedTable
    chunk_rows: int
    staging: TableRestore
    taken: set[int] = field(default_factory=set)

    @classmethod
    def start(cls, table: ServedTable, chunk_rows: int) -> ChunkedRestore:
        return cls(table, chunk_rows, table.rows.restore())

    def take(self, fields: Mapping[str, Any], arrays: Sequence[np.ndarray], rule: UpdateRule | None) -> None:
        """Check one rows or sketch chunk whole, then load it: a refused chunk loads nothing."""
        name = self.table.spec.name
        if fields["part"] == "rows":
            chunk = self._rows_chunk(fields, arrays, rule)
        elif fields["part"] == "sketch":
            if len(arrays) != 1 or not isinstance(fields.get("offset"), int):
                raise ProtocolError("a sketch chunk is one uint32 array with an offset")
            piece = from_wire(arrays[0])
            most = sketch_piece(self.table.spec.dim, len(self.table.rows.slots), self.chunk_rows)
            if piece.dtype != np.uint32 or piece.ndim != 1 or len(piece) > most:
                raise RefusedError(f"a sketch chunk of table {name!r} is {arrays[0].dtype}{list(piece.shape)}, not "
                                   f"int32 (uint32 bits) of at most {most} counters")  # fmt: skip
            chunk = {"sketch": piece, "sketch_offset": np.array([fields["offset"]], np.int64)}
        else:
            raise ProtocolError(f"part must be rows, sketch or commit, not {str(fields['part'])[:40]!r}")
        try:
            self.staging.add(chunk)
        except ValueError as exc:
            raise RefusedError(f"a restore chunk of table {name!r}: {exc}") from None

    def _rows_chunk(
        self, fields: Mapping[str, Any], arrays: Sequence[np.ndarray], rule: UpdateRule | None
    ) -> dict[str, np.ndarray]:
        table, name = self.table, self.table.spec.name
        slots = fields.get("slots")
        mine = list(table.rows.slots)
        if not isinstance(slots, list) or sorted(map(str, slots)) != sorted(mine):
            raise RefusedError(f"a restore chunk of table {name!r} has slots {slots}, this table {mine}")
        if len(arrays) != 3 + len(mine):
            raise ProtocolError(f"a rows chunk is ids, rows, last_used and {len(mine)} slot arrays")
        ids = table.check_ids(arrays[0], "a restore chunk", most=self.chunk_rows)
        shape = (len(ids), table.spec.dim)
        values = dict(zip(["rows", *(SLOT + str(slot) for slot in slots)], [arrays[1], *arrays[3:]], strict=True))
        for key, array in values.items():
            if array.dtype != np.float32 or array.shape != shape:
                raise RefusedError(f"a restore chunk of table {name!r}: {key} is {array.dtype}{list(array.shape)}, "
                                   f"expected float32{list(shape)}")  # fmt: skip
            if not all_finite(array):
                raise RefusedError(f"a restore chunk of table {name!r}: {key} holds NaN or Inf")
        stamps = from_wire(arrays[2])
        if stamps.dtype != np.uint32 or stamps.shape != (len(ids),):
            raise RefusedError(f"a restore chunk of table {name!r}: last_used is {stamps.dtype}"
                               f"{list(stamps.shape)}, expected int32 (uint32 bits)[{len(ids)}]")  # fmt: skip
        if rule is not None and len(ids):
            problem = rule.check_slots({slot: values[SLOT + slot].reshape(-1) for slot in mine})
            if problem is not None:
                raise RefusedError(f"a restore chunk of table {name!r}: its {rule.name} slots are unusable: {problem}")
        return {"ids": ids, "last_used": stamps, **values}

    def commit(self, counters: Any) -> int:
        """Make the staged state the table's; a state that is not whole is refused and nothing changes."""
        if not (isinstance(counters, list) and len(counters) == 4 and all(_natural(c) for c in counters)):
            raise ProtocolError("commit needs counters [clock, evicted, created, rows], integers >= 0")
        try:
            self.staging.add({"config": self.table.rows.header()["config"], "counters": np.array(counters, np.int64)})
            self.staging.commit()
        except ValueError as exc:
            raise RefusedError(f"the restore of table {self.table.spec.name!r} cannot commit: {exc}") from None
        return len(self.table.rows)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def restores_of(data: Any, tables: Mapping[str, ServedTable]) -> dict[str, ChunkedRestore]:
    """The table restores an ``init``'s ``restore`` field announces (``tables``, ``chunk_rows``), checked."""
    if not isinstance(data, dict) or data.get("tables") is None:
        return {}
    names = data["tables"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ProtocolError("restore.tables must be a list of distinct table names")
    unknown = sorted(set(names) - set(tables))
    if unknown:
        raise RefusedError(f"restore.tables names {unknown}, which the init's tables do not declare")
    chunk_rows = checked_chunk_rows(data.get("chunk_rows"))
    return {name: ChunkedRestore.start(tables[name], chunk_rows) for name in names}
