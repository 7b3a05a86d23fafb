"""The ``resmlp`` model's spec: its canonical variables and initial weights, in numpy, for every backend.

A ReLU stem, ``blocks`` residual blocks ``h = h + relu(h @ W + b)``, and
softmax logits. Every backend's builder makes this network with these names,
in this order and layout (kernels (in, out)), so a torch worker, a
TensorFlow worker and a JAX worker train one model on one ps and a
checkpoint of one resumes on the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from psdk.errors import ConfigError


@dataclass(frozen=True)
class ResMlpSpec:
    """Fields are the job's ``model.*`` keys (``model=resmlp model.width=256 model.blocks=2``)."""

    name: str = "resmlp"
    width: int = 128
    blocks: int = 1
    input_dim: int = 784
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.width < 1 or self.blocks < 0 or self.input_dim < 1 or self.num_classes < 2:
            raise ConfigError("model", f"resmlp needs width >= 1, blocks >= 0 and positive sizes: {self}")

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each dense layer, input to output."""
        blocks = [(f"block{i + 1}", self.width, self.width) for i in range(self.blocks)]
        return [("stem", self.input_dim, self.width), *blocks, ("logits", self.width, self.num_classes)]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Glorot-uniform kernels (a residual block's scaled down, so the blocks start near identity)."""
        rng = np.random.default_rng(seed)
        weights: dict[str, np.ndarray] = {}
        for name, fan_in, fan_out in self.layers():
            limit = np.sqrt(6.0 / (fan_in + fan_out)) * (0.5 if name.startswith("block") else 1.0)
            weights[f"{name}/kernel"] = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)
            weights[f"{name}/bias"] = np.zeros(fan_out, np.float32)
        return weights

    def forward(self, weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The logits in numpy: the reference the builders are tested against."""
        h = np.maximum(x @ weights["stem/kernel"] + weights["stem/bias"], 0.0)
        for i in range(self.blocks):
            h = h + np.maximum(h @ weights[f"block{i + 1}/kernel"] + weights[f"block{i + 1}/bias"], 0.0)
        return h @ weights["logits/kernel"] + weights["logits/bias"]
