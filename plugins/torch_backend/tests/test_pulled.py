"""``PulledEmbedding``: a table holding only the rows written, held to the table suite and to nn.Embedding.

Its lookups must read what ``nn.Embedding(sparse=True)`` reads from a whole
weight holding the same rows, and its gradient must be that embedding's
sparse gradient summed per id; what it holds between writes and lookups is
the contract a worker's loop and its evaluations rely on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend
from psdk_torch.pulled import PulledEmbedding
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.variables import Rows
from psdk.protocol.ids import unique_positions
from psdk.testing import TableConformance
from psdk.testing.table_conformance import CAPACITY, DIM, KERNEL, TABLE

pytestmark = pytest.mark.timeout(60)


class PulledNet(nn.Module):
    """The table suite's model (``sum over ids of emb[id] @ out/kernel``) on a PulledEmbedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = PulledEmbedding(CAPACITY, DIM)
        self.out = nn.Module()
        self.out.kernel = nn.Parameter(torch.zeros(DIM, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) @ self.out.kernel


class TestPulledEmbeddingTables(TableConformance):
    backend_name = "torch"

    def table_model(self, backend: Backend) -> Any:
        return PulledNet()

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(torch.as_tensor(ids)).sum()
        loss.backward()
        return float(loss.item())


def _sparse_reference(rows: np.ndarray, ids: np.ndarray, upstream: np.ndarray) -> tuple[np.ndarray, ...]:
    """nn.Embedding(sparse=True) over a whole weight: its lookup, and its gradient's ids and rows summed per id."""
    emb = nn.Embedding.from_pretrained(torch.from_numpy(rows.copy()), freeze=False, sparse=True)
    out = emb(torch.from_numpy(ids))
    (out * torch.from_numpy(upstream)).sum().backward()
    assert emb.weight.grad is not None
    grad = emb.weight.grad.coalesce()
    return out.detach().numpy(), grad.indices()[0].numpy(), grad.values().numpy()


@pytest.mark.parametrize("known", [True, False], ids=["batch positions", "searched"])
def test_it_reads_and_sums_as_a_sparse_embedding_does(known: bool) -> None:
    rng = np.random.default_rng(0)
    capacity, dim = 5000, 4
    table = rng.normal(size=(capacity, dim)).astype(np.float32)
    ids = (rng.zipf(1.3, (64, 26)) % capacity).astype(np.int64)
    upstream = rng.normal(size=(*ids.shape, dim)).astype(np.float32)
    looked_up, ref_ids, ref_rows = _sparse_reference(table, ids, upstream)

    emb = PulledEmbedding(capacity, dim)
    unique, positions = unique_positions(ids)
    written = table[unique]
    written.flags.writeable = False  # as the ps's rows arrive
    emb.write(unique, written)
    out = emb(torch.from_numpy(ids), positions.reshape(ids.shape) if known else None)
    np.testing.assert_array_equal(out.detach().numpy(), looked_up)
    (out * torch.from_numpy(upstream)).sum().backward()
    got_ids, got_rows = emb.row_gradients()
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(got_rows, ref_rows, rtol=1e-5, atol=1e-6)


def test_an_id_not_held_reads_zeros_and_only_ids_read_get_gradients() -> None:
    emb = PulledEmbedding(100, 2)
    emb.write(np.array([3, 7, 9]), np.array([[1, 1], [2, 2], [3, 3]], np.float32))
    out = emb(torch.tensor([7, 50, 7]))
    np.testing.assert_array_equal(out.detach().numpy(), [[2, 2], [0, 0], [2, 2]])
    out.sum().backward()
    ids, rows = emb.row_gradients()
    assert ids.tolist() == [7] and rows.tolist() == [[2.0, 2.0]]  # 3 and 9 were held, not read: not pushed


def test_writes_add_up_until_a_lookup_and_the_next_write_replaces() -> None:
    emb = PulledEmbedding(100, 1)
    emb.write(np.array([1, 5]), np.array([[1], [5]], np.float32))
    emb.write(np.array([5, 8]), np.array([[50], [80]], np.float32))  # no lookup between: added, 5 replaced
    assert emb.ids.tolist() == [1, 5, 8]
    np.testing.assert_array_equal(emb(torch.tensor([1, 5, 8])).detach().numpy()[:, 0], [1, 50, 80])
    emb.write(np.array([2]), np.array([[2]], np.float32))  # after a lookup: what was held goes
    np.testing.assert_array_equal(emb(torch.tensor([1, 2])).detach().numpy()[:, 0], [0, 2])


def test_the_gradient_outlives_a_write_and_a_prediction_before_the_push() -> None:
    emb = PulledEmbedding(100, 1)
    emb.write(np.array([4]), np.array([[1]], np.float32))
    (emb(torch.tensor([4, 4])) * 3).sum().backward()
    emb.write(np.array([6]), np.array([[1]], np.float32))  # an evaluation's rows
    with torch.no_grad():
        emb(torch.tensor([6]))
    ids, rows = emb.row_gradients()
    assert ids.tolist() == [4] and rows.tolist() == [[6.0]]


def test_bad_ids_and_shapes_are_refused_by_name() -> None:
    emb = PulledEmbedding(10, 2)
    with pytest.raises(ConfigError, match=r"holds ids 0..9, got ids from 3 to 10: hash or take them modulo"):
        emb.write(np.array([3, 10]), np.zeros((2, 2), np.float32))
    with pytest.raises(ConfigError, match=r"num_embeddings and embedding_dim >= 1"):
        PulledEmbedding(0, 2)
    with pytest.raises(ConfigError, match=r"PulledEmbedding of 10 x 2 was given psdk.Rows of 10 x 3"):
        PulledEmbedding(10, 2, Rows(dim=3, capacity=10))


def test_the_bridge_finds_it_as_a_table_with_its_record() -> None:
    backend = TorchBackend()
    model = PulledNet()
    model.emb = PulledEmbedding(CAPACITY, DIM, Rows(dim=DIM, capacity=CAPACITY, initializer="uniform", init_scale=0.1))
    records = backend.variable_records(model)
    assert records[TABLE] == Rows(dim=DIM, capacity=CAPACITY, initializer="uniform", init_scale=0.1)
    assert set(backend.read_weights(model)) == {KERNEL}
