"""What a workload feeds its trainer: batches the SDK can read, and one worker's shard of the data.

A :class:`Batch` is named numpy arrays, not a framework's tensors, so psdk can
look inside it before the forward pass: the rows a batch will look up in each
embedding table are its :attr:`Batch.ids`, one :class:`JaggedIds` per table
(values and offsets, as TorchRec's ``KeyedJaggedTensor`` keeps them), which a
worker can pull from the ps before the step. A dense workload's batch has
inputs and targets only.

A workload's ``shard`` entry gives each worker a :class:`Shard`: its training
batches, pass after pass, and the validation and test sets it is scored on.
:class:`ArrayShard` is the one for data that fits in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.protocol.ids import unique_positions


@dataclass(frozen=True)
class JaggedIds:
    """The ids each example of a batch looks up in one table: example i's are ``values[offsets[i]:offsets[i+1]]``."""

    values: np.ndarray
    offsets: np.ndarray
    _unique_positions: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values, offsets = np.asarray(self.values), np.asarray(self.offsets)
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"jagged ids need a 1-d integer array of values, got {values.dtype} {values.shape}")
        if offsets.ndim != 1 or len(offsets) < 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError(f"jagged ids need a 1-d integer array of offsets, got {offsets.dtype} {offsets.shape}")
        if offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < 0):
            raise ValueError(
                f"jagged offsets must rise from 0 to the number of values ({len(values)}), got {offsets.tolist()[:8]}"
            )
        if len(values) and values.min() < 0:
            raise ValueError(f"ids are row numbers, never negative: {int(values.min())}")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "offsets", offsets)

    @property
    def rows(self) -> int:
        """Examples in the batch (each looks up zero or more ids)."""
        return len(self.offsets) - 1

    def unique(self) -> np.ndarray:
        """The distinct ids the batch looks up, sorted: what a worker pulls before the step."""
        return self._sorted()[0]

    def positions(self) -> np.ndarray:
        """Where each of :attr:`values` is in :meth:`unique` (int64): ``unique()[positions()]`` is ``values``.

        A trainer that holds only a batch's pulled rows (``psdk_torch.pulled.PulledEmbedding``) finds each
        lookup's row by it. Both come from one sort, done once per batch and kept.
        """
        return self._sorted()[1]

    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        if self._unique_positions is None:
            object.__setattr__(self, "_unique_positions", unique_positions(self.values))
        assert self._unique_positions is not None
        return self._unique_positions

    def take(self, start: int, stop: int) -> JaggedIds:
        """The ids of examples ``start`` to ``stop``."""
        low, high = int(self.offsets[start]), int(self.offsets[stop])
        return JaggedIds(self.values[low:high], self.offsets[start : stop + 1] - low)


@dataclass(frozen=True)
class Batch:
    """Named input arrays, the targets, and per table the ids looked up: one step's data, readable by psdk."""

    inputs: Mapping[str, np.ndarray]
    targets: np.ndarray
    ids: Mapping[str, JaggedIds] = field(default_factory=dict)

    def __post_init__(self) -> None:
        size = len(self.targets)
        for name, array in self.inputs.items():
            if len(array) != size:
                raise ValueError(f"input {name!r} has {len(array)} rows, the targets {size}")
        for table, ids in self.ids.items():
            if ids.rows != size:
                raise ValueError(f"the ids of table {table!r} cover {ids.rows} examples, the targets {size}")

    def __len__(self) -> int:
        return len(self.targets)

    def take(self, start: int, stop: int) -> Batch:
        """Examples ``start`` to ``stop`` (evaluation goes through a large set this way, a slice at a time)."""
        return Batch(
            {name: array[start:stop] for name, array in self.inputs.items()},
            self.targets[start:stop],
            {table: ids.take(start, min(stop, ids.rows)) for table, ids in self.ids.items()},
        )


@dataclass(frozen=True)
class ShardRequest:
    """What a workload's ``shard`` entry is asked for: which part of the data, and the settings it may read.

    Worker ``task`` of ``num_workers`` takes its part of the training set
    (``python -m psdk evaluate`` asks as the only worker, for the test set);
    ``data`` is the job's ``data`` group (``data.dir``, ``data.validation_size``,
    ...), ``model`` the model spec (to check it fits the data), ``options``
    the workload's own ``workload.*`` keys, ``seed`` the job's.
    """

    task: int
    num_workers: int
    data: Any
    model: Any
    options: Mapping[str, Any]
    seed: int = 0


class Shard(ABC):
    """One worker's part of a workload's data: training batches, and the sets it is scored on.

    ``train_size`` is the examples of every worker's shard together, what an
    epoch passes over (:mod:`psdk.jobs.epochs`); ``passes`` counts this
    worker's passes over its own part, which its report shows.
    """

    train_size: int
    validation: Batch | None
    test: Batch
    passes: int = 0

    @abstractmethod
    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Shuffled training batches of ``batch_size``, pass after pass, never ending; counts :attr:`passes`."""

    def shuffled_rows(self, size: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
        """The rows of each batch of ``size`` examples: a fresh permutation per pass, counted in :attr:`passes`."""
        if size < batch_size:
            raise ValueError(f"a shard of {size} examples cannot fill a batch of {batch_size}")
        rng = np.random.default_rng(seed)
        while True:
            self.passes += 1  # over this shard: not the job's epochs (psdk.jobs.epochs), which count all workers'
            order = rng.permutation(size)
            for i in range(size // batch_size):
                yield order[i * batch_size : (i + 1) * batch_size]


class ArrayShard(Shard):
    """A shard held in memory: training arrays cut into shuffled batches, validation and test sets."""

    def __init__(self, train: Batch, test: Batch, validation: Batch | None = None, train_size: int | None = None):
        self.train, self.test, self.validation = train, test, validation
        self.train_size = len(train) if train_size is None else train_size
        self.passes = 0

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        for rows in self.shuffled_rows(len(self.train), batch_size, seed):
            yield Batch(
                {name: array[rows] for name, array in self.train.inputs.items()},
                self.train.targets[rows],
                {table: take_rows(ids, rows) for table, ids in self.train.ids.items()},
            )


def take_rows(ids: JaggedIds, rows: np.ndarray) -> JaggedIds:
    """The ids of examples ``rows`` (any order), as a new jagged array."""
    lengths = np.diff(ids.offsets)[rows]
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not len(ids.values):
        return JaggedIds(ids.values[:0], offsets)
    starts = ids.offsets[rows]
    picks = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    return JaggedIds(ids.values[picks], offsets)
