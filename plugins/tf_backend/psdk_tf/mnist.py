"""MNIST's trainer on TensorFlow: mean softmax cross-entropy, predictions as logits.

What :class:`psdk.workloads.mnist.trainers.NumpyClassifier` does, on the tf
bridge. The loss and the logits are graph code handed to the model's binding
(:mod:`psdk_tf.models`), which compiles each into one ``tf.function`` kept
with the model: on psdk's dense stack a training step stays one call that
assigns the weights the ps last wrote, runs forward and backward, and leaves
the gradients where the backend's ``read_gradients`` reads them. A Keras
model a user brings trains through the same two functions.

This module imports TensorFlow; the plugin registers it by name
(``psdk_tf.mnist:TfClassifier``) and psdk imports it only when a job uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psdk.errors import PsdkError
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.workloads.mnist.trainers import IMAGE
from psdk_tf._tf import tf
from psdk_tf.backend import TfBackend
from psdk_tf.models import DenseStack, ForeignModel, binding


def cross_entropy(call: Callable[[Any], Any], images: Any, labels: Any) -> Any:
    """Mean softmax cross-entropy of the model's logits against integer labels (graph code)."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=call(images)))


def logits(call: Callable[[Any], Any], images: Any) -> Any:
    """The model's logits (graph code): what MNIST's score takes the argmax of."""
    return call(images)


def images(batch: Batch) -> Any:
    """The batch's images as the compiled functions take them: float32, copied only if needed."""
    return tf.convert_to_tensor(np.asarray(batch.inputs[IMAGE], np.float32))


def compiled(model: Any) -> DenseStack | ForeignModel:
    """The binding that compiles this trainer's loss and logits: psdk's network or a Keras model, no other."""
    bound = binding(model)
    if not isinstance(bound, DenseStack | ForeignModel):
        raise PsdkError(f"MNIST's trainer trains psdk's network or a Keras model, not a {type(model).__name__}")
    return bound


class TfClassifier(Trainer):
    """MNIST on the tf bridge: psdk's dense stacks and Keras models alike."""

    bridge: TfBackend
    bridge_class = TfBackend

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> Any:
        """The model, with psdk's network's step and logits traced now, before any step is timed."""
        model = super().build_model(spec, weights)
        if isinstance(model, DenseStack):
            image = tf.TensorSpec([None, model.spec.input_dim], tf.float32)
            model.train_step(cross_entropy, (image, tf.TensorSpec([None], tf.int64)))
            model.infer(logits, (image,))
        return model

    def forward_backward(self, model: Any, batch: Batch) -> float:
        labels = tf.convert_to_tensor(np.asarray(batch.targets, np.int64))
        return compiled(model).train_step(cross_entropy)(images(batch), labels)

    def predict(self, model: Any, batch: Batch) -> np.ndarray:
        return np.asarray(compiled(model).infer(logits)(images(batch)).numpy(), np.float32)
