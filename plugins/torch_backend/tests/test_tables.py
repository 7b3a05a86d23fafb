"""torch's embedding tables (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``), held to the table suite.

The suite's model is ``sum over ids of emb[id] @ out/kernel``; an
``nn.EmbeddingBag(mode="sum")`` over all the ids as one bag computes the
same sum, so the bag runs the whole suite too, with the same numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend
from torch import nn

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.variables import Dense, Rows
from psdk.testing import TableConformance
from psdk.testing.table_conformance import CAPACITY, DIM, IDS, KERNEL, TABLE

pytestmark = pytest.mark.timeout(60)


class Out(nn.Module):
    """A bias-free head whose kernel is stored (in, out): canonical name ``out/kernel``."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(DIM, 1))


class Net(nn.Module):
    """The suite's model: table ``emb`` (its module's name) and ``out/kernel``."""

    def __init__(self, bag: bool = False, sparse: bool = True) -> None:
        super().__init__()
        empty = torch.empty(CAPACITY, DIM)  # its rows only ever come from the ps: no need to initialise them
        self.emb: nn.Embedding | nn.EmbeddingBag = (
            nn.EmbeddingBag.from_pretrained(empty, freeze=False, mode="sum", sparse=sparse)
            if bag
            else nn.Embedding.from_pretrained(empty, freeze=False, sparse=sparse)
        )
        self.out = Out()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``emb[id] @ kernel`` per id, or per bag of ids (one bag: all of them) for the bag."""
        rows = self.emb(ids.view(1, -1)) if isinstance(self.emb, nn.EmbeddingBag) else self.emb(ids)
        return rows @ self.out.kernel


class TestTorchTables(TableConformance):
    backend_name = "torch"
    bag = False

    def table_model(self, backend: Backend) -> Any:
        return Net(bag=self.bag)

    def table_backward(self, backend: Backend, model: Any, ids: np.ndarray) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(torch.as_tensor(ids)).sum()
        loss.backward()
        return loss.item()


class TestTorchEmbeddingBagTables(TestTorchTables):
    """``nn.EmbeddingBag(mode="sum", sparse=True)``: its sparse gradient is read the same way."""

    bag = True


@pytest.fixture
def backend() -> TorchBackend:
    return TorchBackend()


def _backward(model: Net, ids: np.ndarray) -> None:
    model.zero_grad(set_to_none=True)
    model(torch.as_tensor(ids)).sum().backward()


def test_an_embedding_without_sparse_stays_a_dense_variable(backend: TorchBackend) -> None:
    model = Net(sparse=False)
    assert backend.variable_records(model) == {"emb/weight": Dense((CAPACITY, DIM)), KERNEL: Dense((DIM, 1))}
    assert set(backend.read_weights(model)) == {"emb/weight", KERNEL}


def test_a_table_is_named_by_its_module_path(backend: TorchBackend) -> None:
    tower = nn.Module()
    tower.add_module("users", nn.EmbeddingBag(10, 3, sparse=True))
    model = nn.Sequential()
    model.add_module("tower", tower)
    model.add_module("head", nn.Linear(3, 1))
    assert backend.variable_records(model) == {
        "tower/users": Rows(dim=3, capacity=10),
        "head/weight": Dense((1, 3)),
        "head/bias": Dense((1,)),
    }


def test_a_module_declares_how_the_ps_draws_its_rows(backend: TorchBackend) -> None:
    """torch's embeddings name no initializer: a module's psdk_rows does, checked against its weight."""
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True))
    model[0].psdk_rows = Rows(dim=3, capacity=10, initializer="uniform", init_scale=0.05)
    assert backend.variable_records(model) == {"0": Rows(dim=3, capacity=10, initializer="uniform", init_scale=0.05)}
    model[0].psdk_rows = Rows(dim=4, capacity=10)
    with pytest.raises(ConfigError, match=r"table '0' \(nn.Embedding\)'s psdk_rows must be a psdk.Rows of .*\(10, 3\)"):
        backend.variable_records(nn.Sequential(*model))  # a new model: the view of one is kept beside it


def test_a_dense_gradient_on_a_table_is_refused_naming_it(backend: TorchBackend) -> None:
    """A table's weight also used outside its module (tied) gets a dense gradient: refused, never pushed whole."""
    model = Net()
    backend.variable_records(model)
    model.zero_grad(set_to_none=True)
    (model(torch.as_tensor(IDS)).sum() + model.emb.weight.sum()).backward()
    assert not model.emb.weight.grad.is_sparse
    with pytest.raises(ConfigError, match=r"table 'emb' \(nn.Embedding\) got a dense gradient.*sparse=True"):
        backend.read_row_gradients(model, TABLE)


