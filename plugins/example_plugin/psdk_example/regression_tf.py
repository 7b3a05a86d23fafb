"""The ``sines`` workload on TensorFlow: the regressor as a Keras model, the mean squared error by a tape.

The tf backend keeps no gradients on variables, so the trainer hands them
over with ``psdk_tf.record_gradients``, as a training script does. Each
model's step is one ``tf.function``, traced once for a free batch size. This
module imports TensorFlow; psdk imports it only when a TensorFlow worker
trains this workload.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np
import psdk_tf
import tensorflow as tf

from psdk import Batch, Trainer
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import INPUTS


def build(backend: Any, spec: RegressorSpec, weights: Mapping[str, np.ndarray]) -> Any:
    """A Keras model whose variables are ``hidden1/kernel`` ... ``output/bias``, holding ``weights``."""
    inputs = keras.Input((spec.input_dim,))
    layers = spec.layers()
    h = inputs
    for i, (name, _, fan_out) in enumerate(layers):
        h = keras.layers.Dense(fan_out, activation="relu" if i < len(layers) - 1 else None, name=name)(h)
    model = keras.Model(inputs, h, name="regressor")
    backend.write_weights(model, weights)
    return model


class TfRegressor(Trainer):
    """``sines`` on the tf bridge: a taped mean squared error, gradients recorded; predictions float32 [n]."""

    def __init__(self, bridge: Any, options: Mapping[str, Any] | None = None):
        super().__init__(bridge, options)
        self._compiled: weakref.WeakKeyDictionary[Any, tuple[Callable[..., Any], Callable[..., Any]]] = (
            weakref.WeakKeyDictionary()
        )

    def _steps(self, model: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``model``'s training step and prediction, traced once each (any batch size)."""
        steps = self._compiled.get(model)
        if steps is None:
            dim = int(model.inputs[0].shape[-1])
            x_spec, y_spec = tf.TensorSpec([None, dim], tf.float32), tf.TensorSpec([None], tf.float32)

            def gradients(x: Any, y: Any) -> tuple[Any, Any]:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True)[:, 0] - y))
                return loss, tape.gradient(loss, model.trainable_variables)

            def outputs(x: Any) -> Any:
                return model(x, training=False)[:, 0]

            steps = (
                tf.function(gradients, input_signature=[x_spec, y_spec]),
                tf.function(outputs, input_signature=[x_spec]),
            )
            self._compiled[model] = steps
        return steps

    def forward_backward(self, model: Any, batch: Batch) -> float:
        step, _ = self._steps(model)
        x = tf.convert_to_tensor(np.asarray(batch.inputs[INPUTS], np.float32))
        y = tf.convert_to_tensor(np.asarray(batch.targets, np.float32))
        loss, grads = step(x, y)
        psdk_tf.record_gradients(model, grads)
        return float(loss.numpy())

    def predict(self, model: Any, batch: Batch) -> np.ndarray:
        _, outputs = self._steps(model)
        return np.asarray(outputs(tf.convert_to_tensor(np.asarray(batch.inputs[INPUTS], np.float32))), np.float32)
