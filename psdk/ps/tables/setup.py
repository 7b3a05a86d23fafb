"""Placing the job's tables on a shard at ``init``: the chief's declaration, checked before anything changes."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from psdk.errors import ProtocolError, RefusedError
from psdk.protocol.tables import TableSpec
from psdk.ps.rules import UpdateRule
from psdk.ps.tables.served import ServedTable


def place_tables(data: Any, index: int, rule: UpdateRule) -> dict[str, ServedTable]:
    """This shard's part of each table ``data`` (the init's ``tables``: ``{shard, num_ps, specs}``) declares.

    ``shard`` must be this ps's own task index: an init sent to the wrong
    task would otherwise serve rows that belong elsewhere. Preallocated
    tables come back empty: :func:`fill_tables` makes their rows once the
    init is known to restore none of them.
    """
    if data is None:
        return {}
    if not isinstance(data, dict) or set(data) != {"shard", "num_ps", "specs"}:
        raise ProtocolError("tables must be an object {shard, num_ps, specs}")
    shard, num_ps, specs = data["shard"], data["num_ps"], data["specs"]
    if not (isinstance(num_ps, int) and isinstance(shard, int) and 0 <= shard < num_ps and isinstance(specs, list)):
        raise ProtocolError("tables needs 0 <= shard < num_ps and a list of specs")
    if shard != index:
        raise RefusedError(f"the tables were sent for shard {shard}, but this is ps {index}")
    parsed = [TableSpec.from_json(spec) for spec in specs]
    if len({spec.name for spec in parsed}) != len(parsed):
        raise ProtocolError("table names must be unique")
    decay = float(getattr(rule, "weight_decay", 0.0))
    if parsed and decay:
        raise RefusedError(
            f"optimizer.weight_decay={decay} with embedding tables: decay of rows a batch "
            "did not touch is not defined (as torch's SparseAdam refuses it); set optimizer.weight_decay=0"
        )
    return {spec.name: ServedTable(spec, shard, num_ps, rule, fill=False) for spec in parsed}


def fill_tables(tables: Mapping[str, ServedTable], restored: Collection[str]) -> None:
    """Create the rows of each preallocated table but those a restore fills (docs/tables.md, Memory)."""
    for name, table in tables.items():
        if name not in restored:
            table.fill()


def tables_bytes(tables: Iterable[ServedTable]) -> int:
    """The most bytes of table arrays one push may carry: per table, its most ids pushed (with rows) and pulled."""
    return sum(table.spec.request_bytes() for table in tables)
