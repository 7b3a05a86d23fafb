"""What the ps pays to apply a batch's rows, against a bare numpy floor on the same rows.

One shard's table (``ServedTable``, element-wise Adagrad lr 0.3 with TF1's
initial accumulator 0.1 and no epsilon), fed batches of a click log's shape:
``--batch`` examples of 26 fields, ids Zipf-distributed over ``--vocab``, each
batch's ids made unique and sorted as a worker sends them. After ``--warmup``
steps (the table at steady state: the head of the distribution has rows,
the tail still brings new ones), ``--steps`` steps are timed, interleaved:

* **floor**: ``p = P[s]; a = A[s]; a += g * g; p -= lr * g / np.sqrt(a);
  P[s] = p; A[s] = a`` on the table's own arrays, ``s`` the rows' slots in the
  order the index returns them (found before the clock starts); the floor and
  the push take turns going first, as whichever goes second finds the rows
  in cache;
* **push**: psdk's apply of the same rows: the id checks (dtype, strictly
  increasing, this shard's), the gradient's shape and finiteness, the
  lookup, the rule on the gathered block, its finiteness check, the write
  back;
* **pull**: the training pull of the next batch's rows (lookup, creation of
  new rows, admission counts, LRU stamps), against the floor's gather
  ``P[s]`` alone, right after it (so on rows the pull brought into cache).

``--num-ps P`` times shard 0 of ``P`` with the part of each batch it holds;
``--preallocate`` makes the table a preallocated ``range`` table (every row
of the shard's block made at placement, indexed directly by ``id - low``:
``psdk/ps/tables/direct.py``) instead of a lazy ``hash`` one.

Prints microseconds per batch and the ratios. Usage:
``python benchmarks/table_update.py [--vocab N] [--batch B] [--warmup W] [--steps S] [--num-ps P] [--preallocate]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.ps.rules import Adagrad
from psdk.ps.tables.served import ServedTable

FIELDS = 26
DIM = 16
LR = 0.3


def batches(vocab: int, batch: int, seed: int) -> np.ndarray:
    """One batch's unique, sorted ids: ``batch x FIELDS`` Zipf draws (a = 1.2) folded into ``vocab``."""
    rng = np.random.default_rng(seed)
    draws = rng.zipf(1.2, size=batch * FIELDS) % vocab
    return np.unique(draws.astype(np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vocab", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-ps", type=int, default=1, help="time shard 0 of this many")
    parser.add_argument("--preallocate", action="store_true", help="a preallocated range table (direct index)")
    args = parser.parse_args()
    rule = Adagrad(lr=LR, initial_accumulator_value=0.1, eps=0.0)
    sharding = "range" if args.preallocate else "hash"
    spec = TableSpec("emb", DIM, args.vocab, init_scale=0.01, sharding=sharding, preallocate=args.preallocate)
    table = ServedTable(spec, 0, args.num_ps, rule)

    def shard_batch(step: int) -> np.ndarray:
        ids = batches(args.vocab, args.batch, step)
        return ids[shard_of_ids(spec, ids, args.num_ps) == 0]

    rng = np.random.default_rng(1)
    for step in range(args.warmup):
        ids = shard_batch(step)
        table.pull(ids)
        table.commit(table.stage_update(table.check_grad(ids, grads(rng, len(ids))), rule, step))
    rows, accumulators = table.rows.rows, table.rows.slots["sum"]
    timings: dict[str, list[float]] = {"floor": [], "push": [], "gather": [], "pull": []}
    unique = []
    for step in range(args.warmup, args.warmup + args.steps):
        ids = shard_batch(step)
        started = time.perf_counter()
        table.pull(ids)
        timings["pull"].append(time.perf_counter() - started)
        slots = table.rows.index.find(ids)
        started = time.perf_counter()
        gathered = rows[slots]
        timings["gather"].append(time.perf_counter() - started)
        del gathered
        g = grads(rng, len(ids))
        for name in ("floor", "push") if step % 2 else ("push", "floor"):
            started = time.perf_counter()
            if name == "floor":
                p, a = rows[slots], accumulators[slots]
                a += g * g
                p -= LR * g / np.sqrt(a)
                rows[slots], accumulators[slots] = p, a
            else:
                table.commit(table.stage_update(table.check_grad(ids, g), rule, step))
            timings[name].append(time.perf_counter() - started)
        unique.append(len(ids))
    us = {name: statistics.median(values) * 1e6 for name, values in timings.items()}
    kind = "preallocated range (direct index)" if args.preallocate else "lazy hash"
    print(
        f"{args.steps} batches of {args.batch} x {FIELDS} ids (median {statistics.median(unique):.0f} unique on "
        f"shard 0 of {args.num_ps}) over {args.vocab:,}, dim {DIM}, {kind} table, after {args.warmup} steps; "
        f"{len(table.rows):,} rows held"
    )
    print("| what | psdk µs | numpy floor µs | ÷ floor |")
    print("| --- | --- | --- | --- |")
    print(f"| apply a push (checks, lookup, Adagrad, finiteness, write back) | {us['push']:.0f} | {us['floor']:.0f} | "
          f"{us['push'] / us['floor']:.2f}× |")  # fmt: skip
    print(f"| training pull (lookup, creation, counts, stamps) | {us['pull']:.0f} | {us['gather']:.0f} | "
          f"{us['pull'] / us['gather']:.2f}× |")  # fmt: skip


def grads(rng: np.random.Generator, count: int) -> np.ndarray:
    return (rng.standard_normal((count, DIM)) * 0.01).astype(np.float32)


if __name__ == "__main__":
    main()
