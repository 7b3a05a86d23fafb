"""The distributed MNIST job, one worker task of it, written on the public API.

Each worker reads its own shard of the training set, trains with
:class:`~psdk.api.DistributedOptimizer` until the ps says the target global
step is reached, and logs lines a TensorFlow user knows (worker, epoch,
global step, local step, loss, validation accuracy). The chief then waits for
the others, evaluates the final parameters of the ps on the test set, writes
``summary.json`` and ``params.npz``, and shuts the ps tasks down.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from omegaconf import DictConfig

from psdk.api import DistributedOptimizer, WorkerSession, connect
from psdk.backend import Backend
from psdk.config import build
from psdk.data import mnist
from psdk.metrics import MetricsLog, percentile, summary_line, write_json_atomic
from psdk.models import init_weights
from psdk.placement import RankPlacement, check_memory_fraction, visible_gpus
from psdk.plugins import load_backend

log = logging.getLogger(__name__)

LAUNCHED_ENV = "PSDK_LAUNCHED"


class Batches:
    """Shuffled mini-batches of one worker's shard, epoch after epoch."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
        if len(x) < batch_size:
            raise ValueError(f"a shard of {len(x)} images cannot fill a batch of {batch_size}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        per_epoch = len(self.x) // self.batch_size
        while True:
            self.epoch += 1
            order = self.rng.permutation(len(self.x))
            for i in range(per_epoch):
                idx = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield self.x[idx], self.y[idx]


@dataclass
class WorkerReport:
    task: int
    backend: str
    device: str
    local_steps: int = 0
    pushed: int = 0
    last_loss: float | None = None
    last_val_accuracy: float | None = None
    train_time_s: float = 0.0
    epochs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "local_steps": self.local_steps,
            "gradients_pushed": self.pushed,
            "last_loss": self.last_loss,
            "last_val_accuracy": self.last_val_accuracy,
            "train_time_s": round(self.train_time_s, 3),
            "epochs": self.epochs,
        }


def load_split(cfg: DictConfig, task: int, num_workers: int) -> mnist.Split:
    folder = mnist.resolve_dir(
        cfg.data.dir, cfg.data.cache_dir, bool(cfg.data.download), list(cfg.data.mirrors)
    )
    return mnist.split(
        mnist.load(folder), task, num_workers, int(cfg.data.validation_size), with_test=task == 0
    )


def run_worker(cfg: DictConfig) -> None:
    """One worker task of the MNIST job; raises :class:`~psdk.errors.PsdkError` on failure."""
    start = time.time()
    task = int(cfg.task_index)
    cluster = build.cluster_from(cfg)
    cluster.check_task("worker", task)
    backend = load_backend(str(cfg.backend))
    placement = RankPlacement(str(cfg.placement.device))
    device = placement.devices(cluster, task, visible_gpus())[0]
    backend.setup(device, int(cfg.train.threads), check_memory_fraction(cfg.placement.gpu_memory_fraction))
    log.info("worker %d: backend %s on %s, %d ps task(s)", task, backend.name, backend.device, cluster.num_ps)

    data = load_split(cfg, task, cluster.num_workers)
    spec = build.model_spec(cfg)
    model = backend.build_model(spec, init_weights(spec, int(cfg.seed)))
    framework_optimizer = backend.make_optimizer(model, build.update_rule(cfg))
    out = Path(cfg.output_dir)
    metrics = MetricsLog(out / "metrics.jsonl")
    report = WorkerReport(task, backend.name, backend.device)
    try:
        with connect(
            cluster,
            task,
            steps=int(cfg.train.steps),
            sync=build.sync_spec(cfg),
            sharding=str(cfg.topology.sharding),
            options=build.client_options(cfg),
        ) as session:
            optimizer = DistributedOptimizer(framework_optimizer, model, session, backend=backend)
            optimizer.broadcast_parameters()
            train(cfg, session, optimizer, backend, model, data, metrics, report)
            workers = session.finish(report.to_json(), float(cfg.train.final_wait_s))
            if session.is_chief:
                finalize(cfg, session, optimizer, workers, data, start)
    finally:
        metrics.close()


