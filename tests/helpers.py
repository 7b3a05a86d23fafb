"""Workers as threads of the test process, on the public API and the numpy backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import psdk
from psdk.client import ClientOptions
from psdk.client.checkpoint import Checkpoint
from psdk.config.options import TransportOptions
from psdk.plugins.backends.numpy_backend import NumpyBackend, NumpyModel
from psdk.plugins.batches import Batch as StepBatch
from psdk.plugins.models import ModelSpec, init_weights
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.partitions import Partitioning
from psdk.ps.rules import UpdateRule
from psdk.transport import Transport
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier
from psdk.workloads.mnist.workload import score

CLASSIFIER = NumpyClassifier(NumpyBackend())
"""MNIST's numpy trainer, the step a script on the numpy bridge takes (the bridge itself has no loss)."""


def forward_backward(model: NumpyModel, x: np.ndarray, y: np.ndarray) -> float:
    """Cross-entropy on ``(x, y)``, leaving the gradients in ``model``."""
    return CLASSIFIER.forward_backward(model, StepBatch({IMAGE: x}, y))


def accuracy(model: NumpyModel, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    batch = StepBatch({IMAGE: x}, y)
    return score(CLASSIFIER.predictions(model, batch), batch)["accuracy"]


Batch = tuple[np.ndarray, np.ndarray]
FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, request_timeout_s=30.0, init_timeout_s=30.0
    )
)


def train_threads(
    cluster: ClusterSpec,
    transport: Transport,
    spec: ModelSpec,
    rule: UpdateRule,
    steps: int,
    batch_of: Callable[[int, int], Batch],
    sync: str = "async",
    replicas: int | None = None,
    seed: int = 0,
    sharding: str = "round_robin",
    by_global_step: bool = False,
    checkpoint_at: int | None = None,
    checkpoint_dir: Path | None = None,
    resume: Checkpoint | None = None,
    partitioning: Partitioning | None = None,
) -> dict[str, Any]:
    """Run every worker of ``cluster`` as a thread until the ps says done.

    ``batch_of(worker, step)`` gives each worker its batches, by local step
    (or by global step, so a resumed job sees the same ones). The chief
    writes a checkpoint once the global step reaches ``checkpoint_at``. Returns
    the final parameters (pulled by the chief), each worker's local steps,
    and the chief's view of the ps statistics.
    """
    results: dict[str, Any] = {"local_steps": {}, "errors": []}
    lock = threading.Lock()

    def work(task: int) -> None:
        try:
            backend = NumpyBackend()
            model = backend.build_model(spec, init_weights(spec, seed))
            with psdk.connect(
                cluster,
                task,
                steps=steps,
                sync=sync,
                replicas_to_aggregate=replicas,
                sharding=sharding,
                partitioning=partitioning,
                options=FAST,
                transport=transport,
            ) as session:
                optimizer = psdk.DistributedOptimizer(rule, model, session, backend=backend)
                optimizer.broadcast_parameters(resume if task == 0 else None)
                step = 0
                saved = False
                while not session.should_stop():
                    forward_backward(model, *batch_of(task, session.global_step if by_global_step else step))
                    optimizer.step()
                    step += 1
                    if task == 0 and checkpoint_at is not None and not saved and session.global_step >= checkpoint_at:
                        assert checkpoint_dir is not None
                        results["checkpoint"] = session.save_checkpoint(checkpoint_dir)
                        saved = True
                session.finish({"local_steps": step}, wait_s=30)
                with lock:
                    results["local_steps"][task] = step
                if session.is_chief:
                    optimizer.pull()
                    results["params"] = {k: v.copy() for k, v in session.client.params.items()}
                    results["stats"] = session.client.stats()
        except BaseException as exc:  # surfaced by the caller
            with lock:
                results["errors"].append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(cluster.num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if results["errors"]:
        raise results["errors"][0]
    return results
