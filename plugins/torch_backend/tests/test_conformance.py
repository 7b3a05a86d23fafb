"""psdk's conformance suites, run against the torch bridge and psdk's MNIST and ctr trainers on torch."""

from __future__ import annotations

from typing import Any

import torch

from psdk.testing import BridgeConformance, TrainerConformance


class TestTorchBridgeConformance(BridgeConformance):
    backend_name = "torch"

    def refused_optimizers(self, model: Any) -> dict[str, Any]:
        params = list(model.parameters())
        return {
            "dampening": torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5),
            "maximize": torch.optim.SGD(params, lr=0.1, maximize=True),
            "amsgrad": torch.optim.Adam(params, amsgrad=True),
            # Adam(decoupled_weight_decay=True) is AdamW; the ps's weight_decay is L2 on the gradient.
            "decoupled_weight_decay": torch.optim.Adam(params, weight_decay=0.01, decoupled_weight_decay=True),
            "lr_decay": torch.optim.Adagrad(params, lr_decay=0.01),
            "torch.optim.AdamW": torch.optim.AdamW(params),
            "torch.optim.Adadelta": torch.optim.Adadelta(params),
        }


class TestTorchMnistTrainerConformance(TrainerConformance):
    backend_name = "torch"


class TestTorchCtrTrainerConformance(TrainerConformance):
    """The ctr trainer through a worker's path: rows written before each batch, row gradients summed per id."""

    backend_name = "torch"
    workload = "ctr"