def train(
    cfg: DictConfig,
    session: WorkerSession,
    optimizer: DistributedOptimizer,
    backend: Backend,
    model: Any,
    data: mnist.Split,
    metrics: MetricsLog,
    report: WorkerReport,
) -> None:
    task = session.task_index
    batches = Batches(data.train_x, data.train_y, int(cfg.train.batch_size), int(cfg.seed) * 1000 + task)
    log_every, validate_every = int(cfg.train.log_every), int(cfg.train.validate_every)
    began = time.time()
    window_start, window_steps = began, 0
    for x, y in batches:
        loss = backend.forward_backward(model, x, y)
        result = optimizer.step()
        report.local_steps += 1
        report.last_loss = loss
        window_steps += 1
        if result.outcome != "done":
            report.pushed += 1
        step = report.local_steps
        validate = validate_every > 0 and step % validate_every == 0
        if validate or (log_every > 0 and step % log_every == 0) or result.done:
            now = time.time()
            rate = window_steps / max(now - window_start, 1e-9)
            window_start, window_steps = now, 0
            accuracy = backend.accuracy(model, data.val_x, data.val_y) if validate else None
            if accuracy is not None:
                report.last_val_accuracy = accuracy
            metrics.write(
                {
                    "task": f"worker{task}",
                    "epoch": batches.epoch,
                    "local_step": step,
                    "global_step": result.global_step,
                    "loss": round(loss, 6),
                    "accuracy": accuracy,
                    "time": round(now, 3),
                    "wall_s": round(now - began, 3),
                }
            )
            log.info(
                "worker %d: epoch %d, global step %d, local step %d, loss %.4f%s, %.0f steps/s",
                task,
                batches.epoch,
                result.global_step,
                step,
                loss,
                f", validation accuracy {accuracy:.4f}" if accuracy is not None else "",
                rate,
            )
        if result.done:
            break
    report.train_time_s = time.time() - began
    report.epochs = batches.epoch
    log.info(
        "worker %d: training time %.2f s, %d local steps (%.0f steps/s)",
        task,
        report.train_time_s,
        report.local_steps,
        report.local_steps / max(report.train_time_s, 1e-9),
    )


def finalize(
    cfg: DictConfig,
    session: WorkerSession,
    optimizer: DistributedOptimizer,
    workers: dict[str, Any],
    data: mnist.Split,
    start: float,
) -> dict[str, Any]:
    """Chief: evaluate the ps's final parameters and write the results (the ps still serves)."""
    for index, state in sorted(workers.items()):
        if state["status"] == "dead":
            log.warning("worker 0: worker %s died during the job: %s", index, state["reason"])
    optimizer.pull()
    backend = optimizer.backend
    test_accuracy = backend.accuracy(optimizer.model, data.test_x, data.test_y)
    out = Path(cfg.output_dir)
    client = session.client
    save_params(out / "params.npz", client.params)
    summary = build_summary(cfg, client.stats(), workers, test_accuracy, time.time() - start, backend.name)
    write_json_atomic(out / "summary.json", summary)
    log.info(
        "worker 0: test accuracy %.4f of the final parameters (global step %d)",
        test_accuracy,
        summary["global_step"],
    )
    if not os.environ.get(LAUNCHED_ENV):  # the launcher prints the job's last line itself
        print(summary_line(summary), flush=True)
    return summary


def save_params(path: Path, params: Mapping[str, np.ndarray]) -> None:
    """The final parameters by canonical name, loadable with ``np.load`` (no pickle)."""
    arrays: dict[str, Any] = {name: np.array(value) for name, value in params.items()}
    cast(Any, np.savez)(path, **arrays)


def build_summary(
    cfg: DictConfig,
    shards: list[dict[str, Any]],
    workers: dict[str, dict[str, str]],
    test_accuracy: float,
    wall_s: float,
    backend: str,
) -> dict[str, Any]:
    head = shards[0]
    stats = head["stats"]
    first, last = stats.get("first_update"), stats.get("last_update")
    version = int(head["version"])
    rate = version / (last - first) if first is not None and last is not None and last > first else None
    per_worker = {}
    for index, state in sorted(workers.items(), key=lambda kv: int(kv[0])):
        counters = stats["workers"].get(index, {})
        hist = counters.get("staleness", {})
        entry: dict[str, Any] = {
            "backend": backend,
            "status": state["status"],
            "reason": state["reason"],
            "gradients_pushed": counters.get("pushed", 0),
        }
        entry.update(head["reports"].get(index, {}))
        entry.update(
            {
                "gradients_applied": counters.get("applied", 0),
                "gradients_dropped": counters.get("dropped", 0),
                "staleness_p50": percentile(hist, 0.5),
                "staleness_p99": percentile(hist, 0.99),
                "staleness_histogram": hist,
            }
        )
        per_worker[index] = entry
    job = head["job"] or {}
    return {
        "backend": backend,
        "model": str(cfg.model.name),
        "optimizer": build.plain(cfg.optimizer),
        "sync": job.get("sync", {}),
        "num_ps": len(shards),
        "num_workers": len(workers),
        "steps": int(cfg.train.steps),
        "batch_size": int(cfg.train.batch_size),
        "test_accuracy": test_accuracy,
        "global_step": version,
        "gradients_applied": stats["applied"],
        "gradients_dropped": stats["dropped"],
        "global_steps_per_s": rate,
        "wall_s": wall_s,
        "workers": per_worker,
        "ps": [
            {
                "task": s["task"],
                "version": s["version"],
                "size": s["size"],
                "variables": s["variables"],
                "applied": s["stats"]["applied"],
                "dropped": s["stats"]["dropped"],
                "rejected": s["stats"]["rejected"],
            }
            for s in shards
        ],
    }
