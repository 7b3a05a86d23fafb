"""``python -m psdk evaluate weights=PATH``: test accuracy of saved parameters on any backend.

The weights are canonical (names and layouts), so parameters trained by one
framework can be checked by another; the launcher of a mixed-framework job
runs this once for every backend the chief does not use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from psdk.client import checkpoint
from psdk.config import build
from psdk.config.options import options_from
from psdk.data import mnist
from psdk.errors import ConfigError
from psdk.plugins.loading import load_backend
from psdk.plugins.models import build_model
from psdk.report.metrics import write_json_atomic
from psdk.workloads.mnist.checks import load_fitting

log = logging.getLogger(__name__)


def run_evaluate(cfg: DictConfig) -> dict[str, Any]:
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
    data = load_fitting(cfg.data, spec)
    model = build_model(backend, spec, weights)
    accuracy = backend.accuracy(model, mnist.to_float(data.test_x), data.test_y)
    result = {"weights": str(cfg.weights), "backend": backend.name, "model": spec.name, "test_accuracy": accuracy}
    write_json_atomic(Path(cfg.output_dir) / "evaluation.json", result)
    print(f"test accuracy {accuracy:.4f} (backend {backend.name}, {len(data.test_y)} images, {cfg.weights})")
    return result
