"""The ``sines`` workload on psdk's numpy backend: the reference its other trainers are held to.

The numpy backend (framework ``psdk``) builds any dense stack with ReLU
between its layers; this adds the mean squared error, forward and backward
by hand. It needs no framework, so the workload's tests train with it fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psdk import Batch, Trainer
from psdk.plugins.backends.numpy_backend import NumpyModel
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import INPUTS


def build(backend: Any, spec: RegressorSpec, weights: Mapping[str, np.ndarray]) -> NumpyModel:
    """The regressor as the numpy backend's model: its layers, ReLU between them, the last one linear."""
    return NumpyModel(spec, weights)  # type: ignore[arg-type]  # any spec with layers() and variables()


def squared_error(outputs: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean squared error of ``outputs`` [n, 1] against ``targets`` [n], and its gradient at the outputs."""
    residuals = outputs[:, 0] - targets
    loss = float(np.mean(np.square(residuals, dtype=np.float64)))
    return loss, (residuals * np.float32(2.0 / len(targets)))[:, None].astype(np.float32)


class NumpyRegressor(Trainer):
    """``sines`` on the numpy bridge: the mean squared error and its gradients by hand."""

    def forward_backward(self, model: NumpyModel, batch: Batch) -> float:
        outputs, inputs = model.logits(batch.inputs[INPUTS])
        loss, d_outputs = squared_error(outputs, batch.targets)
        model.backward(d_outputs, inputs)
        return loss

    def predict(self, model: NumpyModel, batch: Batch) -> np.ndarray:
        return np.asarray(model.logits(batch.inputs[INPUTS])[0][:, 0], np.float32)
