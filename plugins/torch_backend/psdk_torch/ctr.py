"""The click-through workload's trainer on torch: a DLRM-style model, mean BCE with logits, logits out.

psdk's ``ctr`` workload names no framework; this plugin gives it a torch
trainer through ``psdk_register_trainers`` (:mod:`psdk_torch.plugin`), as it
gives MNIST one. The model is the workload's: one shared table ``emb`` that
every categorical field looks its ids up in, a bottom MLP over the dense
features (ReLU after each layer), the pairwise dot products ``i < j`` of the
27 vectors ``[bottom output, row of field 0, ..., row of field 25]``, and a
top MLP over ``[bottom output, the dots]`` (ReLU between its layers) to one
logit: the order of Facebook's DLRM and of the workload's numpy reference
(:mod:`psdk.workloads.ctr.model`), which every framework's trainer matches.

Its canonical variables are the workload's by construction: the dense layers
are the plugin's :class:`~psdk_torch.models.Dense` (kernel stored (in, out),
as the ps keeps it), named ``bottom<i>`` and ``top<i>``, and the table is a
:class:`~psdk_torch.pulled.PulledEmbedding` named ``emb``: it holds only the
rows the ps sent for the batch (``write_rows``), so a ten-million-row table
costs a worker no more memory than a batch's rows, and its gradient comes
out summed per id. The trainer sets no threads: the job does
(``train.threads``). This module imports torch; psdk imports it only when a
job trains ``ctr`` on torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Rows
from psdk.workloads.ctr.data import CAT_INPUT, DENSE_INPUT, TABLE
from psdk.workloads.ctr.model import table_of
from psdk_torch.backend import TorchBackend
from psdk_torch.models import Dense
from psdk_torch.pulled import PulledEmbedding

_LAYER = re.compile(r"^(bottom|top)(\d+)/(kernel|bias)$")


class PairDots(torch.autograd.Function):
    """The dot products ``i < j`` of each example's vectors, by one ``bmm`` forward and one backward.

    The products are a third of the step's compute. Forward: the Gram matrix
    ``v @ v.T`` and its upper triangle picked out; backward: the products'
    gradient laid out as the symmetric matrix ``S`` (each pair's gradient at
    ``(i, j)`` and ``(j, i)``, zeros on the diagonal) by one ``index_select``
    from a zero-padded copy, and ``S @ v``. autograd's own (``bmm``'s two
    products, ``g + g.T`` on a strided view, the pick's scatter into a zeroed
    Gram gradient) took 4.4 ms of a click batch's step on one thread; this 1.2 ms.
    """

    @staticmethod
    def forward(ctx: Any, vectors: torch.Tensor, pairs: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(vectors, spread)
        return torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, pairs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        vectors, spread = ctx.saved_tensors
        n = vectors.shape[1]
        padded = torch.cat([grad, grad.new_zeros(grad.shape[0], 1)], dim=1)  # the last column: the diagonal's 0
        symmetric = padded.index_select(1, spread).view(-1, n, n)
        return torch.bmm(symmetric, vectors), None, None


class ClickModel(nn.Module):
    """DLRM-style: ``emb``, the bottom MLP, the pairwise dots of the bottom output and the fields' rows, the top MLP.

    The interaction's vectors are the bottom output, then the fields' rows in
    field order; the top MLP reads the bottom output, then their dot products
    ``i < j`` in the order of ``torch.triu_indices(n, n, 1)`` (row-major).
    """

    def __init__(
        self,
        table: Rows,
        bottom: list[tuple[int, int]],
        top: list[tuple[int, int]],
        device: torch.device | None = None,
    ):
        super().__init__()
        if bottom[-1][1] != table.dim:
            raise ConfigError(
                "model",
                f"the bottom MLP's output ({bottom[-1][1]}) meets the rows of table {TABLE!r} ({table.dim} wide) "
                "in dot products: make them the same size",
            )
        self.bottom_names = [f"bottom{i}" for i in range(len(bottom))]
        self.top_names = [f"top{i}" for i in range(len(top))]
        for name, (fan_in, fan_out) in zip(self.bottom_names + self.top_names, bottom + top, strict=True):
            self.add_module(name, Dense(fan_in, fan_out))  # in the spec's order: named_parameters follows
        self.emb = PulledEmbedding(table.capacity, table.dim, table)  # declared as the spec says
        self._pairs: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def pairs(self, vectors: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the dot products ``i < j`` of ``vectors`` vectors sit in their flattened Gram matrix, and
        for each place of that matrix which product goes there (the mirror's too; the diagonal: one past)."""
        key = (vectors, device)
        if key not in self._pairs:
            rows, cols = torch.triu_indices(vectors, vectors, offset=1, device=device)
            spread = torch.full((vectors * vectors,), len(rows), dtype=torch.long, device=device)
            order = torch.arange(len(rows), device=device)
            spread[rows * vectors + cols] = order
            spread[cols * vectors + rows] = order
            self._pairs[key] = (rows * vectors + cols, spread)
        return self._pairs[key]

    def forward(self, dense: torch.Tensor, cat: torch.Tensor, positions: np.ndarray | None = None) -> torch.Tensor:
        """The logits, [B]. ``positions``: where each id of ``cat`` is among the table's held ids, if known."""
        x = dense
        for name in self.bottom_names:
            x = F.relu(getattr(self, name)(x))
        vectors = torch.cat([x.unsqueeze(1), self.emb(cat, positions)], dim=1)  # [B, 1 + fields, dim]
        pairs, spread = self.pairs(vectors.shape[1], vectors.device)
        dots: torch.Tensor = PairDots.apply(vectors, pairs, spread)
        x = torch.cat([x, dots], dim=1)
        top0: Dense = self.top0
        if x.shape[1] != top0.kernel.shape[0]:
            raise ConfigError(
                "model",
                f"a batch of {cat.shape[1]} categorical fields gives the top MLP {x.shape[1] - len(pairs)} bottom "
                f"outputs and {len(pairs)} dot products ({x.shape[1]} inputs), but top0 takes "
                f"{top0.kernel.shape[0]}: the model's fields must be the data's",
            )
        last = len(self.top_names) - 1
        for i, name in enumerate(self.top_names):
            x = getattr(self, name)(x)
            if i < last:
                x = F.relu(x)
        return x[:, 0]


