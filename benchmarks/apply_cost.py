"""What keeping the store finite costs an update, both ways, against the rule's bare apply.

The store proves an update finite from bounds (scalars) when it can, and
otherwise backs its state up, applies and checks (``psdk.ps.store``). This
times, for each update rule on the MLP's 79,510 floats (or ``--size``),
interleaved: the rule's own in-place apply alone (the baseline, what the ps
did before), the store's apply with the gradient's bound the ps measures
anyway (the usual path), and the store's apply without one (the backup and
check), and prints microseconds per update and the ratios to the baseline.
Usage: ``python benchmarks/apply_cost.py [--size N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from psdk.protocol.numerics import magnitude
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.ps.store import FlatStore

RULES: list[tuple[str, UpdateRule]] = [
    ("sgd", SGD(lr=0.01)),
    ("momentum", SGD(lr=0.01, momentum=0.9)),
    ("adam", Adam(lr=1e-3)),
    ("adagrad", Adagrad(lr=0.01)),
    ("rmsprop", RMSProp(lr=0.01)),
]


def per_call_us(call: Callable[[], None], count: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, default=79_510)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--count", type=int, default=500)
    args = parser.parse_args()
    grad = np.random.default_rng(0).standard_normal(args.size).astype(np.float32) * 1e-3
    print(f"| rule ({args.size:,} floats) | bare apply µs | with bounds µs | ÷ bare | backup and check µs | ÷ bare |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rule in RULES:
        bounded_store, checked_store = FlatStore(), FlatStore()
        for store in (bounded_store, checked_store):
            store.initialize({"w": np.zeros(args.size, np.float32)}, rule)
        params, state = np.zeros(args.size, np.float32), rule.new_state(args.size)
        bound = magnitude(grad)
        timed = {
            "bare": functools.partial(rule.apply, params, grad, state),
            "bounds": functools.partial(bounded_store.apply, grad, bound),
            "checked": functools.partial(checked_store.apply, grad, None),
        }
        figures: dict[str, list[float]] = {key: [] for key in timed}
        for _ in range(args.reps):  # interleaved: a busy moment of the machine hurts all alike
            for key, call in timed.items():
                figures[key].append(per_call_us(call, args.count))
        b, w, c = (statistics.median(figures[key]) for key in timed)
        print(f"| {name} | {b:.1f} | {w:.1f} | {w / b:.2f}× | {c:.1f} | {c / b:.2f}× |")


if __name__ == "__main__":
    main()
