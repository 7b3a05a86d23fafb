"""The MNIST workload's data and scoring: each worker's shard of the images, and accuracy of the logits.

What makes MNIST a workload is here and in :mod:`psdk.workloads.mnist.trainers`
(its loss, on numpy; the framework plugins give it theirs); psdk's loop
(:mod:`psdk.jobs.worker`) trains it as it trains any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import numpy as np

from psdk.data import mnist
from psdk.plugins.batches import Batch, Shard, ShardRequest
from psdk.workloads.mnist.checks import load_fitting
from psdk.workloads.mnist.trainers import IMAGE


class MnistShard(Shard):
    """One worker's MNIST: its shard of the training images, the validation and test sets.

    Images stay uint8 until used: scaling a worker's 27,500 training images
    up front cost each worker about 0.25 s of start-up, on the path to its
    first gradient, so each batch is scaled as it is cut, and the validation
    and test sets once, when first read.
    """

    def __init__(self, split: mnist.Split, num_workers: int):
        self.split = split
        self.train_size = split.train_size or len(split.train_images) * num_workers
        self.passes = 0

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        images, labels = self.split.train_images, self.split.train_y
        for rows in self.shuffled_rows(len(images), batch_size, seed):
            yield Batch({IMAGE: mnist.to_float(images[rows])}, labels[rows])

    @cached_property
    def validation(self) -> Batch | None:  # type: ignore[override]
        return Batch({IMAGE: self.split.val_x}, self.split.val_y) if len(self.split.val_y) else None

    @cached_property
    def test(self) -> Batch:  # type: ignore[override]
        return Batch({IMAGE: self.split.test_x}, self.split.test_y)


def shard(request: ShardRequest) -> MnistShard:
    """This worker's part of the job's dataset (``data.name``), once the model is known to fit it."""
    data = load_fitting(request.data, request.model)
    held_out = int(request.data.get("validation_size", 0) or 0)
    split = mnist.split(data, request.task, request.num_workers, held_out)
    return MnistShard(split, request.num_workers)


def score(logits: np.ndarray, batch: Batch) -> dict[str, float]:
    """Accuracy: the fraction of examples whose largest logit is their label."""
    labels = np.asarray(batch.targets)
    correct = int(np.count_nonzero(np.argmax(logits, axis=1) == labels)) if len(labels) else 0
    return {"accuracy": correct / max(1, len(labels))}
