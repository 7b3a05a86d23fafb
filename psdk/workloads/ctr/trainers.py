"""The CTR workload's trainer on numpy: DLRM's forward and backward by hand, the reference for every framework.

The loss is the mean binary cross-entropy of the logits; predictions are the
logits, float32 [B]. The model is a :class:`~psdk.plugins.backends.numpy_tables.NumpyTableModel`:
its rows are the ones the loop pulled for the batch (``write_rows``), and the
backward pass leaves one row gradient per (example, field), which psdk sums
per id before it pushes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from psdk.plugins.backends.numpy_tables import NumpyTableModel
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.workloads.ctr.data import CAT_INPUT, DENSE_INPUT, TABLE
from psdk.workloads.ctr.model import DlrmSpec, backward, forward


def bce_with_logits(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean binary cross-entropy of ``logits`` against 0/1 ``labels``, and its gradient at the logits."""
    z = logits.astype(np.float64)
    loss = float(np.mean(np.maximum(z, 0) - z * labels + np.log1p(np.exp(-np.abs(z)))))
    grad = (1.0 / (1.0 + np.exp(-z)) - labels) / max(1, len(labels))
    return loss, grad.astype(np.float32)


class NumpyDlrm(Trainer):
    """DLRM on the numpy bridge."""

    def build_model(self, spec: DlrmSpec, weights: Mapping[str, np.ndarray]) -> NumpyTableModel:
        model = NumpyTableModel(weights, spec.tables())
        model.spec = spec  # type: ignore[attr-defined]
        return model

    def forward_backward(self, model: NumpyTableModel, batch: Batch) -> float:
        model.zero_grad()
        cat = batch.inputs[CAT_INPUT]
        fwd = forward(model.spec, model.params, batch.inputs[DENSE_INPUT], model.lookup(TABLE, cat))  # type: ignore[attr-defined]
        loss, d_logits = bce_with_logits(fwd.logits, np.asarray(batch.targets, np.float64))
        d_rows = backward(model.spec, model.params, model.grads, fwd, d_logits)  # type: ignore[attr-defined]
        model.backward_rows(TABLE, cat.reshape(-1), d_rows.reshape(-1, d_rows.shape[-1]))
        return loss

    def predict(self, model: NumpyTableModel, batch: Batch) -> np.ndarray:
        cat = batch.inputs[CAT_INPUT]
        fwd = forward(model.spec, model.params, batch.inputs[DENSE_INPUT], model.lookup(TABLE, cat))  # type: ignore[attr-defined]
        return fwd.logits.astype(np.float32)
