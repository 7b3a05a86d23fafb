"""What the ps pays to apply a batch's rows, against a bare numpy floor on the same rows.

One shard's table (``ServedTable``, element-wise Adagrad lr 0.3 with TF1's
initial accumulator 0.1 and no epsilon), fed batches of a click log's shape:
``--batch`` examples of 26 fields, ids Zipf-distributed over ``--vocab``, each
batch's ids made unique and sorted as a worker sends them. After ``--warmup``
steps (the table at steady state: the head of the distribution has rows,
the tail still brings new ones), ``--steps`` steps are timed, interleaved:

* **floor**: ``p = P[s]; a = A[s]; a += g * g; p -= lr * g / np.sqrt(a);
  P[s] = p; A[s] = a`` on the table's own arrays, ``s`` the rows' slots in the
  order the index returns them (found before the clock starts);
* **push**: psdk's apply of the same rows: the id checks (dtype, strictly
  increasing, this shard's), the gradient's shape and finiteness, the
  lookup, the rule on the gathered block, its finiteness check, the write
  back;
* **pull**: the training pull of the next batch's rows (lookup, creation of
  new rows, admission counts, LRU stamps), against the floor's gather
  ``P[s]`` alone.

Prints microseconds per batch and the ratios. Usage:
``python benchmarks/table_update.py [--vocab N] [--batch B] [--warmup W] [--steps S]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psdk.protocol.tables import TableSpec
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
    args = parser.parse_args()
    rule = Adagrad(lr=LR, initial_accumulator_value=0.1, eps=0.0)
    spec = TableSpec("emb", dim=DIM, capacity=args.vocab, init_scale=0.01)
    table = ServedTable(spec, 0, 1, rule)
    rng = np.random.default_rng(1)
    for step in range(args.warmup):
        ids = batches(args.vocab, args.batch, step)
        table.pull(ids)
        table.commit(table.stage_update(table.check_grad(ids, grads(rng, len(ids))), rule, step))
    rows, accumulators = table.rows.rows, table.rows.slots["sum"]
    timings: dict[str, list[float]] = {"floor": [], "push": [], "gather": [], "pull": []}
    unique = []
    for step in range(args.warmup, args.warmup + args.steps):
        ids = batches(args.vocab, args.batch, step)
        started = time.perf_counter()
        table.pull(ids)
        timings["pull"].append(time.perf_counter() - started)
        slots = table.rows.index.find(ids)
        started = time.perf_counter()
        gathered = rows[slots]
        timings["gather"].append(time.perf_counter() - started)
        del gathered
        g = grads(rng, len(ids))
        started = time.perf_counter()
        p, a = rows[slots], accumulators[slots]
        a += g * g
        p -= LR * g / np.sqrt(a)
        rows[slots], accumulators[slots] = p, a
        timings["floor"].append(time.perf_counter() - started)
        started = time.perf_counter()
        table.commit(table.stage_update(table.check_grad(ids, g), rule, step))
        timings["push"].append(time.perf_counter() - started)
        unique.append(len(ids))
    us = {name: statistics.median(values) * 1e6 for name, values in timings.items()}
    print(
        f"{args.steps} batches of {args.batch} x {FIELDS} ids (median {statistics.median(unique):.0f} unique) "
        f"over {args.vocab:,}, dim {DIM}, after {args.warmup} steps; {len(table.rows):,} rows held"
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
