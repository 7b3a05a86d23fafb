"""A click batch's sparse push-and-pull against a dense one of the same bytes: CPU per round trip, rule excluded.

Issue 36's transport target: a batch's sparse push and pull cost at most
1.2x the CPU of a dense push and pull of the same bytes, from encode to
decode on the same transport, rule excluded. This measures both through
psdk's real client (:class:`~psdk.client.ParameterClient`) and a real ps in
its own process, over TCP on 127.0.0.1:

* **sparse**: each round trip pushes one click batch's rows (``--batch`` x 26
  ids of :class:`~psdk.workloads.ctr.data.ClickLog` over ``--vocab``, made
  unique and sorted, one float32 row of 16 each) and pulls the next batch's
  rows, as a ctr worker's step does (:meth:`~psdk.api.DistributedOptimizer.start_step`):
  the push's ids are those the step before pulled, so it names that pull
  and sends only the rows (``pulled``, :mod:`psdk.ps.tables.requests`).
  Each step writes its row gradients where the push sends them from
  (:meth:`~psdk.client.ParameterClient.row_room`: over shared memory, room
  in the worker's memory lent to the ps), as the dense side writes its
  gradient into its buffer, and that write is timed apart and taken off the
  same way. For reference, the rows handed to the push in an array of their
  own, which the push copies into the heap ("rows copied in by the push");
* **dense**: one float32 variable of the same bytes pushed, and as many
  pulled back: as many values as the sparse round trip moves bytes up and
  down, over 8 (the rows both ways and the ids the push carries up: unique
  ids x 17 values). For reference, a dense variable of the rows alone
  (unique ids x 16 values, "dense-rows"): the ids' bytes then count
  against the sparse side, a stricter baseline. Each step writes a new
  gradient into the client's gradient buffer first (the batches' row
  gradients, cycled), as a trainer's step leaves one (over shared memory
  that buffer is the lent region), and the write itself is timed apart and
  taken off: it is the backend's, before the encode (psdk's step books it
  as such). The ratio with both writes left in, and the rows copied in
  against a push of one unchanged gradient (neither side writing where it
  sends from), are printed for reference.

The rule is excluded by running the ps with the no-op rule
(:class:`~psdk.ps.rules.NoOp`) in both: it changes nothing. CPU is the
client's and the ps's process time (every thread: ZeroMQ's I/O threads too)
per round trip, medians over ``--reps`` alternated runs. Both run on each
transport: ZeroMQ frames (``transport.shared_memory=false``, as between
hosts) and, as a worker and its ps on one host do by default, shared memory
(the dense array in its lent region, a push's rows, the pulled ids and
their rows in its heaps: :mod:`psdk.transport.heap`).

What a sparse round trip costs besides moving bytes is subtracted to give
**sparse transport**; those are the index's costs, not the wire's. The
ps's table work (the id checks, the index lookup, the rows gathered and
written back around the no-op rule, the pull's lookup and row creation)
is what the ps itself timed around those calls in each run (its
``time_per_push``, wall time of its one serving thread), taken off that
run's CPU; it is also replayed in this process on the same batches, as a
check. Wall time is more than CPU time when the serving thread waits for
a core, which would make the transport look cheaper: on the idle 2-core
machine the two agreed within 2% (thread CPU of the same calls, one
instrumented run), not on a busy one. The worker's sort and cut of the ids (``plan_tables``: the
``np.unique`` that sums duplicates, the shards' parts; putting pulled rows
back in order) is timed in this process on the same batches.

Usage: ``python benchmarks/table_transport.py [--batch 1024] [--vocab 10000000] [--count 200] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from psdk.bench.transport import _psdk_server
from psdk.client import ParameterClient
from psdk.client.rows import plan_tables
from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import NoOp
from psdk.ps.tables.served import ServedTable
from psdk.transport.zeromq import ZmqOptions, ZmqTransport
from psdk.workloads.ctr.data import TABLE, TRAIN, ClickLog

DIM = 16
Batch = tuple[np.ndarray, np.ndarray]
"""One push's unique, sorted ids and their row gradients."""


def click_batches(batch: int, vocab: int, count: int, seed: int = 0) -> list[Batch]:
    """``count`` click batches' unique ids (as a worker pulls them) with a gradient row each."""
    log = ClickLog(seed=seed, vocab=vocab, capacity=vocab)
    rng = np.random.default_rng(seed)
    out = []
    for number in range(count):
        ids = log.batch(TRAIN, 0, number, batch).ids[TABLE].unique()
        out.append((ids, (rng.standard_normal((len(ids), DIM)) * 0.01).astype(np.float32)))
    return out


