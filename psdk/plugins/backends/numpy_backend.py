"""The numpy reference backend: the dense stacks by hand, forward and backward.

It serves the core's tests (no framework needed) and shows the bridge
contract at its plainest; the loss is a workload's trainer's (MNIST's numpy
trainer is :mod:`psdk.workloads.mnist.trainers`). Its "framework optimizer" is a psdk update rule
(:mod:`psdk.ps.rules`), which is also what the ps runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.backends.numpy_tables import NumpyTableModel
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk.protocol.sharding import flat_size, layout, views
from psdk.ps.rules import UpdateRule


class NumpyModel:
    """Weights and gradients as named views of two flat float32 buffers."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]):
        self.spec = spec
        self.specs = layout(spec.variables())
        self.flat = np.zeros(flat_size(self.specs), np.float32)
        self.grad_flat = np.zeros_like(self.flat)
        self.params = views(self.flat, self.specs)
        self.grads = views(self.grad_flat, self.specs)
        for name, view in self.params.items():
            view[...] = weights[name]

    def logits(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Output logits and every layer's input (kept for the backward pass)."""
        inputs = []
        h = x
        layers = self.spec.layers()
        for i, (name, _, _) in enumerate(layers):
            inputs.append(h)
            h = h @ self.params[f"{name}/kernel"] + self.params[f"{name}/bias"]
            if i < len(layers) - 1:
                h = np.maximum(h, 0.0)
        return h, inputs

    def backward(self, dz: np.ndarray, inputs: list[np.ndarray]) -> None:
        """Gradients of every variable, given the loss's gradient ``dz`` at the logits and :meth:`logits`'s inputs."""
        layers = self.spec.layers()
        for i in range(len(layers) - 1, -1, -1):
            name = layers[i][0]
            h = inputs[i]
            np.matmul(h.T, dz, out=self.grads[f"{name}/kernel"])
            np.sum(dz, axis=0, out=self.grads[f"{name}/bias"])
            if i:
                dz = (dz @ self.params[f"{name}/kernel"].T) * (h > 0)


class NumpyBackend(Backend):
    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        self.device = "cpu"  # numpy has no GPU: soft placement

    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> NumpyModel:
        return NumpyModel(spec, weights)

    def make_optimizer(self, model: Any, rule: UpdateRule) -> UpdateRule:
        return rule

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        if not isinstance(optimizer, UpdateRule):
            raise ConfigError("optimizer", f"the numpy backend takes a psdk.ps.rules rule, not {optimizer!r}")
        return optimizer

    def variables(self, model: NumpyModel | NumpyTableModel) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for s in model.specs}

    def variable_records(self, model: NumpyModel | NumpyTableModel) -> dict[str, Variable]:
        return {**as_variables(self.variables(model)), **getattr(model, "tables", {})}

    def write_rows(self, model: NumpyTableModel, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        model.rows[table][ids] = rows

    def read_row_gradients(self, model: NumpyTableModel, table: str) -> tuple[np.ndarray, np.ndarray]:
        empty = (np.zeros(0, np.int64), np.zeros((0, model.tables[table].dim), np.float32))
        return model.row_grads.get(table, empty)

    def read_weights(self, model: NumpyModel) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in model.params.items()}

    def write_weights(self, model: NumpyModel, weights: Mapping[str, np.ndarray]) -> None:
        for name, value in weights.items():
            np.copyto(model.params[name], value)

    def read_gradients(self, model: NumpyModel, out: Mapping[str, np.ndarray]) -> None:
        for name, view in out.items():
            np.copyto(view, model.grads[name])
