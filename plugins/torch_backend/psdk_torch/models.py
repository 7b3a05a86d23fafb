"""psdk's dense networks in torch, and the backend's view of any model: its parameters by canonical name.

psdk's own models are built from :class:`Dense` layers whose ``kernel`` is
stored (in, out), so their parameters are in the canonical layout by
construction and need no transposes on the way to or from the ps. Any other
``nn.Module`` (a training script's) works through the public API too: its
variables are its ``named_parameters()`` with ``.`` turned into ``/``, in
torch's own layout (an ``nn.Linear`` weight stays (out, in)), except the
weights of ``sparse=True`` embeddings, which are tables whose rows travel a
batch at a time (:mod:`psdk_torch.tables`).

On the CPU a model's parameters and gradients can live in the ps client's own
buffers (:meth:`Parameters.share`): the backward pass then writes straight
into what is pushed, and pulled weights land straight in the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk_torch.tables import find_tables


class Dense(nn.Module):
    """``x @ kernel + bias`` with the kernel stored (in, out), as the ps keeps it."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(fan_in, fan_out))
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.kernel)


class DenseStack(nn.Module):
    """The :class:`~psdk.plugins.models.ModelSpec` network: dense layers with ReLU between them, logits last."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.layer_names = [name for name, _, _ in spec.layers()]
        for name, fan_in, fan_out in spec.layers():
            self.add_module(name, Dense(fan_in, fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layer_names) - 1
        for i, name in enumerate(self.layer_names):
            x = getattr(self, name)(x)
            if i < last:
                x = F.relu(x)
        return x


def build(spec: ModelSpec, weights: Mapping[str, np.ndarray], device: torch.device) -> DenseStack:
    """``spec``'s network on ``device``, holding (copies of) ``weights``."""
    model = DenseStack(spec).to(device)
    parameters(model).write(weights)
    return model


class Parameters:
    """A model's trainable parameters by canonical name, and which of them alias psdk's buffers.

    Holds the parameters, never the module, so a model a script drops is freed.
    """

    def __init__(self, model: nn.Module):
        self.tables = find_tables(model)
        """The ``sparse=True`` embeddings, by table name: never among the dense parameters below."""
        weights = {id(table.weight) for table in self.tables.values() if table.weight is not None}
        self.named = [
            (name.replace(".", "/"), p)
            for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in weights
        ]
        self.shared: list[tuple[int, torch.Tensor]] | None = None
        """Per parameter, the address of psdk's weight buffer and the gradient tensor over psdk's gradient buffer."""

    def variables(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.named}

    def records(self) -> dict[str, Variable]:
        """The dense parameters and the tables (as :class:`~psdk.plugins.variables.Rows`), by canonical name."""
        return {**as_variables(self.variables()), **{name: table.record for name, table in self.tables.items()}}

    def read(self) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().astype(np.float32, copy=True) for name, p in self.named}

    @torch.no_grad()
    def write(self, weights: Mapping[str, np.ndarray]) -> None:
        for i, (name, p) in enumerate(self.named):
            if self.shared is not None and p.data_ptr() == self.shared[i][0] == weights[name].ctypes.data:
                continue  # the parameter is the very buffer the weights arrived in
            p.copy_(torch.as_tensor(np.asarray(weights[name])), non_blocking=False)

    @torch.no_grad()
    def read_gradients(self, out: Mapping[str, np.ndarray]) -> None:
        for i, (name, p) in enumerate(self.named):
            if self.shared is not None and p.grad is self.shared[i][1]:
                continue  # backward wrote straight into the buffer that is sent
            if p.grad is None:
                out[name].fill(0.0)
            else:
                np.copyto(out[name], p.grad.detach().cpu().numpy())
                if self.shared is not None:
                    p.grad = self.shared[i][1]  # alias again (a zero_grad(set_to_none=True) had replaced it)

    @torch.no_grad()
    def share(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> bool:
        """Point every parameter and its gradient at psdk's buffers; False (nothing changed) off the CPU."""
        if any(
            p.device.type != "cpu"
            or p.dtype != torch.float32
            or tuple(p.shape) != params[name].shape
            or not params[name].flags.writeable
            for name, p in self.named
        ):
            return False
        shared = []
        for name, p in self.named:
            p.data = torch.from_numpy(params[name])
            p.grad = torch.from_numpy(grads[name])
            shared.append((p.data.data_ptr(), p.grad))
        self.shared = shared
        return True


_PARAMETERS: weakref.WeakKeyDictionary[nn.Module, Parameters] = weakref.WeakKeyDictionary()


def parameters(model: nn.Module) -> Parameters:
    """The backend's view of ``model``, made on first use and kept beside it (it dies with the model)."""
    found = _PARAMETERS.get(model)
    if found is None:
        found = _PARAMETERS[model] = Parameters(model)
    return found
