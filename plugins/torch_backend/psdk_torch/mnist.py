"""MNIST's trainer on torch: mean softmax cross-entropy, predictions as logits.

psdk's MNIST workload names no framework; this plugin gives it a torch
trainer through ``psdk_register_trainers`` (:mod:`psdk_torch.plugin`). It does
what :class:`psdk.workloads.mnist.trainers.NumpyClassifier`, the reference,
does, on the torch bridge (:class:`~psdk_torch.backend.TorchBackend`): the
bridge builds the model, places it and moves its weights and gradients; this
holds the loss and the predictions. This module imports torch; psdk imports
it only when a job trains MNIST on torch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.workloads.mnist.trainers import IMAGE
from psdk_torch.backend import TorchBackend


class TorchClassifier(Trainer):
    """MNIST on torch: ``F.cross_entropy`` forward and ``backward()``, logits as float32 numpy."""

    bridge: TorchBackend
    bridge_class = TorchBackend

    def forward_backward(self, model: nn.Module, batch: Batch) -> float:
        """The mean cross-entropy, its gradients added into zeroed ``.grad`` tensors.

        Zeroing in place (``set_to_none=False``) keeps each ``.grad`` the
        tensor it was, so where the bridge shared psdk's buffers
        (:meth:`TorchBackend.share_buffers`) backward writes straight into
        the gradients that are pushed. The copies to the device do not block
        (a no-op on the CPU); ``dtype=long`` is free for int64 labels.
        """
        device = self.bridge.torch_device
        x = torch.from_numpy(batch.inputs[IMAGE]).to(device, non_blocking=True)
        y = torch.from_numpy(batch.targets).to(device, dtype=torch.long, non_blocking=True)
        model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return float(loss.item())

    @torch.no_grad()
    def predict(self, model: nn.Module, batch: Batch) -> np.ndarray:
        """The logits of ``batch``'s images, float32 [n, classes]; MNIST's score takes their argmax."""
        x = torch.from_numpy(batch.inputs[IMAGE]).to(self.bridge.torch_device)
        return model(x).to(torch.float32).cpu().numpy()
