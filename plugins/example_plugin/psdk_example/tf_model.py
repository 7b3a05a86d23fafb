"""``resmlp`` on the TensorFlow backend: a Keras functional model whose layers carry the canonical names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from psdk_example.resmlp import ResMlpSpec


def build(backend: Any, spec: ResMlpSpec, weights: Mapping[str, np.ndarray]) -> Any:
    """A Keras model named so its variables are ``stem/kernel`` ... ``logits/bias``, holding ``weights``."""
    inputs = keras.Input((spec.input_dim,))
    h = keras.layers.Dense(spec.width, activation="relu", name="stem")(inputs)
    for i in range(spec.blocks):
        h = keras.layers.Add()([h, keras.layers.Dense(spec.width, activation="relu", name=f"block{i + 1}")(h)])
    logits = keras.layers.Dense(spec.num_classes, name="logits")(h)
    model = keras.Model(inputs, logits, name="resmlp")
    backend.write_weights(model, weights)
    return model
