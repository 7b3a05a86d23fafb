"""Embedding tables in torch: each ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True``.

A recommendation model's table is far larger than what one batch reads, so
psdk keeps its rows on the ps and moves only the rows of a batch's ids: rows
in before the forward pass (:func:`write_rows`), the sparse gradient out
after the backward pass (:func:`read_row_gradients`). ``sparse=True`` is the
switch because it is what makes torch's backward leave a gradient of the
touched rows only (a sparse COO tensor) rather than a dense ``capacity x
dim`` one; an embedding without it stays a dense variable that travels
whole, as any other parameter.

A :class:`~psdk_torch.pulled.PulledEmbedding` is a table too, holding only the
rows the ps sent (no ``capacity x dim`` weight) and leaving its gradient
summed per id: the faster way for a model written for psdk.

A table is named by its module's path in the model (``model.user_emb`` is
``user_emb``, ``model.tower.emb`` is ``tower/emb``): the canonical name of
its weight (``user_emb/weight``) without the ``/weight`` every table's
weight would carry. The local weight holds ``num_embeddings x
embedding_dim`` and ids index it directly, so ids must be hashed into
``[0, num_embeddings)``; its values only ever come from the ps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.variables import Rows
from psdk_torch.pulled import PulledEmbedding

TABLE_MODULES = (nn.Embedding, nn.EmbeddingBag)
"""The modules that can be tables (with ``sparse=True``)."""
ROWS_ATTRIBUTE = "psdk_rows"
"""A table module's own :class:`~psdk.plugins.variables.Rows`, when it sets one: how the ps draws its rows.

torch's embeddings carry no initializer the ps could read, so without it a
table is declared with psdk's default (N(0, 0.01²)); a model whose spec says
otherwise (the ``ctr`` workload's ``model.init_scale``) sets it.
"""


@dataclass(frozen=True)
class Table:
    """One table of a model: its name, its weight and what to call it in a message."""

    name: str
    weight: nn.Parameter | None
    """The local weight rows are written into; ``None`` for a :class:`PulledEmbedding`, which holds its own."""
    kind: str
    """``nn.Embedding`` or ``nn.EmbeddingBag``."""
    padding_idx: int | None = None
    """The id whose row torch keeps at zeros and never trains (its gradient leaves it out)."""
    declared: Rows | None = None
    """The module's own record (:data:`ROWS_ATTRIBUTE`), if it set one."""
    pulled: PulledEmbedding | None = None

    @property
    def record(self) -> Rows:
        if self.pulled is not None:
            return self.pulled.record
        if self.declared is not None:
            return self.declared
        assert self.weight is not None
        capacity, dim = self.weight.shape
        return Rows(dim=int(dim), capacity=int(capacity))

    def __str__(self) -> str:
        return f"table {self.name!r} ({self.kind})"


def find_tables(model: nn.Module) -> dict[str, Table]:
    """The trainable ``sparse=True`` embeddings of ``model`` by table name, in module order."""
    found: dict[str, Table] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        if isinstance(module, PulledEmbedding):
            name = path.replace(".", "/") or "weight"
            found[name] = Table(name, None, "PulledEmbedding", pulled=module)
            continue
        if not isinstance(module, TABLE_MODULES) or not module.sparse or not module.weight.requires_grad:
            continue
        if id(module.weight) in seen:
            continue  # a module registered twice under two paths: one table
        seen.add(id(module.weight))
        kind = f"nn.{type(module).__name__}"
        declared = getattr(module, ROWS_ATTRIBUTE, None)
        table = Table(path.replace(".", "/") or "weight", module.weight, kind, module.padding_idx, declared)
        shape = (int(module.weight.shape[0]), int(module.weight.shape[1]))
        if declared is not None and (not isinstance(declared, Rows) or (declared.capacity, declared.dim) != shape):
            raise ConfigError(
                "model",
                f"{table}'s {ROWS_ATTRIBUTE} must be a psdk.Rows of its weight's capacity and dim {shape}, "
                f"got {declared!r}",
            )
        if module.max_norm is not None:
            raise ConfigError(
                "model",
                f"{table} has max_norm={module.max_norm}: its forward pass renormalises the rows in this worker's "
                "copy only, which the ps's rows would not follow; leave max_norm out of a table",
            )
        found[table.name] = table
    return found


@torch.no_grad()
def write_rows(table: Table, ids: np.ndarray, rows: np.ndarray) -> None:
    """Copy ``rows`` into the table's weight at ``ids`` (unique, increasing), where the forward pass reads them."""
    if table.pulled is not None:
        table.pulled.write(ids, rows)
        return
    weight = table.weight
    assert weight is not None
    capacity = weight.shape[0]
    if len(ids) and (ids[0] < 0 or ids[-1] >= capacity):
        raise ConfigError(
            "ids",
            f"{table} holds ids 0..{capacity - 1}, got ids from {ids[0]} to {ids[-1]}: hash or take them modulo "
            f"num_embeddings={capacity} before the lookup",
        )
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        weight.detach().numpy()[ids] = rows  # no copy of the rows, which are read-only
    else:
        index = torch.as_tensor(np.array(ids, np.int64), device=weight.device)
        weight.index_copy_(0, index, torch.as_tensor(np.array(rows), dtype=weight.dtype, device=weight.device))
    if table.padding_idx is not None:
        weight[table.padding_idx] = 0.0  # as torch builds it: the ps's row of that id is never trained nor read


@torch.no_grad()
def read_row_gradients(table: Table) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of the sparse gradient the last backward pass left; empty when the table was not touched."""
    if table.pulled is not None:
        return table.pulled.row_gradients()
    assert table.weight is not None
    grad = table.weight.grad
    if grad is None:
        return np.zeros(0, np.int64), np.zeros((0, table.weight.shape[1]), np.float32)
    if not grad.is_sparse:
        raise ConfigError(
            "model",
            f"{table} got a dense gradient, which psdk never pushes (a table travels as the rows a batch touched): "
            "keep its module's sparse=True and look rows up only through the module (a weight also used elsewhere, "
            "e.g. tied to an output layer, gets a dense gradient)",
        )
    # Not coalesced: psdk's client sums duplicate ids anyway (one bincount per column), and coalescing cost a
    # click batch's 26,624 rows about 7 ms of a 20 ms step.
    if grad.is_coalesced():
        indices, values = grad.indices(), grad.values()
    else:
        indices, values = grad._indices(), grad._values()
    ids = indices[0].cpu().numpy().astype(np.int64, copy=True)
    rows = values.cpu().numpy().astype(np.float32, copy=True)
    return ids, rows.reshape(len(ids), table.weight.shape[1])
