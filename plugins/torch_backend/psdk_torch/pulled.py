"""``PulledEmbedding``: a table that holds only the rows the ps sent for the batch, not ``capacity x dim``.

An ``nn.Embedding(sparse=True)`` table (:mod:`psdk_torch.tables`) keeps a
local weight of the whole table that each batch's rows are scattered into,
and its backward pass leaves one gradient row per lookup, duplicates
included, for psdk to sum. On a click batch (26,624 lookups of 16 floats
into ten million rows, about 9,700 distinct) that costs a worker, per step,
the scatter into a 640 MB weight (whose pages stay mapped as rows arrive:
the worker's memory grows towards the table's), a gather from it, a sparse
gradient of 26,624 rows, and a sort and a sum of them by id.

:class:`PulledEmbedding` holds the rows written since its last lookup, by
increasing id, as one small ``held x dim`` tensor. A lookup gathers from it
by position (the batch's :meth:`~psdk.plugins.batches.JaggedIds.positions`
when the held ids are the batch's distinct ids, as in training; else found by
search, an id not held reading zeros, as an id the ps never trained does),
and its backward pass sums the lookups' gradients into one row per held id
(``index_add_``): the gradient is already summed, in the order psdk pushes
it. Figures: docs/tables.md (torch).

It is a table to psdk as ``nn.Embedding(sparse=True)`` is: found in the model,
declared as :class:`~psdk.plugins.variables.Rows`, named by its module path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.variables import Rows


class _Gather(torch.autograd.Function):
    """``held[positions]`` whose backward sums into ``held``'s rows with ``index_add_``.

    torch's own embedding backward sorts the lookups first (2.5 ms for a
    click batch on one thread); ``index_add_`` takes them in any order (0.6 ms).
    """

    @staticmethod
    def forward(ctx: Any, held: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.held_shape = held.shape
        flat = positions.reshape(-1)
        return held.index_select(0, flat).view(*positions.shape, held.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (positions,) = ctx.saved_tensors
        summed = torch.zeros(ctx.held_shape, dtype=grad.dtype, device=grad.device)
        summed.index_add_(0, positions.reshape(-1), grad.reshape(-1, ctx.held_shape[1]))
        return summed, None


class PulledEmbedding(nn.Module):
    """A ``num_embeddings x embedding_dim`` table on the ps; this module holds the rows last written only.

    ``rows``: how the ps draws the table's initial rows (``psdk.Rows``); by default psdk's
    (N(0, 0.01²)). Ids must lie in ``[0, num_embeddings)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, rows: Rows | None = None):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ConfigError(
                "model", f"a PulledEmbedding needs num_embeddings and embedding_dim >= 1, got {num_embeddings}, "
                f"{embedding_dim}"
            )  # fmt: skip
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.record = rows if rows is not None else Rows(dim=self.embedding_dim, capacity=self.num_embeddings)
        if (self.record.capacity, self.record.dim) != (self.num_embeddings, self.embedding_dim):
            raise ConfigError(
                "model",
                f"a PulledEmbedding of {self.num_embeddings} x {self.embedding_dim} was given psdk.Rows of "
                f"{self.record.capacity} x {self.record.dim}",
            )
        self.register_buffer("_device_anchor", torch.zeros(0), persistent=False)  # .to(device) moves it
        self.ids = np.zeros(0, np.int64)
        """The held rows' ids, strictly increasing."""
        self.held = self._tensor(np.zeros((1, self.embedding_dim), np.float32))
        """The held rows, then a row of zeros (where an id not held points); a leaf with a gradient."""
        self._looked_up = True
        """A lookup ran since the last write: the next write replaces the held rows instead of adding to them."""
        self._trained: tuple[np.ndarray, torch.Tensor, np.ndarray | None] = (self.ids, self.held, None)
        """The last training lookup's held ids, rows (whose ``.grad`` the backward pass fills) and which of
        them it read (``None``: all): kept apart, so that a write and a prediction before the push (an
        evaluation) leave the gradient as it was."""

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        """``rows`` (a float32 array this module made and owns) as the held leaf: no copy on the CPU."""
        return torch.from_numpy(rows).to(self.device).requires_grad_()

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold ``rows`` (copied) as the rows of ``ids`` (strictly increasing).

        The first write after a lookup replaces what was held (a training step's rows); writes in a row
        add up, a later row of an id replacing an earlier one (an evaluation writes a set's rows in chunks).
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        rows = np.asarray(rows, np.float32).reshape(len(ids), -1) if len(ids) else rows
        if len(ids) and (ids[0] < 0 or ids[-1] >= self.num_embeddings):
            raise ConfigError(
                "ids",
                f"a PulledEmbedding holds ids 0..{self.num_embeddings - 1}, got ids from {ids[0]} to {ids[-1]}: "
                f"hash or take them modulo num_embeddings={self.num_embeddings} before the lookup",
            )
        if not self._looked_up and len(self.ids):
            merged = np.concatenate([ids, self.ids])  # the new rows first: np.unique keeps an id's first
            kept, first = np.unique(merged, return_index=True)
            old = self.held.detach()[:-1].cpu().numpy()
            ids, rows = kept, np.concatenate([rows, old])[first]
        padded = np.zeros((len(ids) + 1, self.embedding_dim), np.float32)
        padded[:-1] = rows
        self.ids, self.held, self._looked_up = ids.copy(), self._tensor(padded), False

    def positions_of(self, ids: np.ndarray) -> np.ndarray:
        """Where each of ``ids`` is among the held ids; the zeros row's position for an id not held."""
        ids = np.asarray(ids, np.int64)
        at = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        held = (self.ids[at] == ids) if len(self.ids) else np.zeros(ids.shape, bool)
        return np.where(held, at, len(self.ids))

    def forward(self, ids: torch.Tensor | np.ndarray, positions: np.ndarray | None = None) -> torch.Tensor:
        """The rows of ``ids`` (any shape), ``ids.shape + (embedding_dim,)``.

        ``positions``: where each of ``ids`` is among the held ids, when the caller knows (a batch's
        ``JaggedIds.positions()`` when the held ids are its ``unique()``); else they are searched for.
        """
        training = torch.is_grad_enabled()  # a prediction leaves the last step's gradient as it is
        if positions is None:
            array = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
            positions = self.positions_of(array)
        if training:
            self.held.grad = None
            used: np.ndarray | None = np.bincount(np.reshape(positions, -1), minlength=len(self.ids) + 1)[:-1] > 0
            if used is not None and bool(used.all()):  # a batch's own rows: all read (0.1 ms to know)
                used = None
            self._trained = (self.ids, self.held, used)
        self._looked_up = True
        index = torch.from_numpy(np.ascontiguousarray(positions, np.int64)).to(self.device)
        return _Gather.apply(self.held, index.view(np.shape(ids)))

    def row_gradients(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of the last backward pass: one summed row per id looked up, ids increasing."""
        ids, held, used = self._trained
        if held.grad is None:
            return np.zeros(0, np.int64), np.zeros((0, self.embedding_dim), np.float32)
        rows = held.grad[:-1].detach().cpu().numpy()
        if used is not None and not bool(used.all()):
            return ids[used], rows[used]
        return ids, rows

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, holding {len(self.ids)} rows"
