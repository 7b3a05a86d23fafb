"""The ``regressor`` model's spec: dense ReLU layers ending in linear outputs, in numpy, for every backend.

psdk's own dense stack (:class:`psdk.ModelSpec`) is a classifier (two
classes at least); a regression predicts numbers, so this workload brings
its own spec through ``psdk_register_models``, with a builder per backend
(``regression_<framework>.py``). Its variables have the canonical names and
layouts (``hidden1/kernel`` (in, out), ``hidden1/bias``, ...,
``output/bias``), so workers of every framework train it on one ps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from psdk import init_weights
from psdk.errors import ConfigError


@dataclass(frozen=True)
class RegressorSpec:
    """Fields are the job's ``model.*`` keys (``model=regressor model.hidden=[128,128] model.input_dim=8``)."""

    name: str = "regressor"
    hidden: tuple[int, ...] = field(default=(64, 64))  # a tuple: the config's schema reads the type
    input_dim: int = 8
    outputs: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        if any(h < 1 for h in self.hidden) or self.input_dim < 1 or self.outputs < 1:
            raise ConfigError("model", f"the regressor's layer sizes must be positive: {self}")

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each dense layer, input to output."""
        sizes = [self.input_dim, *self.hidden, self.outputs]
        names = [f"hidden{i + 1}" for i in range(len(self.hidden))] + ["output"]
        return [(names[i], sizes[i], sizes[i + 1]) for i in range(len(names))]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Glorot-uniform kernels and zero biases, drawn in numpy so every backend starts alike."""
        return init_weights(self, seed)

    def forward(self, weights: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The outputs [n, outputs] in numpy: the reference the frameworks' models are tested against."""
        h = x
        layers = self.layers()
        for i, (name, _, _) in enumerate(layers):
            h = h @ weights[f"{name}/kernel"] + weights[f"{name}/bias"]
            if i < len(layers) - 1:
                h = np.maximum(h, 0.0)
        return h