def test_an_untouched_table_gives_empty_gradients(backend: TorchBackend) -> None:
    ids, grads = backend.read_row_gradients(Net(), TABLE)
    assert ids.dtype == np.int64 and grads.dtype == np.float32
    assert ids.shape == (0,) and grads.shape == (0, DIM)


def test_ids_outside_the_local_table_are_refused(backend: TorchBackend) -> None:
    rows = np.zeros((2, DIM), np.float32)
    with pytest.raises(ConfigError, match=r"ids 0..63, got ids from 5 to 64: hash or take them modulo"):
        backend.write_rows(Net(), TABLE, np.array([5, CAPACITY], np.int64), rows)
    with pytest.raises(ConfigError, match="no embedding table 'users'"):
        backend.write_rows(Net(), "users", np.array([5], np.int64), rows[:1])


def test_max_norm_is_refused(backend: TorchBackend) -> None:
    model = nn.Sequential(nn.Embedding(8, 2, sparse=True, max_norm=1.0))
    with pytest.raises(ConfigError, match=r"table '0' \(nn.Embedding\) has max_norm=1.0"):
        backend.variable_records(model)


def test_shared_buffers_leave_the_table_alone(backend: TorchBackend) -> None:
    """psdk's buffers hold the dense variables only; the table's weight is not replaced, nor sized into them."""
    model = Net()
    before = model.emb.weight.data_ptr()
    params = {KERNEL: np.ones((DIM, 1), np.float32)}
    assert backend.share_buffers(model, params, {KERNEL: np.zeros((DIM, 1), np.float32)})
    assert model.emb.weight.data_ptr() == before
    assert model.out.kernel.data_ptr() == params[KERNEL].ctypes.data
    backend.write_rows(model, TABLE, np.array([3], np.int64), np.full((1, DIM), 2.0, np.float32))
    _backward(model, np.array([3, 3], np.int64))
    ids, grads = backend.read_row_gradients(model, TABLE)
    np.testing.assert_allclose(grads[ids == 3].sum(axis=0), 2.0 * np.ones(DIM), atol=1e-6)


def test_the_padding_row_reads_zeros_and_is_never_pushed(backend: TorchBackend) -> None:
    """torch keeps ``padding_idx``'s row at zeros and leaves it out of the gradient: so does the table."""
    model = nn.Embedding(8, 2, sparse=True, padding_idx=0)
    ids = np.array([0, 3], np.int64)
    backend.write_rows(model, "weight", ids, np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(model.weight.detach().numpy()[ids], [[0.0, 0.0], [1.0, 1.0]])
    model(torch.as_tensor([0, 3, 0])).sum().backward()
    pushed, grads = backend.read_row_gradients(model, "weight")
    assert pushed.tolist() == [3] and grads.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float64),  # not float32: rows go in through torch's index_copy_, not a numpy view
        pytest.param(
            "cuda", torch.float32, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
        ),
    ],
)
def test_rows_in_and_gradients_out_off_the_numpy_path(backend: TorchBackend, device: str, dtype: torch.dtype) -> None:
    model = nn.Embedding(8, 2, sparse=True).to(device=device, dtype=dtype)
    rows = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    rows.flags.writeable = False  # as psdk hands them over
    backend.write_rows(model, "weight", np.array([2, 5], np.int64), rows)
    np.testing.assert_array_equal(model.weight.detach().cpu().numpy()[[2, 5]], rows)
    (
        model(torch.tensor([5, 2, 5], device=device)) * torch.tensor([1.0, 10.0], device=device, dtype=dtype)
    ).sum().backward()
    ids, grads = backend.read_row_gradients(model, "weight")
    assert ids.dtype == np.int64 and grads.dtype == np.float32  # one row per lookup: psdk sums duplicates
    assert ids.tolist() == [5, 2, 5] and grads.tolist() == [[1.0, 10.0], [1.0, 10.0], [1.0, 10.0]]
