"""MNIST's trainer on numpy, and its loss: mean softmax cross-entropy, predictions as logits.

Every framework's MNIST trainer does what this one does (the torch,
TensorFlow and JAX plugins give MNIST theirs through ``psdk_register_trainers``);
this one is the reference the conformance suite holds them to, and what the
core's tests train with, no framework needed.
"""

from __future__ import annotations

import numpy as np

from psdk.plugins.backends.numpy_backend import NumpyModel
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer

IMAGE = "image"
"""The input every MNIST batch holds: images flattened and scaled to [0, 1], float32."""


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of ``logits`` against integer ``labels``, and its gradient at the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = float(np.mean(np.log(total[:, 0]) - shifted[rows, labels]))
    dz = exp / total
    dz[rows, labels] -= 1.0
    dz /= np.float32(len(labels))
    return loss, dz


class NumpyClassifier(Trainer):
    """MNIST on the numpy bridge: cross-entropy forward and backward by hand."""

    def forward_backward(self, model: NumpyModel, batch: Batch) -> float:
        logits, inputs = model.logits(batch.inputs[IMAGE])
        loss, dz = softmax_cross_entropy(logits, batch.targets)
        model.backward(dz, inputs)
        return loss

    def predict(self, model: NumpyModel, batch: Batch) -> np.ndarray:
        return model.logits(batch.inputs[IMAGE])[0]
