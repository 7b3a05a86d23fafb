"""Fixtures of the TensorFlow plugin's tests, which run in a pytest process of their own (never with torch).

Nothing here knows where this folder is: MNIST comes from psdk's pytest
plugin (``psdk_mnist_dir``, from ``$PSDK_DATA_DIR``) and a ps to train against
from ``psdk_ps``, so the folder's tests pass wherever it is copied once psdk
is installed.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from psdk_tf.backend import TfBackend

from psdk import plugins
from psdk.plugins.models import ModelSpec
from psdk.testing.conformance import random_batch

SPEC = ModelSpec(name="small", hidden=(32, 16), input_dim=50, num_classes=10)


def batch(size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return random_batch(SPEC, size, seed)


def zeros() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}


def keras_mlp(name: str = "net") -> keras.Model:
    """psdk's MLP written as a Keras user would, with the layers named as psdk names them."""
    model = keras.Sequential(
        [
            keras.layers.Dense(32, activation="relu", name="hidden1"),
            keras.layers.Dense(16, activation="relu", name="hidden2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name=name,
    )
    model.build((None, 50))
    return model


@pytest.fixture
def backend() -> TfBackend:
    """The tf backend as a job gets it (record and options attached), not set up."""
    made = plugins.load_backend("tf")
    assert isinstance(made, TfBackend)
    return made
