"""``python -m psdk evaluate weights=PATH``: the workload's test metrics of saved parameters, on any backend.

The weights are canonical (names and layouts), so parameters trained by one
framework can be scored by another; the launcher of a mixed-framework job
runs this once for every backend the chief does not use. The workload's
trainer for the backend's framework predicts, and the workload scores, as
its training loop does (:mod:`psdk.jobs.worker`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.client import checkpoint
from psdk.config import build
from psdk.config.options import options_from
from psdk.errors import ConfigError
from psdk.jobs.summary import test_fields
from psdk.jobs.workload import Workload, workload_options
from psdk.plugins.backend import Backend
from psdk.plugins.batches import ShardRequest
from psdk.plugins.loading import load_backend, workload_of
from psdk.plugins.variables import tables_of
from psdk.report.metrics import write_json_atomic

log = logging.getLogger(__name__)


def load_rows(backend: Backend, model: Any, weights: str) -> None:
    """A model with embedding tables takes the checkpoint's rows, a chunk at a time; an id no batch
    trained on keeps zeros, as a training job's evaluation reads it (docs/ctr.md)."""
    tables = tables_of(backend.variable_records(model))
    if not tables:
        return
    path = Path(weights).expanduser()
    state = None if path.suffix == ".npz" and path.name == "params.npz" else checkpoint.load(path)
    if state is None or state.tables is None:
        raise ConfigError(
            "weights",
            f"{weights} holds no embedding tables, and the model has {sorted(tables)}: evaluate a checkpoint "
            "(weights=<run folder>/checkpoints)",
        )
    for name in tables:
        if name not in state.tables.names:
            raise ConfigError("weights", f"{weights} holds no table {name!r} (its tables: {state.tables.names})")
        for _, chunk in state.tables.rows(name):
            backend.write_rows(model, name, chunk["ids"], chunk["rows"])


def run_evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score ``cfg.weights`` with ``cfg.backend``; writes ``evaluation.json`` and prints one line."""
    if not cfg.weights:
        raise ConfigError("weights", "evaluate needs weights=<params.npz or checkpoint>")
    weights = checkpoint.load_weights(cfg.weights)
    spec = build.model_spec(cfg)
    expected = dict(spec.variables())
    shapes = {n: tuple(v.shape) for n, v in weights.items()}
    if shapes != expected:
        raise ConfigError("model", f"{cfg.weights} holds {shapes}, not the variables of model={spec.name}")
    backend = load_backend(str(cfg.backend), build.backend_options(cfg, str(cfg.backend)))
    options = options_from(cfg)
    backend.setup("cpu", options.train.threads, options.placement.gpu_memory_fraction)
    record = workload_of(cfg)
    options_of_workload = workload_options(cfg)
    workload = Workload(record, backend, options_of_workload)
    request = ShardRequest(0, 1, cfg.data, spec, options_of_workload, int(cfg.get("seed") or 0))
    test = workload.shard(request).test  # every worker's test set is the same: asked for as the only worker
    model = workload.trainer.build_model(spec, weights)
    load_rows(backend, model, cfg.weights)
    metrics = workload.score(model, test)
    head = workload.primary.name if workload.primary is not None else None
    result: dict[str, Any] = {
        "weights": str(cfg.weights),
        "backend": backend.name,
        "model": spec.name,
        "workload": record.name,
        "metrics": metrics,
        "primary_metric": head,
        **test_fields(metrics),
    }
    folder = Path(cfg.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "evaluation.json", result)
    shown = workload.shown("test", metrics)
    print(f"{shown} (backend {backend.name}, {len(test)} examples, {cfg.weights})")
    return result
