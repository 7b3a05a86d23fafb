"""Model specs every backend builds the same way, and their framework-neutral initial weights.

A backend turns a :class:`ModelSpec` into its own framework's model, but the
initial weights come from :func:`init_weights` in numpy, so the same seed
starts a torch worker, a TensorFlow worker and the numpy reference from the
same point. Variable names and layouts are canonical: ``<layer>/kernel`` of
shape (in, out) and ``<layer>/bias`` of shape (out,).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from psdk.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """A stack of dense layers (ReLU between them) ending in softmax logits.

    ``hidden=()`` is softmax regression (784-10); ``hidden=(100,)`` the MLP
    of the classic distributed MNIST examples (784-100-10).
    """

    name: str = "mlp"
    hidden: Sequence[int] = field(default=(100,))
    input_dim: int = 784
    num_classes: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        if any(h < 1 for h in self.hidden) or self.input_dim < 1 or self.num_classes < 2:
            raise ConfigError("model", f"layer sizes must be positive: {self}")

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each dense layer, input to output."""
        sizes = [self.input_dim, *self.hidden, self.num_classes]
        names = [f"hidden{i + 1}" for i in range(len(self.hidden))] + ["logits"]
        return [(names[i], sizes[i], sizes[i + 1]) for i in range(len(names))]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        """Canonical (name, shape) of every variable, in creation order."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.variables())


def init_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """Glorot-uniform kernels and zero biases (Keras' defaults), from ``seed``."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, fan_in, fan_out in spec.layers():
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        weights[f"{name}/kernel"] = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)
        weights[f"{name}/bias"] = np.zeros(fan_out, np.float32)
    return weights
