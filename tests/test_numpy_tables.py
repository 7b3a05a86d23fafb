"""The numpy reference backend with an embedding table, held to the table conformance suite."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from psdk.plugins.backend import Backend
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.backends.numpy_tables import NumpyTableModel
from psdk.plugins.variables import Rows
from psdk.testing import TableConformance
from psdk.testing.table_conformance import CAPACITY, DIM, KERNEL, TABLE

pytestmark = pytest.mark.timeout(60)


class TestNumpyTables(TableConformance):
    backend_name = "numpy"

    def table_model(self, backend: Backend) -> Any:
        return NumpyTableModel({KERNEL: np.zeros((DIM, 1), np.float32)}, {TABLE: Rows(dim=DIM, capacity=CAPACITY)})

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        model.zero_grad()
        rows, kernel = model.lookup(TABLE, ids), model.params[KERNEL]
        loss = float((rows @ kernel).sum())
        model.grads[KERNEL][...] = rows.sum(axis=0).reshape(DIM, 1)
        model.backward_rows(TABLE, ids, np.repeat(kernel.reshape(1, DIM), len(ids), axis=0))
        return loss


class OncePerId(NumpyBackend):
    """Reads one gradient row per id, dropping a batch's duplicates instead of summing them."""

    def read_row_gradients(self, model: NumpyTableModel, table: str) -> tuple[np.ndarray, np.ndarray]:
        ids, grads = super().read_row_gradients(model, table)
        unique, first = np.unique(ids, return_index=True)
        return unique, grads[first]


def test_the_table_suite_catches_dropped_duplicates() -> None:
    suite = TestNumpyTables()
    suite.test_row_gradients_are_read_back_by_id(NumpyBackend())
    with pytest.raises(AssertionError):
        suite.test_row_gradients_are_read_back_by_id(OncePerId())
