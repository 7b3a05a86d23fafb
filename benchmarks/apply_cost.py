"""What keeping the store finite costs an update: the checked apply against the rule's bare apply.

The ps applies every update after a backup of its parameters and slots and
checks the result for NaN and Inf (``psdk.store.FlatStore.apply``). This
times, for each update rule on the MLP's 79,510 floats (or ``--size``), the
rule's own in-place apply alone (the baseline, what the ps did before) and
the store's checked apply, interleaved, and prints microseconds per update
and their ratio. Usage: ``python benchmarks/apply_cost.py [--size N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.store import FlatStore

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
    print(f"| rule ({args.size:,} floats) | bare apply µs | checked apply µs | checked ÷ bare |")
    print("| --- | --- | --- | --- |")
    for name, rule in RULES:
        store = FlatStore()
        store.initialize({"w": np.zeros(args.size, np.float32)}, rule)
        params, state = np.zeros(args.size, np.float32), rule.new_state(args.size)
        bare_apply = functools.partial(rule.apply, params, grad, state)
        checked_apply = functools.partial(store.apply, grad)
        bare, checked = [], []
        for _ in range(args.reps):  # interleaved: a busy moment of the machine hurts both alike
            bare.append(per_call_us(bare_apply, args.count))
            checked.append(per_call_us(checked_apply, args.count))
        b, c = statistics.median(bare), statistics.median(checked)
        print(f"| {name} | {b:.1f} | {c:.1f} | {c / b:.2f}× |")


if __name__ == "__main__":
    main()
