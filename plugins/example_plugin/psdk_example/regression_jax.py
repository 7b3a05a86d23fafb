"""The ``sines`` workload on JAX: the regressor as psdk-jax's params holder, the mean squared error by ``jax.grad``.

psdk-jax's :class:`~psdk_jax.models.DenseStack` holds the canonical params
dict (dense layers, ReLU between them, the last one linear: the regressor
as it is) and is what the jax backend reads and writes. The trainer takes
its ``params``, computes the loss and gradients in one compiled function
and hands the gradients over with ``psdk_jax.record_gradients``, as a
training script does. This module imports JAX; psdk imports it only when a
JAX worker trains this workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psdk_jax
from psdk_jax.models import DenseStack

from psdk import Batch, Trainer
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import INPUTS


def build(backend: Any, spec: RegressorSpec, weights: Mapping[str, np.ndarray]) -> DenseStack:
    """The regressor on the backend's device: a DenseStack of its layers (typed for psdk's ModelSpec)."""
    stack: Any = spec  # DenseStack takes any spec with layers() and variables(); it is typed for ModelSpec
    return DenseStack(
        stack, weights, backend.device_handle(), jit=bool(backend.option("jit")), precision=backend.precision()
    )


def outputs(params: Mapping[str, Any], x: Any, layers: tuple[str, ...], precision: str | None) -> Any:
    """The regressor's one output per row of ``x``: dense layers, ReLU between them, the last linear."""
    for i, name in enumerate(layers):
        x = jnp.matmul(x, params[f"{name}/kernel"], precision=precision) + params[f"{name}/bias"]
        if i < len(layers) - 1:
            x = jax.nn.relu(x)
    return x[:, 0]


@partial(jax.jit, static_argnames=("layers", "precision"))
def loss_and_gradients(params: Any, x: Any, y: Any, layers: tuple[str, ...], precision: str | None) -> Any:
    """The mean squared error and its gradients (a params dict), in one compiled call."""
    return jax.value_and_grad(lambda p: jnp.mean(jnp.square(outputs(p, x, layers, precision) - y)))(params)


predictions = jax.jit(outputs, static_argnames=("layers", "precision"))


class JaxRegressor(Trainer):
    """``sines`` on the jax bridge: a compiled value-and-grad of the mean squared error; predictions float32 [n]."""

    def forward_backward(self, model: DenseStack, batch: Batch) -> float:
        x = jax.device_put(np.asarray(batch.inputs[INPUTS], np.float32), model.device)
        y = jax.device_put(np.asarray(batch.targets, np.float32), model.device)
        loss, grads = loss_and_gradients(model.params, x, y, model.layers, model.precision)
        psdk_jax.record_gradients(model, grads)
        return float(loss)

    def predict(self, model: DenseStack, batch: Batch) -> np.ndarray:
        x = jax.device_put(np.asarray(batch.inputs[INPUTS], np.float32), model.device)
        return np.asarray(predictions(model.params, x, model.layers, model.precision), np.float32)
