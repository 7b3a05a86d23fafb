"""A checkpoint's embedding tables as (ids, rows) files, for serving: ``python -m psdk export CHECKPOINT [OUT]``.

A serving system wants a table's rows by id, not a training state: no
slots, stamps or sketch, and no shards. Each table becomes two ``.npy``
files in ``OUT/<table>/``: ``ids.npy`` (int64) and ``rows.npy`` (float32, ids
x dim), row ``i`` of one belonging to id ``i`` of the other, in no particular
order. They are written through memory maps, a chunk at a time as the
checkpoint holds them, so exporting a table never holds it in memory, and
each chunk is checked as it is read (docs/tables.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from psdk.client import checkpoint
from psdk.errors import DataError, PsdkError


def export_tables(path: Path | str, out: Path | str, names: list[str] | None = None) -> dict[str, int]:
    """Write the tables of checkpoint ``path`` (or only ``names``) into ``out``; their rows written, by name."""
    state = checkpoint.load(path)
    if state.tables is None:
        raise PsdkError(f"{path} holds no embedding tables (its variables: {sorted(state.variables)})")
    tables = state.tables
    unknown = sorted(set(names or ()) - set(tables.names))
    if unknown:
        raise PsdkError(f"{path} holds no table {unknown} (its tables: {tables.names})")
    written = {}
    for name in names or tables.names:
        total = sum(int(record["counters"][3]) for record in tables.shards(name))
        folder = Path(out) / name
        folder.mkdir(parents=True, exist_ok=True)
        ids = np.lib.format.open_memmap(folder / "ids.npy", mode="w+", dtype=np.int64, shape=(total,))
        rows = np.lib.format.open_memmap(
            folder / "rows.npy", mode="w+", dtype=np.float32, shape=(total, tables.specs[name].dim)
        )
        at = 0
        for _, chunk in tables.rows(name):
            count = len(chunk["ids"])
            if at + count > total:
                raise DataError(f"{path}: table {name!r} holds more rows than its header counts ({total})")
            ids[at : at + count], rows[at : at + count] = chunk["ids"], chunk["rows"]
            at += count
        if at != total:
            raise DataError(f"{path}: table {name!r} holds {at} rows, its header counts {total}")
        ids.flush()
        rows.flush()
        del ids, rows
        written[name] = total
    return written