@dataclass
class Run:
    """One measured run: CPU microseconds per round trip, the client's and the ps's; the ps's table work, as
    the ps timed it around those calls in this run (its ``time_per_push``: 0 for a dense run); and the client's
    thread time writing each step's new dense gradient into its buffer (0 for the others)."""

    client_us: float
    ps_us: float
    ps_table_us: float = 0.0
    write_us: float = 0.0

    @property
    def total_us(self) -> float:
        return self.client_us + self.ps_us


def _client(address: str, shared_memory: bool) -> tuple[ParameterClient, ZmqTransport]:
    transport = ZmqTransport(ZmqOptions(TransportOptions(shared_memory=shared_memory)))
    return ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["localhost"]}), 0), transport


def _table_ms(stats: dict[str, Any]) -> float:
    """Milliseconds the ps spent on its tables in all its pushes so far: checks, index, rows (the rule is a no-op)."""
    split = stats["time_per_push"]
    return float(split["pushes"] * (split["index_ms"] + split["rule_ms"]))


def _measured(client: ParameterClient, step: Callable[[int], float], count: int, warmup: int) -> Run:
    """``step(i)`` makes round trip ``i`` and returns the seconds of its own writes to time apart."""
    for i in range(warmup):
        step(i)
    before = client.stats()[0]
    c0 = time.process_time()
    write_s = sum(step(i) for i in range(warmup, warmup + count))
    client_s = time.process_time() - c0
    after = client.stats()[0]
    ps_s = after["process"]["cpu_s"] - before["process"]["cpu_s"]
    table_ms = _table_ms(after) - _table_ms(before)
    return Run(client_s / count * 1e6, ps_s / count * 1e6, table_ms / count * 1e3, write_s / count * 1e6)


def _run(kind: str, batches: list[Batch], vocab: int, count: int, warmup: int) -> Run:
    """``kind`` is "sparse", "dense" or "dense-unchanged" over frames, or one of them with "-shm" (shared memory);
    the ps in its own process."""
    shared_memory = kind.endswith("-shm")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    server = ctx.Process(target=_psdk_server, args=(0, queue, None, shared_memory), daemon=True)
    server.start()
    try:
        client, transport = _client(queue.get(timeout=60), shared_memory)
        try:
            job = JobSpec(SyncSpec("async").resolved(1), 10**12, 1)
            if kind.startswith("sparse"):
                spec = TableSpec(TABLE, DIM, capacity=vocab, max_ids=max(len(ids) for ids, _ in batches))
                client.initialize({"w": np.zeros(1, np.float32)}, job, NoOp(), tables=[spec])
                client.pull_rows({TABLE: batches[0][0]})
                client.status()  # the ps's answer to the offer of shared memory is in

                copied = "copied" in kind

                def step(i: int) -> float:
                    ids, grads = batches[i % len(batches)]
                    wrote = 0.0
                    if not copied:  # the rows written where they go (over shared memory, the ps's lent room)
                        rows = client.row_room(TABLE, ids)
                        began = time.thread_time()
                        np.copyto(rows, grads)
                        wrote = time.thread_time() - began
                        grads = rows
                    client.push_pull(rows={TABLE: (ids, grads)}, pull={TABLE: batches[(i + 1) % len(batches)][0]})
                    return wrote

            else:  # the same bytes as the sparse round trip (rows and ids); "dense-rows": the rows' alone
                size = int(np.mean([len(ids) for ids, _ in batches])) * (DIM if "rows" in kind else DIM + 1)
                client.initialize({"w": np.zeros(size, np.float32)}, job, NoOp())
                client.pull()
                client.status()  # the ps's answer to the offer of shared memory is in
                client.grads["w"][...] = 0.01
                gradients = [np.resize(grads.reshape(-1), size) for _, grads in batches]
                unchanged = "unchanged" in kind

                def step(i: int) -> float:
                    began = time.thread_time()
                    if not unchanged:  # a new gradient in the buffer the push sends, as a backward leaves one
                        np.copyto(client.grads["w"], gradients[i % len(gradients)])
                    wrote = time.thread_time() - began
                    client.push_pull()
                    return wrote

            run = _measured(client, step, count, warmup)
            client.shutdown()
        finally:
            client.close()
            transport.close()
    finally:
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    return run


