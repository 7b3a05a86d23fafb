"""The CTR trainers' tests' common set-up: the contract's variables, random weights, rows and batches.

Every framework's ``tests/test_ctr.py`` holds its trainer to the same
contract on the same data; written once here, a change to the contract or to
the data reaches all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from psdk.plugins.batches import Batch, JaggedIds
from psdk.workloads.ctr.data import DENSE, FIELDS

CONTRACT = {  # the contract's canonical names and shapes, written out rather than derived
    "bottom0/kernel": (13, 64),
    "bottom0/bias": (64,),
    "bottom1/kernel": (64, 16),
    "bottom1/bias": (16,),
    "top0/kernel": (367, 64),
    "top0/bias": (64,),
    "top1/kernel": (64, 1),
    "top1/bias": (1,),
}


def random_weights(spec: Any, seed: int) -> dict[str, np.ndarray]:
    """Weights no job starts from: every bias non-zero, so a dropped bias shows (``spec.variables()``'s shapes)."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.2, shape).astype(np.float32) for name, shape in spec.variables()}


def click_batch(size: int, seed: int, vocab: int = 300) -> Batch:
    """The contract's batch: ids drawn from a few hundred, so that a batch repeats ids within and across fields."""
    rng = np.random.default_rng(seed)
    dense = np.log1p(rng.exponential(3.0, (size, DENSE))).astype(np.float32)
    cat = rng.integers(0, vocab, (size, FIELDS), dtype=np.int64)
    ids = {"emb": JaggedIds(cat.reshape(-1), np.arange(0, FIELDS * size + 1, FIELDS))}
    return Batch({"dense": dense, "cat": cat}, (rng.random(size) < 0.3).astype(np.float32), ids)


def table_rows(capacity: int, seed: int, dim: int = 16) -> np.ndarray:
    """A random row for every id below ``capacity``, as the ps would write them."""
    return np.random.default_rng(seed + 100).normal(0, 0.3, (capacity, dim)).astype(np.float32)
