"""MNIST's trainer on JAX: mean softmax cross-entropy through the model's compiled step, logits as predictions.

The backend (:mod:`psdk_jax.backend`) is the bridge: weights in, gradients
out. This is what MNIST needs of JAX on top of it, registered for the
``mnist`` workload by :func:`psdk_jax.plugin.psdk_register_trainers`. The
loss is handed to the model's :meth:`~psdk_jax.models.DenseStack.value_and_grad`,
which compiles it once per model into one ``jax.jit`` step (the pending
weights loaded, the gradients and the loss back in one transfer) and keeps the
gradients where the backend's ``read_gradients`` reads them. Any model a
builder returns works (psdk's dense stack, a plugin's
:class:`~psdk_jax.models.DenseStack` subclass): the loss is built on its
``apply``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.workloads.mnist.trainers import IMAGE
from psdk_jax.models import DenseStack


def cross_entropy(model: DenseStack, params: Any, x: Any, y: Any) -> Any:
    """Mean softmax cross-entropy of the model's logits for ``x`` against integer labels ``y``."""
    log_probs = jax.nn.log_softmax(model.apply(params, x))
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))


def arrays(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """The batch as the compiled step takes it: float32 images, int32 labels (JAX's default integer)."""
    return np.asarray(batch.inputs[IMAGE], np.float32), np.asarray(batch.targets, np.int32)


class JaxClassifier(Trainer):
    """MNIST on the JAX bridge: one compiled value-and-grad step of the cross-entropy, logits as predictions."""

    def forward_backward(self, model: DenseStack, batch: Batch) -> float:
        return model.value_and_grad(cross_entropy, *arrays(batch))

    def predict(self, model: DenseStack, batch: Batch) -> np.ndarray:
        return model.outputs(np.asarray(batch.inputs[IMAGE], np.float32))
