"""The numpy reference for a model with embedding tables: rows pulled in, row gradients out.

A worker holds no table: it holds the rows of the ids its batch needs, which
the ps sent (:meth:`~psdk.plugins.backend.Backend.write_rows`), in a local
array indexed by id (``capacity x dim``, allocated with ``np.zeros``, which
Linux maps lazily: only the pages of rows written take memory). A forward
pass gathers rows by id; the backward pass leaves (ids, row gradients), one
row per occurrence, which psdk sums per id before it pushes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from psdk.plugins.variables import Rows
from psdk.protocol.sharding import flat_size, layout, views


class NumpyTableModel:
    """Dense variables (flat, as :class:`~psdk.plugins.backends.numpy_backend.NumpyModel`) and tables of rows."""

    def __init__(self, dense: Mapping[str, np.ndarray], tables: Mapping[str, Rows]):
        self.specs = layout([(name, tuple(np.shape(value))) for name, value in dense.items()])
        self.flat = np.zeros(flat_size(self.specs), np.float32)
        self.grad_flat = np.zeros_like(self.flat)
        self.params = views(self.flat, self.specs)
        self.grads = views(self.grad_flat, self.specs)
        for name, view in self.params.items():
            view[...] = dense[name]
        self.tables = dict(tables)
        self.rows = {name: np.zeros((rows.capacity, rows.dim), np.float32) for name, rows in self.tables.items()}
        self.row_grads: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (any order, duplicates) as the last ``write_rows`` left them."""
        return self.rows[table][np.asarray(ids, np.int64)]

    def backward_rows(self, table: str, ids: np.ndarray, grads: np.ndarray) -> None:
        """Record the gradient of the rows a forward pass looked up (one row per occurrence)."""
        self.row_grads[table] = (np.asarray(ids, np.int64).copy(), np.asarray(grads, np.float32).copy())

    def zero_grad(self) -> None:
        self.grad_flat.fill(0.0)
        self.row_grads.clear()
