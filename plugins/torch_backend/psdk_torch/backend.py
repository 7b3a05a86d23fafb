"""The PyTorch backend. This module imports torch; psdk loads it only when a job uses it.

Thin on purpose; what lives where:

* :mod:`psdk_torch.models`: psdk's network (canonical by construction) and the
  view of any ``nn.Module``'s parameters, shared with psdk's buffers on the CPU;
* :mod:`psdk_torch.optimizers`: ``torch.optim`` optimizers to and from ps rules;
* :mod:`psdk_torch.placement`: psdk's device string to torch's device and threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.plugins.backend import Backend
from psdk.plugins.backends import kit
from psdk.plugins.models import ModelSpec
from psdk.rules import UpdateRule
from psdk_torch import models, optimizers, placement


class TorchBackend(Backend):
    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")

    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        self.torch_device = placement.setup(device, threads, gpu_memory_fraction)
        self.device = str(self.torch_device)

    # ---------------------------------------------------------------- model
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> nn.Module:
        return models.build(spec, weights, self.torch_device)

    def variables(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        return models.parameters(model).variables()

    def read_weights(self, model: nn.Module) -> dict[str, np.ndarray]:
        return models.parameters(model).read()

    def write_weights(self, model: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
        models.parameters(model).write(weights)

    def read_gradients(self, model: nn.Module, out: Mapping[str, np.ndarray]) -> None:
        models.parameters(model).read_gradients(out)

    def share_buffers(
        self, model: nn.Module, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]
    ) -> bool:
        """On the CPU, point every parameter and its gradient at psdk's buffers (no copies per step)."""
        return models.parameters(model).share(params, grads)

    def forward_backward(self, model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
        xt = torch.from_numpy(x).to(self.torch_device, non_blocking=True)
        yt = torch.from_numpy(y).to(self.torch_device, non_blocking=True)
        model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        return float(loss.item())

    @torch.no_grad()
    def accuracy(self, model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
        def predict(batch: np.ndarray) -> np.ndarray:
            return model(torch.from_numpy(batch).to(self.torch_device)).argmax(dim=1).cpu().numpy()

        return kit.batched_accuracy(predict, x, y)

    # ------------------------------------------------------------ optimizer
    def make_optimizer(self, model: nn.Module, rule: UpdateRule) -> torch.optim.Optimizer:
        return optimizers.make_optimizer([p for _, p in models.parameters(model).named], rule)

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        return optimizers.optimizer_rule(optimizer)
