"""What a row of a ps-side embedding table costs: resident bytes, and lookups per second against a dict.

Fills ``psdk.ps.tables.table.RowTable`` (capped at the number of rows, so
nothing is evicted) with ``--rows`` random int64 ids in batches of ``--batch``,
once per ``--dims``, then builds, in the same process, the dict a Python ps
would keep: id -> row number into a numpy row array (the fair baseline for
speed), and id -> one numpy array per row (ElasticDL's first design, for
memory).

Memory is measured, not computed: the resident set (``/proc/self/statm``,
pages actually mapped) just before a structure is built and after it is
filled, over the rows it holds. The table's arrays are allocated to the cap
with ``np.zeros``, which Linux maps lazily, so only touched pages count;
the table's own count (``bytes_per_row()``) is printed beside it. Each
structure is measured from the resident set just before it, and the dicts
last, since freed Python objects stay in the allocator.

Speed is ids per second through a creating lookup (insert: index, initial
rows) and through a lookup of ids already present, each against the dict
doing the same work (a Python step per id), as a ratio: timings on a shared
machine move, the ratio less.
Usage: ``python benchmarks/table_memory.py [--rows 1000000] [--dims 16,64] [--batch 4096]``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import time

import numpy as np

from psdk.ps.tables.table import RowTable

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident() -> int:
    """Bytes of this process's resident set now, after handing freed heap back to the system.

    Without ``malloc_trim`` a baseline taken over freed-but-kept heap is too
    high, and whatever is built next seems to cost less than it does.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def batches(ids: np.ndarray, size: int) -> list[np.ndarray]:
    return [ids[start : start + size] for start in range(0, len(ids), size)]


def timed(work: list[np.ndarray], call: object) -> float:
    """Ids per second of ``call`` over every batch of ``work``."""
    started = time.perf_counter()
    for batch in work:
        call(batch)  # type: ignore[operator]
    return sum(len(b) for b in work) / (time.perf_counter() - started)


def measure_table(ids: np.ndarray, dim: int, batch: int) -> dict[str, float]:
    before = resident()
    table = RowTable(dim, len(ids))
    allocated = resident() - before
    work = batches(ids, batch)
    insert = timed(work, table.lookup)
    held = resident() - before
    rng = np.random.default_rng(1)
    again = [ids[rng.integers(0, len(ids), batch)] for _ in range(len(work))]
    lookup = timed(again, table.lookup)
    result = {"allocated": allocated, "per_row": held / len(table), "counted": table.bytes_per_row()}
    del table
    gc.collect()
    return {**result, "insert": insert, "lookup": lookup}


def measure_dict(ids: np.ndarray, dim: int, batch: int) -> dict[str, float]:
    """id -> row number, rows in one preallocated numpy array: the same work with a Python step per id.

    New rows are drawn from a generator per batch (fast, but not a function of the id, as the table's are).
    """
    rows = np.zeros((len(ids), dim), np.float32)
    index: dict[int, int] = {}
    draw = np.random.default_rng(0)

    def insert(block: np.ndarray) -> np.ndarray:
        start = len(index)
        slots = [index.setdefault(i, len(index)) for i in block.tolist()]
        rows[start : len(index)] = draw.standard_normal((len(index) - start, dim), np.float32) * 0.01
        return rows[slots]

    def lookup(block: np.ndarray) -> np.ndarray:
        return rows[[index[i] for i in block.tolist()]]

    before = resident()
    work = batches(ids, batch)
    inserted = timed(work, insert)
    per_row = (resident() - before) / len(index)  # the dict, its int keys and values, and the rows it touched
    rng = np.random.default_rng(1)
    again = [ids[rng.integers(0, len(ids), batch)] for _ in range(len(work))]
    looked = timed(again, lookup)
    return {"insert": inserted, "lookup": looked, "index_per_row": per_row}


def measure_dict_of_arrays(ids: np.ndarray, dim: int) -> float:
    """Resident bytes per row of id -> its own numpy array (a Python object per row)."""
    before = resident()
    table = {i: np.zeros(dim, np.float32) for i in ids.tolist()}
    per_row = (resident() - before) / len(table)
    del table
    gc.collect()
    return per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dims", default="16,64")
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    ids = np.unique(np.random.default_rng(0).integers(0, 2**62, args.rows))
    ids = np.random.default_rng(2).permutation(ids)
    tables = {dim: measure_table(ids, dim, args.batch) for dim in dims}
    dicts = {dim: measure_dict(ids, dim, args.batch) for dim in dims}
    objects = {dim: measure_dict_of_arrays(ids, dim) for dim in dims}
    print(f"{len(ids):,} random int64 ids, batches of {args.batch}\n")
    print("| dim | raw row B | table resident B/row | ÷ raw | table's own count B/row | at allocation MiB "
          "| dict of arrays B/row | dict id->slot + rows array B/row |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dim in dims:
        t, raw = tables[dim], dim * 4
        print(f"| {dim} | {raw} | {t['per_row']:.1f} | {t['per_row'] / raw:.2f} | {t['counted']:.1f} "
              f"| {t['allocated'] / 2**20:.1f} | {objects[dim]:.1f} | {dicts[dim]['index_per_row']:.1f} |")  # fmt: skip
    print("\n| dim | insert ids/s: table | dict | table ÷ dict | lookup ids/s: table | dict | table ÷ dict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dim in dims:
        t, d = tables[dim], dicts[dim]
        print(f"| {dim} | {t['insert']:,.0f} | {d['insert']:,.0f} | {t['insert'] / d['insert']:.1f} "
              f"| {t['lookup']:,.0f} | {d['lookup']:,.0f} | {t['lookup'] / d['lookup']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
