"""``resmlp`` on the torch backend: an ``nn.Module`` whose parameters carry the canonical names.

Built from the torch plugin's ``Dense`` layer, which stores its kernel (in, out)
as the ps does, so nothing is transposed between this model and the ps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from psdk_torch.models import Dense  # the torch plugin's (in, out) dense layer: canonical by construction
from torch import nn

from psdk_example.resmlp import ResMlpSpec


class ResMlp(nn.Module):
    def __init__(self, spec: ResMlpSpec):
        super().__init__()
        self.blocks = spec.blocks
        for name, fan_in, fan_out in spec.layers():  # registered in the spec's order: named_parameters follows
            self.add_module(name, Dense(fan_in, fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for i in range(self.blocks):
            h = h + F.relu(getattr(self, f"block{i + 1}")(h))
        logits: torch.Tensor = self.logits(h)
        return logits


def build(backend: Any, spec: ResMlpSpec, weights: Mapping[str, np.ndarray]) -> ResMlp:
    """The model on the backend's device, holding ``weights`` (written by the backend, as for its own models)."""
    model = ResMlp(spec).to(backend.device)
    backend.write_weights(model, weights)
    return model
