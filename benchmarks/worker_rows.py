"""A worker's cut of a click batch's rows per shard, and the pulled rows put back in order, against plain numpy.

Each ctr step the worker splits the ids it pushes (with their row gradients)
and the ids it pulls by shard (:func:`psdk.client.rows.plan_tables`), and puts
the shards' pulled rows back in the order of its ids
(:meth:`~psdk.client.rows.PullPlan.assemble`). This times both on click
batches (``--batch`` x 26 ids of :class:`~psdk.workloads.ctr.data.ClickLog`
over ``--vocab``, unique and sorted as a worker pushes them, dim 16), for
each sharding and number of ps, against the same work written the plain
numpy way in the same run: ``ids[mask]``, ``grads[mask]`` per shard and
``out[mask] = rows`` back. As in a training loop, each step's push is of
the ids the step before pulled (``plan_tables(previous=...)``). A ``range`` table's shards hold runs of the sorted
ids (slices); a ``hash`` table's are spread (one boolean mask a shard).

Prints microseconds of CPU (this thread) per step and the ratios. Usage:
``python benchmarks/worker_rows.py [--batch 1024] [--vocab 10000000] [--steps 300] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from table_transport import DIM, Batch, click_batches  # the same click batches (benchmarks/ is on the path)

from psdk.client.rows import plan_tables
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.workloads.ctr.data import TABLE


def _cpu_us(step: Callable[[int], object], steps: int) -> float:
    step(0)
    began = time.thread_time()
    for i in range(steps):
        step(i)
    return (time.thread_time() - began) / steps * 1e6


def measure(spec: TableSpec, num_ps: int, batches: list[Batch], steps: int) -> dict[str, float]:
    """psdk's and plain numpy's CPU µs per step: the push and pull cut, and the pulled rows assembled."""
    tables = {spec.name: spec}
    plans = [plan_tables(tables, num_ps, push={spec.name: b}, pull={spec.name: b[0]}) for b in batches]
    replies = [{s: np.asarray(p.arrays[-1], np.float32)[:, None].repeat(DIM, 1) for s, p in parts.items()
                if p.entries} for parts, _ in plans]  # fmt: skip
    wheres = [shard_of_ids(spec, ids, num_ps) for ids, _ in batches]

    last: dict[str, Any] = {}  # the previous step's pull plans, whose split the push of the same ids takes

    def psdk_cut(i: int) -> None:
        ids, grads = batches[i % len(batches)]
        following = batches[(i + 1) % len(batches)][0]
        push, pull = {spec.name: (ids, grads)}, {spec.name: following}
        _, last["plans"] = plan_tables(tables, num_ps, push=push, pull=pull, previous=last.get("plans"))

    def numpy_cut(i: int) -> None:
        (ids, grads), following = batches[i % len(batches)], batches[(i + 1) % len(batches)][0]
        where, next_where = shard_of_ids(spec, ids, num_ps), shard_of_ids(spec, following, num_ps)
        for shard in range(num_ps):
            mask, next_mask = where == shard, next_where == shard
            _ = ids[mask], grads[mask], following[next_mask]

    def psdk_assemble(i: int) -> None:
        plans[i % len(plans)][1][spec.name].assemble(replies[i % len(plans)])

    def numpy_assemble(i: int) -> np.ndarray:
        where, rows = wheres[i % len(plans)], replies[i % len(plans)]
        out = np.empty((len(where), DIM), np.float32)
        for shard, got in rows.items():
            out[where == shard] = got
        return out

    for i, (_, pulled) in enumerate(plans):  # both ways give each id's own row back (a row holds its id)
        expected = np.asarray(batches[i][0], np.float32)[:, None].repeat(DIM, 1)
        if not (np.array_equal(pulled[spec.name].assemble(replies[i]), expected)
                and np.array_equal(numpy_assemble(i), expected)):  # fmt: skip
            raise RuntimeError(f"{spec.sharding}, {num_ps} ps: the pulled rows came back out of order")
    return {
        "cut_us": _cpu_us(psdk_cut, steps), "numpy_cut_us": _cpu_us(numpy_cut, steps),
        "assemble_us": _cpu_us(psdk_assemble, steps), "numpy_assemble_us": _cpu_us(numpy_assemble, steps),
    }  # fmt: skip


def compare(batch: int, vocab: int, steps: int, pool: int) -> dict[str, Any]:
    batches = click_batches(batch, vocab, pool)
    out: dict[str, Any] = {"batch": batch, "vocab": vocab, "steps": steps,
                           "unique_ids": float(np.median([len(ids) for ids, _ in batches])), "cases": {}}  # fmt: skip
    for sharding in ("hash", "range"):
        for num_ps in (1, 2):
            spec = TableSpec(TABLE, DIM, capacity=vocab, max_ids=batch * 26, sharding=sharding)
            out["cases"][f"{sharding}, {num_ps} ps"] = {k: round(v, 1) for k, v in
                                                       measure(spec, num_ps, batches, steps).items()}  # fmt: skip
    return out


def table(out: dict[str, Any]) -> str:
    lines = [
        f"{out['steps']} steps; batches of {out['batch']} x 26 ids over {out['vocab']:,} "
        f"(median {out['unique_ids']:.0f} unique), dim {DIM}; CPU µs a step",
        "| table | cut: psdk | numpy | ÷ numpy | assemble: psdk | numpy | ÷ numpy |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, r in out["cases"].items():
        lines.append(f"| {case} | {r['cut_us']:.0f} | {r['numpy_cut_us']:.0f} | "
                     f"{r['cut_us'] / max(r['numpy_cut_us'], 1e-9):.2f}× | {r['assemble_us']:.0f} | "
                     f"{r['numpy_assemble_us']:.0f} | "
                     f"{r['assemble_us'] / max(r['numpy_assemble_us'], 1e-9):.2f}× |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pool", type=int, default=32, help="distinct batches, cycled")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args()
    out = compare(args.batch, args.vocab, args.steps, args.pool)
    print(table(out))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
