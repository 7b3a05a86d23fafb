"""The ``sines`` workload on torch: the regressor as an ``nn.Module``, the mean squared error by autograd.

Built from the torch plugin's ``Dense`` layer, which stores its kernel (in,
out) as the ps does. This module imports torch; psdk imports it only when a
torch worker trains this workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from psdk_torch.models import Dense  # the torch plugin's (in, out) dense layer: canonical by construction
from torch import nn

from psdk import Batch, Trainer
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import INPUTS


class Regressor(nn.Module):
    def __init__(self, spec: RegressorSpec):
        super().__init__()
        self.names = [name for name, _, _ in spec.layers()]
        for name, fan_in, fan_out in spec.layers():  # registered in the spec's order: named_parameters follows
            self.add_module(name, Dense(fan_in, fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.names[:-1]:
            x = F.relu(getattr(self, name)(x))
        out: torch.Tensor = getattr(self, self.names[-1])(x)
        return out


def build(backend: Any, spec: RegressorSpec, weights: Mapping[str, np.ndarray]) -> Regressor:
    """The model on the backend's device, holding ``weights`` (written by the backend, as for its own models)."""
    model = Regressor(spec).to(backend.device)
    backend.write_weights(model, weights)
    return model


class TorchRegressor(Trainer):
    """``sines`` on the torch bridge: ``F.mse_loss`` and ``backward()``; predictions as float32 numpy [n]."""

    def _device(self) -> Any:
        return getattr(self.bridge, "torch_device", self.bridge.device)

    def forward_backward(self, model: nn.Module, batch: Batch) -> float:
        """The mean squared error, its gradients in zeroed ``.grad`` tensors.

        Zeroed in place (not set to None), so that where the bridge shares
        psdk's buffers the backward pass writes straight into what is pushed.
        """
        device = self._device()
        x = torch.from_numpy(np.asarray(batch.inputs[INPUTS], np.float32)).to(device, non_blocking=True)
        y = torch.from_numpy(np.asarray(batch.targets, np.float32)).to(device, non_blocking=True)
        model.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x)[:, 0], y)
        loss.backward()
        return float(loss.item())

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> np.ndarray:
        x = torch.from_numpy(np.asarray(batch.inputs[INPUTS], np.float32)).to(self._device())
        return model(x)[:, 0].to(torch.float32).cpu().numpy()
