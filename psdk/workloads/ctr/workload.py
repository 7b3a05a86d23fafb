"""The CTR workload's record entries: options, metrics, each worker's shard, the score, the check.

A worker's training batches are generated as they are cut (or streamed from
Criteo TSV files when ``workload.criteo_dir`` names a folder); its validation
and test sets are fixed held-out sets every worker shares. The score is the
AUC and log loss of the logits, and, on generated data, the best AUC the
hidden model itself scores on the same examples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.batches import Batch, Shard, ShardRequest
from psdk.plugins.metrics import MetricSpec
from psdk.plugins.options import WorkloadOptions
from psdk.workloads.ctr.data import TEST, TRAIN, VALIDATION, ClickLog, auc, log_loss, read_tsv, tsv_files

METRICS = (
    MetricSpec("loss", higher_is_better=False, held_out=False),
    MetricSpec("auc", label="AUC", primary=True),
    MetricSpec("logloss", label="log loss", higher_is_better=False),
    MetricSpec("best_auc", label="best AUC", short="best"),
)
"""The training batch's cross-entropy; on held-out data the AUC (primary), the log loss, and the AUC of
the generator's hidden model on the same examples (what no model can beat; absent on real data)."""

HOLD_OUT_EVERY = 10
"""Criteo files: every tenth line is held out (the first ``test_size`` of them are the test set)."""


@dataclass(frozen=True)
class CtrOptions(WorkloadOptions):
    """The workload's ``workload.*`` keys and their defaults."""

    seed: int = 0
    """The data's seed (the hidden model and every set), apart from the job's ``seed`` (the model's)."""
    vocab: int = 1_000_000
    """The largest field's vocabulary (the smallest has 10 values)."""
    zipf: float = 1.1
    examples: int = 10_000_000
    """What an epoch counts (``train.epochs``); generated batches never run out."""
    validation_size: int = 5_000
    test_size: int = 20_000
    criteo_dir: str | None = None
    """A folder of Criteo TSV files to train on instead of generated data."""

    def __post_init__(self) -> None:
        self.check_whole(seed=0, vocab=10, examples=1, validation_size=0, test_size=1)
        self.check_number("zipf", lambda z: 0 < z < 10, "in (0, 10)")


OPTIONS = CtrOptions().as_dict()

_BEST: dict[int, float] = {}
"""The hidden model's AUC of each held-out set a shard made, by the set's id (the shard keeps it alive)."""


class GeneratedShard(Shard):
    """One worker's generated click log: batches made as they are cut; shared validation and test sets."""

    def __init__(self, log: ClickLog, options: CtrOptions):
        self.log, self.options = log, options
        self.train_size = options.examples
        self.passes = 0

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        self.passes = 1  # generated data never repeats: one endless pass
        number = 0
        while True:
            yield self.log.batch(TRAIN, seed, number, batch_size)
            number += 1

    def _held_out(self, stream: int, size: int) -> Batch:
        batch, logits = self.log.held_out(stream, size)
        _BEST[id(batch)] = auc(logits, batch.targets)
        return batch

    @cached_property
    def validation(self) -> Batch | None:  # type: ignore[override]
        return self._held_out(VALIDATION, self.options.validation_size) if self.options.validation_size else None

    @cached_property
    def test(self) -> Batch:  # type: ignore[override]
        return self._held_out(TEST, self.options.test_size)


class TsvShard(Shard):
    """One worker's share of Criteo TSV files, streamed a chunk at a time, pass after pass."""

    def __init__(self, folder: str, capacity: int, options: CtrOptions, task: int, num_workers: int):
        self.files, self.capacity, self.options = tsv_files(folder), capacity, options
        self.task, self.num_workers = task, num_workers
        self.train_size = options.examples
        self.passes = 0

    def _mine(self, line: int) -> bool:
        """A training line (not held out) dealt to this worker: training lines round-robin."""
        return (
            line % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1
            and (line - line // HOLD_OUT_EVERY) % self.num_workers == self.task
        )

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        while True:
            self.passes += 1
            full = 0
            for batch in read_tsv(self.files, self.capacity, batch_size, self._mine):
                if len(batch) == batch_size:
                    full += 1
                    yield batch
            if not full:
                raise ConfigError("workload.criteo_dir", f"holds too few lines for a batch of {batch_size} per worker")

    @cached_property
    def validation(self) -> Batch | None:  # type: ignore[override]
        return None

    @cached_property
    def test(self) -> Batch:  # type: ignore[override]
        """The first ``test_size`` held-out lines (every tenth line of the files)."""
        held_out = read_tsv(self.files, self.capacity, self.options.test_size, self._held_out)
        for batch in held_out:
            return batch
        raise ConfigError("workload.criteo_dir", f"holds fewer than {HOLD_OUT_EVERY} lines: none to test on")

    @staticmethod
    def _held_out(line: int) -> bool:
        return line % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1


def check_model(model: Any) -> None:
    """Refuse a model with no embedding table to look the fields up in."""
    if getattr(model, "capacity", None) is None or getattr(model, "dim", None) is None:
        raise ConfigError(
            "model",
            f"model={getattr(model, 'name', None)} has no embedding table (model.capacity, model.dim); "
            "workload=ctr trains a DLRM: use model=dlrm",
        )


# ----------------------------------------------------------------------------- the record's entries
def shard(request: ShardRequest) -> Shard:
    """This worker's data: generated from ``workload.seed``, or its share of ``workload.criteo_dir``."""
    options = CtrOptions.of(request.options)
    check_model(request.model)
    capacity = int(request.model.capacity)
    if options.criteo_dir:
        try:
            return TsvShard(str(options.criteo_dir), capacity, options, request.task, request.num_workers)
        except FileNotFoundError as exc:
            raise ConfigError("workload.criteo_dir", str(exc)) from None
    return GeneratedShard(ClickLog(options.seed, options.vocab, options.zipf, capacity), options)


def score(predictions: np.ndarray, batch: Batch) -> dict[str, float]:
    """AUC and log loss of the logits (any framework's, float [n] or [n, 1]); the best AUC on generated data."""
    logits = np.asarray(predictions, np.float64).reshape(len(batch))
    scored = {"auc": auc(logits, batch.targets), "logloss": log_loss(logits, batch.targets)}
    best = _BEST.get(id(batch))
    if best is not None and not math.isnan(best):
        scored["best_auc"] = best
    return scored


def train_size(cfg: Any) -> int:
    return CtrOptions.of(cfg.workload).examples


def check(cfg: Any) -> None:
    """Refuse, before any task starts, options no data can come from and a model without a table."""
    options = CtrOptions.of(cfg.workload)
    check_model(cfg.model)
    if cfg.get("train") is not None and cfg.train.get("overlap"):
        raise ConfigError("train.overlap", "is not supported with embedding tables yet: use train.overlap=false")
    if options.criteo_dir:
        try:
            tsv_files(str(options.criteo_dir))
        except FileNotFoundError as exc:
            raise ConfigError("workload.criteo_dir", str(exc)) from None