def index_work(batches: list[Batch], vocab: int, count: int, warmup: int) -> tuple[float, float]:
    """CPU microseconds per round trip of a sparse step's work that is not the wire: (worker's, ps's).

    The same calls as the real path makes, on the same batches, in this
    process: the worker's ``plan_tables`` (its push naming the last pull)
    and the pulled rows put back in order; the ps's id checks (a push's ids
    were checked when they were pulled), update around the no-op rule, and
    pull.
    """
    spec = TableSpec(TABLE, DIM, capacity=vocab, max_ids=max(len(ids) for ids, _ in batches))
    rule = NoOp()
    table = ServedTable(spec, 0, 1, rule)
    tables = {TABLE: spec}
    worker = ps = 0.0
    plans: dict[str, Any] = {}
    checked = table.check_ids(batches[0][0], "a pull")
    for i in range(warmup + count):
        ids, grads = batches[i % len(batches)]
        following = batches[(i + 1) % len(batches)][0]
        started = time.process_time()
        _, plans = plan_tables(tables, 1, push={TABLE: (ids, grads)}, pull={TABLE: following}, previous=plans)
        planned = time.process_time()
        table.commit(table.stage_update(table.check_rows(checked, grads), rule, i))
        checked = table.check_ids(following, "a pull")
        rows = table.pull(checked)
        pulled = time.process_time()
        plans[TABLE].assemble({0: rows})
        plans[TABLE].answered = {0: i}  # as the reply's rows taken in (pulled_rows) records it
        if i >= warmup:
            worker += planned - started + time.process_time() - pulled
            ps += pulled - planned
    return worker / count * 1e6, ps / count * 1e6


TRANSPORTS = (("", "frames"), ("-shm", "shared memory"))
"""Each kind's suffix, and the transport it names."""
SIDES = (("sparse", "sparse push + pull, rows written where they go"),
         ("sparse-copied", "sparse push + pull, rows copied in by the push"),
         ("dense", "dense push + pull of the same bytes, a new gradient each step"),
         ("dense-rows", "dense push + pull of the rows' bytes alone, a new gradient each step"),
         ("dense-unchanged", "dense push + pull, one unchanged gradient"))  # fmt: skip
"""Each kind of round trip without its transport's suffix, and how the table names it."""
KINDS = tuple(side + suffix for suffix, _ in TRANSPORTS for side, _ in SIDES)


def compare(batch: int, vocab: int, count: int, warmup: int, reps: int, pool: int) -> dict[str, Any]:
    """Every kind alternated ``reps`` times, and the index work; medians, and the ratios to the dense run."""
    batches = click_batches(batch, vocab, pool)
    runs: dict[str, list[Run]] = {kind: [] for kind in KINDS}
    work: list[tuple[float, float]] = []
    for _ in range(reps):
        for kind in KINDS:
            runs[kind].append(_run(kind, batches, vocab, count, warmup))
        work.append(index_work(batches, vocab, count, warmup))
    unique = statistics.median(len(ids) for ids, _ in batches)

    def median(kind: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[kind])

    out: dict[str, Any] = {
        "batch": batch, "vocab": vocab, "unique_ids": unique, "count": count, "reps": reps,
        "bytes": {"sparse_up": int(unique * (4 * DIM + 8)), "sparse_down": int(unique * 4 * DIM),
                  "dense_each_way": int(unique * 4 * (DIM + 1)), "dense_rows_each_way": int(unique * 4 * DIM)},
    }  # fmt: skip
    for kind in KINDS:
        out[kind] = {f: round(median(kind, f), 1) for f in ("client_us", "ps_us", "total_us")}
    for suffix, _ in TRANSPORTS:
        out[f"gradient_write{suffix.replace('-', '_')}_us"] = round(median("dense" + suffix, "write_us"), 1)
        out[f"row_write{suffix.replace('-', '_')}_us"] = round(median("sparse" + suffix, "write_us"), 1)
    out["sorting_us"] = round(statistics.median(w[0] for w in work), 1)
    out["ps_table_alone_us"] = round(statistics.median(w[1] for w in work), 1)
    for suffix, _ in TRANSPORTS:  # each transport against the dense round trip on the same one
        key, sparse = suffix.replace("-", "_"), runs["sparse" + suffix]
        out[f"ps_table{key}_us"] = round(statistics.median(r.ps_table_us for r in sparse), 1)
        # Per run, what the ps timed of its tables comes off that run's CPU (the two move together), and the
        # rows' write where they go, as the dense gradient's.
        moved = statistics.median(r.total_us - r.ps_table_us - r.write_us for r in sparse) - out["sorting_us"]
        copied = statistics.median(r.total_us - r.ps_table_us for r in runs["sparse-copied" + suffix])
        copied -= out["sorting_us"]
        # The dense transport: each run's round trip of a new gradient, less that run's write of it into the
        # buffer (the backend's work, which psdk's step books as such), as the sparse rows' write.
        dense = max(statistics.median(r.total_us - r.write_us for r in runs["dense" + suffix]), 1e-9)
        rows_only = max(statistics.median(r.total_us - r.write_us for r in runs["dense-rows" + suffix]), 1e-9)
        out[f"ratio_rows_only{key}"] = round(moved / rows_only, 3)  # the ids' bytes counted against sparse
        with_write = max(out["dense" + suffix]["total_us"], 1e-9)  # a tiny run's process time may read 0
        unchanged = max(out["dense-unchanged" + suffix]["total_us"], 1e-9)
        out[f"dense_transport{key}_us"] = round(dense, 1)
        out[f"sparse_transport{key}_us"] = round(moved, 1)
        out[f"ratio{key}"] = round(moved / dense, 3)
        out[f"ratio_with_write{key}"] = round((moved + out[f"row_write{key}_us"]) / with_write, 3)  # both writes
        out[f"ratio_unchanged{key}"] = round(copied / unchanged, 3)  # neither side writing where it sends from
        out[f"sparse_transport_copied{key}_us"] = round(copied, 1)
        out[f"ratio_copied{key}"] = round(copied / dense, 3)
    return out


