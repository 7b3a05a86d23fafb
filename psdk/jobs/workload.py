"""The chosen workload as psdk's loop runs it: its trainer on this worker's framework, its data, its scoring.

:mod:`psdk.jobs.worker` (training) and :mod:`psdk.jobs.evaluate` (saved
weights) both go through :class:`Workload`, so a metric is computed the same
way in a validation line, a worker's report, ``summary.json`` and
``python -m psdk evaluate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from psdk.config import build
from psdk.errors import PluginError
from psdk.plugins.backend import Backend
from psdk.plugins.batches import Batch, Shard, ShardRequest
from psdk.plugins.hookspecs import WorkloadRecord
from psdk.plugins.loading import check_trainer, load_target
from psdk.plugins.metrics import MetricSpec, primary
from psdk.plugins.trainer import Trainer


class Workload:
    """The chosen workload as one worker runs it: its record, its trainer on this framework, its scoring."""

    def __init__(self, record: WorkloadRecord, backend: Backend, options: Mapping[str, Any]):
        self.record = record
        self.trainer = make_trainer(record, backend, options)
        self._score = load_target(record.score, f"the score entry of workload {record.name!r}")
        self.primary: MetricSpec | None = primary(record.metrics)
        self.held_out = [m for m in record.metrics if m.held_out]

    def shard(self, request: ShardRequest) -> Shard:
        """This worker's part of the data, from the workload's ``shard`` entry (checked to be a Shard)."""
        made = load_target(self.record.shard, f"the shard entry of workload {self.record.name!r}")(request)
        if not isinstance(made, Shard):
            raise PluginError(
                f"workload {self.record.name!r}'s shard entry {self.record.shard} returned {type(made).__name__}, "
                "not a psdk.plugins.batches.Shard (psdk.ArrayShard holds data that fits in memory)"
            )
        return made

    def score(self, model: Any, batch: Batch) -> dict[str, float]:
        """The workload's held-out metrics of ``model`` on ``batch``: the trainer predicts, the workload scores."""
        scored = self._score(self.trainer.predictions(model, batch), batch)
        return {name: float(value) for name, value in dict(scored).items()}

    def shown(self, where: str, values: Mapping[str, float]) -> str:
        """``test accuracy 0.9812``: each metric as the workload's spec shows it (undeclared ones to 4 places)."""
        specs = {m.name: m for m in self.record.metrics}
        return ", ".join(
            f"{where} {specs[n].words} {specs[n].show(v)}" if n in specs else f"{where} {n} {v:.4f}"
            for n, v in values.items()
        )


def make_trainer(record: WorkloadRecord, backend: Backend, options: Mapping[str, Any]) -> Trainer:
    """The workload's trainer for ``backend``'s framework, on that bridge."""
    target = check_trainer(record, backend.name)
    cls = load_target(target, f"the {backend.record.framework} trainer of workload {record.name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise PluginError(f"workload {record.name!r}'s trainer {target} is not a psdk.plugins.trainer.Trainer")
    return cls(backend, options)


def workload_options(cfg: DictConfig) -> dict[str, Any]:
    """The ``workload.*`` keys the job sets (its name aside): what the workload's trainer and entries read."""
    node = cfg.get("workload") or {}
    return {str(k): v for k, v in build.plain(node).items() if k != "name"}
