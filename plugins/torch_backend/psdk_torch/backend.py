"""The PyTorch backend: torch's bridge to the ps. This module imports torch; psdk loads it only when a job uses it.

It moves variables, weights and gradients and knows no loss or metric: those
are a workload's, written on this bridge as a trainer (MNIST's is
:class:`psdk_torch.mnist.TorchClassifier`). Thin on purpose; what lives where:

* :mod:`psdk_torch.models`: psdk's network (canonical by construction) and the
  view of any ``nn.Module``'s parameters, shared with psdk's buffers on the CPU;
* :mod:`psdk_torch.tables`: ``sparse=True`` embeddings as tables, rows in and row gradients out;
* :mod:`psdk_torch.optimizers`: ``torch.optim`` optimizers to and from ps rules;
* :mod:`psdk_torch.placement`: psdk's device string to torch's device and threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable
from psdk.rules import UpdateRule
from psdk_torch import models, optimizers, placement, tables


class TorchBackend(Backend):
    def __init__(self) -> None:
        self.torch_devices = [torch.device("cpu")]
        """torch's device for each tower (one without towers)."""

    @property
    def torch_device(self) -> torch.device:
        """The device the calling thread works on: its tower's (:meth:`~psdk.plugins.backend.Backend.tower`)."""
        return self.torch_devices[self.tower_index]

    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        self.torch_devices = [placement.setup(device, threads, gpu_memory_fraction)]
        self.device = str(self.torch_devices[0])

    def setup_towers(
        self, devices: Sequence[str], threads: int | None = None, gpu_memory_fraction: float | None = None
    ) -> None:
        """A replica per device: ``cuda:N`` each on its GPU, ``cpu:K`` all on torch's CPU (each its own tensors)."""
        chosen = placement.setup_towers(devices, threads, gpu_memory_fraction)
        self.torch_devices = [device for _, device in chosen]
        self.tower_devices = [name for name, _ in chosen]
        self.device = self.tower_devices[0]

    @torch.no_grad()
    def reduce_gradients(
        self, replicas: Sequence[nn.Module], shares: Sequence[float], out: Mapping[str, np.ndarray]
    ) -> None:
        """The share-weighted sum on the first tower's device, into its ``.grad`` (psdk's buffer when shared),
        then one copy to ``out``: the other towers' gradients cross to the first device, not to the host."""
        first = models.parameters(replicas[0])
        others = [(models.parameters(m).named, s) for m, s in zip(replicas[1:], shares[1:], strict=True)]
        for i, (_, p) in enumerate(first.named):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(shares[0])
            for named, share in others:
                grad = named[i][1].grad
                if share and grad is not None:
                    p.grad.add_(grad.to(p.grad.device, non_blocking=True), alpha=share)
        first.read_gradients(out)

    # ---------------------------------------------------------------- model
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> nn.Module:
        return models.build(spec, weights, self.torch_device)

    def variables(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        return models.parameters(model).variables()

    def variable_records(self, model: nn.Module) -> dict[str, Variable]:
        """The dense parameters, and each ``sparse=True`` embedding as a table of rows (named by its module)."""
        return models.parameters(model).records()

    def write_rows(self, model: nn.Module, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        tables.write_rows(self._table(model, table), ids, rows)

    def read_row_gradients(self, model: nn.Module, table: str) -> tuple[np.ndarray, np.ndarray]:
        return tables.read_row_gradients(self._table(model, table))

    def _table(self, model: nn.Module, name: str) -> tables.Table:
        found = models.parameters(model).tables
        if name not in found:
            raise ConfigError(
                "model", f"no embedding table {name!r} in this model (its sparse=True embeddings: {sorted(found)})"
            )
        return found[name]

    def read_weights(self, model: nn.Module) -> dict[str, np.ndarray]:
        return models.parameters(model).read()

    def write_weights(self, model: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
        models.parameters(model).write(weights)

    def read_gradients(self, model: nn.Module, out: Mapping[str, np.ndarray]) -> None:
        models.parameters(model).read_gradients(out)

    def share_buffers(
        self, model: nn.Module, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]
    ) -> bool:
        """On the CPU, point every dense parameter and its gradient at psdk's buffers (no copies per step).

        A table's weight is left as the model made it: psdk holds no buffer of a whole table.
        """
        return models.parameters(model).share(params, grads)

    # ------------------------------------------------------------ optimizer
    def make_optimizer(self, model: nn.Module, rule: UpdateRule) -> torch.optim.Optimizer:
        return optimizers.make_optimizer([p for _, p in models.parameters(model).named], rule)

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        return optimizers.optimizer_rule(optimizer)
