"""What an epoch is in psdk, and the arithmetic between epochs, batches and global steps.

An epoch is one pass over the training set by the job as a whole: every
worker once through its own shard (the workers split the training set, each
workload's ``shard`` entry), so every training example is used once. That
is what an epoch means to Keras and PyTorch, and it does not change with the
number of workers: 3 epochs train on as many images with 2 workers as with 8.
TensorFlow 1.x's ps/worker programs counted otherwise, each worker looping
over the whole set N times; with W workers that is ``train.epochs=N*W`` here
(docs/configuration.md#epochs).

A pass over a shard cuts ``shard // batch_size`` batches (the rest wait,
reshuffled, for the next pass), so an epoch is the sum of those over the
workers: 549 batches of 100 for 55,000 examples on 3 workers. The size of
the training set is the workload's to say (its ``train_size`` entry). A global step
uses one batch in async and ssp modes, and ``replicas_to_aggregate`` batches
in sync mode (the mean of that many gradients is one update; a backup
worker's dropped gradient uses none). ``train.epochs`` sets ``train.steps``
to the steps that use that many epochs' batches, and the logs, metrics and
``summary.json`` count epochs the same way, from the global step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from psdk.errors import ConfigError

log = logging.getLogger(__name__)


def shard_sizes(train_size: int, num_workers: int) -> list[int]:
    """Each worker's share of ``train_size`` training examples, as :func:`numpy.array_split` cuts them."""
    base, extra = divmod(train_size, num_workers)
    return [base + (1 if i < extra else 0) for i in range(num_workers)]


@dataclass(frozen=True)
class EpochCount:
    """Batches in one epoch of the job, and batches one global step uses."""

    batches_per_epoch: int
    batches_per_step: int = 1

    @classmethod
    def of_job(cls, train_size: int, num_workers: int, batch_size: int, batches_per_step: int = 1) -> EpochCount:
        """The count for ``train_size`` examples split over ``num_workers`` workers cutting ``batch_size`` batches."""
        if num_workers < 1 or batch_size < 1 or batches_per_step < 1:
            raise ValueError(f"workers {num_workers}, batch {batch_size}, batches per step {batches_per_step}")
        per_epoch = sum(size // batch_size for size in shard_sizes(train_size, num_workers))
        if per_epoch < 1:
            raise ConfigError(
                "train.batch_size",
                f"{batch_size} leaves no whole batch in a worker's shard of {train_size} examples over {num_workers} "
                "workers, so an epoch would use none",
            )
        return cls(per_epoch, batches_per_step)

    def steps_for(self, epochs: float) -> int:
        """The global steps that use ``epochs`` epochs' batches (rounded up: the last epoch is whole)."""
        return max(1, math.ceil(epochs * self.batches_per_epoch / self.batches_per_step - 1e-9))

    def at_step(self, global_step: int) -> float:
        """Epochs the job has used by ``global_step``."""
        return global_step * self.batches_per_step / self.batches_per_epoch


def batches_per_step(sync: Any, num_workers: int) -> int:
    """Batches one global step uses: ``replicas_to_aggregate`` (null: every worker) in sync mode, else 1."""
    resolved = sync.resolved(num_workers)
    return int(resolved.replicas_to_aggregate) if resolved.waits_for_rounds else 1


def count_of(cfg: Any, num_workers: int, train_size: int) -> EpochCount:
    """The job's :class:`EpochCount` from its config (``train.batch_size``, ``sync``)."""
    from psdk.config import build

    per_step = batches_per_step(build.sync_spec(cfg), num_workers)
    return EpochCount.of_job(train_size, num_workers, int(cfg.train.batch_size), per_step)


def workload_train_size(cfg: Any) -> int:
    """The training examples of the whole job, as the workload counts them (its ``train_size`` entry).

    A workload without one counts no epochs: ``train.epochs`` is refused, naming ``train.steps``.
    """
    from psdk.plugins.loading import run_entry, workload_of

    size = run_entry(cfg, "train_size")
    if size is None:
        raise ConfigError(
            "train.epochs",
            f"the workload {workload_of(cfg).name!r} does not say how big its training set is (it has no "
            "train_size entry), so it counts no epochs; give train.steps instead",
        )
    return int(size)


def resolve_steps(cfg: Any) -> int | None:
    """Set ``train.steps`` from ``train.epochs`` (when given) in ``cfg`` itself; the steps set, else None.

    Done once where a job's config is first known, the launcher's and each
    worker's, so the config every task writes, its checkpoints (which refuse
    a step beyond ``train.steps``) and ``summary.json`` all carry the steps
    the epochs make. The number of workers is the launcher's
    ``topology.num_workers`` or a worker's ``worker_hosts``.
    """
    epochs = cfg.train.get("epochs")
    if epochs is None:
        return None
    from psdk.config import build

    num_workers = build.num_workers(cfg)
    count = count_of(cfg, num_workers, workload_train_size(cfg))
    steps = count.steps_for(float(epochs))
    cfg.train.steps = steps
    log.info(
        "%s: train.epochs=%g is %d global steps (an epoch: %d batches of %d over %d workers; %d batch(es) a step)",
        "launcher" if cfg.job_name is None else f"{cfg.job_name} {cfg.task_index}",
        float(epochs),
        steps,
        count.batches_per_epoch,
        int(cfg.train.batch_size),
        num_workers,
        count.batches_per_step,
    )
    return steps
