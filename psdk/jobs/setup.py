"""What one worker task of a workload's job runs with (the MNIST job's, today), built once from its config at its start.

A worker used to go back to the composed config for each piece on its way
(the cluster, the sync spec, the backend options, the model spec, the update
rule, the announced ps), and built the sync spec three times. Now
:func:`worker_setup` builds every piece once, checked, into one frozen
:class:`WorkerSetup`, and the job reads its settings only from there. The
config itself stays in it only to be recorded (checkpoints, ``summary.json``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.client import ClientOptions
from psdk.config import build
from psdk.config.options import TaskOptions, options_from
from psdk.launch import LAUNCHED_ENV
from psdk.plugins import check_framework
from psdk.plugins.models import ModelSpec
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.partitions import Partitioning
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import UpdateRule


@dataclass(frozen=True)
class WorkerSetup:
    """One worker's typed settings: each built once by :func:`worker_setup`, never read from the config again."""

    task: int
    cluster: ClusterSpec
    """As ``ps_hosts`` and ``worker_hosts`` give it; :meth:`announced` adds the addresses the ps tasks announced."""
    options: TaskOptions
    sync: SyncSpec
    rule: UpdateRule
    model: ModelSpec
    backend: str
    """The backend this worker runs (``topology.worker_backends`` may give it its own)."""
    backend_options: dict[str, Any]
    sharding: str
    partitioning: Partitioning
    """Which variables the chief splits across the ps tasks (``topology.partition_min_bytes``, ``.partitions``)."""
    run_id: str | None
    seed: int
    output_dir: Path
    resume: str | None
    """A checkpoint for the chief to resume from (``resume=``); never a worker's."""
    data: Any
    """The ``data`` group, as the dataset plugins take it."""
    validation_size: int
    tensorboard: bool
    step_ends: bool
    """Keep each step's end time and write them at the end (``report.step_ends``)."""
    ps_hosts_from: str | None
    fingerprint: str
    config: DictConfig
    """The composed config, only to be recorded: in each checkpoint and in ``summary.json``."""

    @property
    def is_chief(self) -> bool:
        return self.task == 0

    @property
    def client(self) -> ClientOptions:
        """What :func:`psdk.connect` takes: ``transport.*`` as it is, and the recovery wait."""
        return ClientOptions(transport=self.options.transport, recovery_timeout_s=self.options.recovery.wait_s)

    def announced(self) -> ClusterSpec:
        """The cluster with the ps addresses announced in ``ps_hosts_from`` (if set), once they all have."""
        return build.with_announced_ps(self.ps_hosts_from, self.cluster, self.options.transport)


def worker_setup(cfg: DictConfig) -> WorkerSetup:
    """Worker ``task_index``'s setup from its composed config, checked; raises a ConfigError naming a bad key."""
    options = options_from(cfg)
    task = int(cfg.task_index)
    cluster = build.cluster_from(cfg)
    cluster.check_task("worker", task)
    sync = build.sync_spec(cfg)
    build.check_training(cfg, options, sync, warn=LAUNCHED_ENV not in os.environ)
    backend = build.topology(cfg).backend_of(task, str(cfg.backend))
    check_framework(backend)  # a framework not installed is named before anything is built with it
    return WorkerSetup(
        task=task,
        cluster=cluster,
        options=options,
        sync=sync,
        rule=build.update_rule(cfg),
        model=build.model_spec(cfg),
        backend=backend,
        backend_options=build.backend_options(cfg, backend),
        sharding=str(cfg.topology.sharding),
        partitioning=build.topology(cfg).partitioning(),
        run_id=build.run_id(cfg),
        seed=int(cfg.seed),
        output_dir=Path(str(cfg.output_dir)),
        resume=str(cfg.resume) if cfg.resume and task == 0 else None,
        data=cfg.data,
        validation_size=int(cfg.data.validation_size),
        tensorboard=bool(cfg.report.tensorboard),
        step_ends=bool(cfg.report.get("step_ends", False)),
        ps_hosts_from=str(cfg.ps_hosts_from) if cfg.get("ps_hosts_from") else None,
        fingerprint=build.fingerprint(cfg),
        config=cfg,
    )