def layers_of(spec: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(fan_in, fan_out) of the bottom and the top MLP's layers, from the spec's dense variables."""
    sizes: dict[str, dict[int, tuple[int, int]]] = {"bottom": {}, "top": {}}
    for name, shape in spec.variables():
        match = _LAYER.match(name)
        if match is None:
            raise ConfigError("model", f"the ctr model on torch has dense layers bottom<i> and top<i>, not {name!r}")
        if match[3] == "kernel":
            fan_in, fan_out = (int(n) for n in shape)
            sizes[match[1]][int(match[2])] = (fan_in, fan_out)
    bottom, top = (_in_order(sizes["bottom"]), _in_order(sizes["top"]))
    if not bottom or not top or top[-1][1] != 1:
        raise ConfigError(
            "model",
            f"the ctr model needs dense layers bottom0.. and top0.., numbered from 0, the last giving one logit; "
            f"got bottom {sorted(sizes['bottom'])}, top {sorted(sizes['top'])}",
        )
    return bottom, top


def _in_order(layers: Mapping[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """The layers numbered 0, 1, ..., in that order; empty when a number is missing."""
    return [layers[i] for i in range(len(layers))] if sorted(layers) == list(range(len(layers))) else []


def build(spec: Any, weights: Mapping[str, np.ndarray], backend: TorchBackend) -> ClickModel:
    """``spec``'s model on the backend's device, holding ``weights`` (dense only: the rows come from the ps)."""
    bottom, top = layers_of(spec)
    device = backend.torch_device
    model = ClickModel(table_of(spec, "torch"), bottom, top, device).to(device)
    backend.write_weights(model, weights)
    return model


def tensor(array: np.ndarray, dtype: np.dtype[Any], device: torch.device) -> torch.Tensor:
    """``array`` as ``dtype`` on ``device``; a read-only array (memory-mapped data) is copied, as torch wants."""
    array = np.ascontiguousarray(array, dtype)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(device, non_blocking=True)


class TorchCtr(Trainer):
    """``ctr`` on torch: ``F.binary_cross_entropy_with_logits`` and ``backward()``, logits as float32 numpy [B]."""

    bridge: TorchBackend
    bridge_class = TorchBackend

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> ClickModel:
        return build(spec, weights, self.bridge)

    def inputs(self, model: ClickModel, batch: Batch) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
        """The dense features, the ids, and where each id is among the rows the table holds (when they are
        the batch's own: ``None`` makes the table search)."""
        dense = tensor(batch.inputs[DENSE_INPUT], np.dtype(np.float32), self.bridge.torch_device)
        cat = np.asarray(batch.inputs[CAT_INPUT])
        ids = batch.ids.get(TABLE)
        positions = None
        if ids is not None and len(ids.values) == cat.size and np.array_equal(ids.unique(), model.emb.ids):
            positions = ids.positions().reshape(cat.shape)
        return dense, cat, positions

    def forward_backward(self, model: ClickModel, batch: Batch) -> float:
        """The mean BCE with logits; dense gradients in zeroed ``.grad`` tensors, the rows' summed per held id.

        Dense gradients are zeroed in place so that, where the bridge shares
        psdk's buffers, backward writes straight into what is pushed. The
        table's gradient is a fresh tensor each step (the lookup drops the old).
        """
        dense, cat, positions = self.inputs(model, batch)
        y = tensor(batch.targets, np.dtype(np.float32), self.bridge.torch_device)
        model.zero_grad(set_to_none=False)
        loss = F.binary_cross_entropy_with_logits(model(dense, cat, positions), y)
        loss.backward()
        return float(loss.item())

    @torch.no_grad()
    def predict(self, model: ClickModel, batch: Batch) -> np.ndarray:
        """The logits of ``batch``, float32 [B]; the workload scores their AUC and log loss."""
        return model(*self.inputs(model, batch)).to(torch.float32).cpu().numpy()