def table(out: dict[str, Any]) -> str:
    """The figures as a markdown table (µs of CPU per round trip, client + ps)."""
    b = out["bytes"]
    lines = [
        "÷ dense: against the dense round trip of a new gradient on the same transport (in the transport lines, "
        "less its write into the buffer)",
        f"{out['reps']} x {out['count']} round trips; batches of {out['batch']} x 26 ids over {out['vocab']:,} "
        f"(median {out['unique_ids']:.0f} unique), dim {DIM}; sparse {b['sparse_up']:,} B up, "
        f"{b['sparse_down']:,} B down; dense {b['dense_each_way']:,} B each way (rows alone: "
        f"{b['dense_rows_each_way']:,} B)",
        "| round trip | client µs | ps µs | CPU µs | ÷ dense |",
        "| --- | --- | --- | --- | --- |",
    ]
    for suffix, where in TRANSPORTS:
        dense = max(out["dense" + suffix]["total_us"], 1e-9)
        for side, name in SIDES:
            r = out[side + suffix]
            lines.append(f"| {name} ({where}) | {r['client_us']:.0f} | {r['ps_us']:.0f} | "
                         f"{r['total_us']:.0f} | {r['total_us'] / dense:.2f}× |")  # fmt: skip
    for suffix, where in TRANSPORTS:
        lines.append(f"| dense: the new gradient written into its buffer ({where}) | "
                     f"{out['gradient_write' + suffix.replace('-', '_') + '_us']:.0f} | | | |")  # fmt: skip
        lines.append(f"| sparse: the rows written where they go ({where}) | "
                     f"{out['row_write' + suffix.replace('-', '_') + '_us']:.0f} | | | |")  # fmt: skip
    lines.append(f"| sparse: worker's sort and cut of the ids | {out['sorting_us']:.0f} | | | |")
    for suffix, where in TRANSPORTS:
        lines.append(f"| sparse: ps's id checks, index, rows gathered and created ({where}) | | "
                     f"{out['ps_table' + suffix.replace('-', '_') + '_us']:.0f} | | |")  # fmt: skip
    lines.append(f"| sparse: the same, timed alone | | {out['ps_table_alone_us']:.0f} | | |")
    for suffix, where in TRANSPORTS:
        key = suffix.replace("-", "_")
        lines.append(f"| dense transport, {where} (a new gradient, its write not counted) | | | "
                     f"{out[f'dense_transport{key}_us']:.0f} | 1.00× |")  # fmt: skip
        lines.append(f"| sparse transport, {where} (encode to decode, the rows' write not counted) | | | "
                     f"{out[f'sparse_transport{key}_us']:.0f} | {out[f'ratio{key}']:.2f}× |")  # fmt: skip
        lines.append(f"| sparse transport, {where}, rows copied in by the push | | | "
                     f"{out[f'sparse_transport_copied{key}_us']:.0f} | {out[f'ratio_copied{key}']:.2f}× |")  # fmt: skip
    for suffix, where in TRANSPORTS:
        key = suffix.replace("-", "_")
        lines.append(f"| sparse transport ÷ the dense transport of the rows' bytes alone ({where}) | | | | "
                     f"{out[f'ratio_rows_only{key}']:.2f}× |")  # fmt: skip
        lines.append(f"| sparse transport ÷ the dense round trip, both with their writes ({where}) | | | | "
                     f"{out[f'ratio_with_write{key}']:.2f}× |")  # fmt: skip
        lines.append(f"| sparse transport, rows copied in ÷ the unchanged dense gradient ({where}) | | | | "
                     f"{out[f'ratio_unchanged{key}']:.2f}× |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=10_000_000)
    parser.add_argument("--count", type=int, default=200, help="round trips measured per run")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3, help="runs of each kind, alternated")
    parser.add_argument("--pool", type=int, default=32, help="distinct batches, cycled")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = parser.parse_args()
    out = compare(args.batch, args.vocab, args.count, args.warmup, args.reps, args.pool)
    print(table(out))
    if args.json:
        import json

        print(json.dumps(out))


if __name__ == "__main__":
    main()
