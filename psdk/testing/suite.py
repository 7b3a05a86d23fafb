"""What the bridge and trainer conformance suites share: batches, weights, the trainer to load, the fixtures."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import pytest

from psdk import plugins
from psdk.plugins.backend import Backend
from psdk.plugins.batches import Batch
from psdk.plugins.hookspecs import ModelRecord
from psdk.plugins.models import ModelSpec, init_weights
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Rows
from psdk.protocol.sharding import flat_size, layout, views
from psdk.protocol.tables import TableSpec
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

# Frameworks that listing plugins must never import, whichever plugin is tested.
KNOWN_FRAMEWORKS = ("jax", "keras", "tensorflow", "torch")
MAPPED_RULES: dict[str, UpdateRule] = {
    "sgd": SGD(lr=0.1),
    "momentum": SGD(lr=0.05, momentum=0.9),
    "nesterov-l2": SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": Adam(lr=0.001),
    "adam-options": Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
    "adam-tf-epsilon": Adam(lr=0.001, eps=1e-7, epsilon_mode="tf"),
    "adagrad": Adagrad(lr=0.1, initial_accumulator_value=0.1, weight_decay=1e-4),
    "rmsprop": RMSProp(lr=0.01),
    "rmsprop-centered": RMSProp(lr=0.01, alpha=0.9, centered=True),
    "rmsprop-momentum": RMSProp(lr=0.01, momentum=0.9, weight_decay=1e-4),
    "rmsprop-centered-momentum": RMSProp(lr=0.001, momentum=0.5, centered=True, eps=1e-7),
    "exponential-decay": SGD(lr=0.1, momentum=0.9, decay_rate=0.5, decay_steps=100),
    "cosine-decay": Adam(lr=0.001, decay="cosine", decay_rate=0.0, decay_steps=6000),
}
"""Every built-in rule, plain and with each of its options: what make_optimizer/optimizer_rule must round-trip."""

DENSE_MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(name="conformance", hidden=(32, 16), input_dim=50, num_classes=10),
    "softmax": ModelSpec(name="softmax", hidden=(), input_dim=50, num_classes=10),
}
"""psdk's built-in dense stacks, small: two hidden layers (a mistake between layers shows) and none (softmax
regression, one layer, no ReLU). Every bridge builds them; the first is what single-model checks build."""


def random_batch(spec: ModelSpec, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` random inputs of ``spec`` and labels, from ``seed``: the batches every backend is held to."""
    rng = np.random.default_rng(seed)
    return rng.random((size, spec.input_dim), dtype=np.float32), rng.integers(0, spec.num_classes, size)


def mnist_batch(spec: ModelSpec, size: int, seed: int) -> Batch:
    """:func:`random_batch` as the MNIST workload's :class:`~psdk.plugins.batches.Batch`: ``image`` and labels."""
    from psdk.workloads.mnist.trainers import IMAGE

    x, y = random_batch(spec, size, seed)
    return Batch({IMAGE: x}, y)


def ctr_models() -> dict[str, Any]:
    """The ``ctr`` workload's DLRM, small: one bottom and one top hidden layer, and two of each (a mistake
    between layers shows). Its table is a couple of thousand ids, so that a batch repeats ids."""
    from psdk.workloads.ctr.model import DlrmSpec

    return {
        "dlrm": DlrmSpec(dim=8, capacity=2000, bottom=(16,), top=(16,)),
        "dlrm-deep": DlrmSpec(dim=4, capacity=2000, bottom=(8, 8), top=(16, 8)),
    }


def ctr_batch(spec: Any, size: int, seed: int) -> Batch:
    """``size`` examples of the ``ctr`` workload's generated log from ``seed``, ids hashed into the spec's table:
    a vocabulary of a few hundred, so that ids repeat within a batch and across its fields."""
    from psdk.workloads.ctr.data import ClickLog

    return ClickLog(seed=seed, vocab=300, capacity=int(spec.capacity)).batch(0, seed, 0, size)


def spec_tables(spec: Any) -> dict[str, Rows]:
    """The embedding tables ``spec`` declares (``tables()``, as :class:`~psdk.workloads.ctr.model.DlrmSpec`)."""
    tables = getattr(spec, "tables", None)
    return dict(tables()) if callable(tables) else {}


def pulled_rows(table: str, rows: Rows, ids: np.ndarray, seed: int) -> np.ndarray:
    """The rows a ps would send for ``ids``: read-only float32, a function of (seed, table, id) only, as a
    :class:`~psdk.ps.tables.table.RowTable` draws them, at a scale (0.3) that makes their products count."""
    from psdk.ps.tables.hashing import initial_rows, table_key

    drawn = initial_rows(np.asarray(ids, np.int64), rows.dim, table_key(seed, table), "normal", 0.3)
    drawn.flags.writeable = False
    return drawn


def write_batch_rows(bridge: Backend, model: Any, spec: Any, batch: Batch, seed: int) -> None:
    """What a worker does before a step: each table's unique ids of ``batch``, increasing, and their rows."""
    tables = spec_tables(spec)
    for name, ids in (batch.ids or {}).items():
        unique = ids.unique()
        bridge.write_rows(model, name, unique, pulled_rows(name, tables[name], unique, seed))


def _row_gradients(bridge: Backend, model: Any, spec: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each table's row gradients of the last backward pass, duplicates summed as psdk's client sums them."""
    from psdk.client.rows import sum_duplicates

    out = {}
    for name, rows in spec_tables(spec).items():
        ids, grads = bridge.read_row_gradients(model, name)
        ids, grads = sum_duplicates(TableSpec(name, rows.dim, rows.capacity), ids, grads)
        out[name] = (np.array(ids), np.array(grads))
    return out


def load_trainer(workload: str, bridge: Backend) -> Trainer:
    """The trainer ``workload`` names for ``bridge``'s framework, made on it as a job makes it."""
    records = plugins.installed_workloads()
    assert workload in records, f"no workload {workload!r} among {sorted(records)}"
    record, framework = records[workload], bridge.record.framework
    target = record.trainer(framework)
    assert target is not None, (
        f"workload {workload!r} has no trainer for {framework} (the {bridge.name} backend); "
        f"it has trainers for {sorted(record.trainers)}: register one with psdk_register_trainers"
    )
    cls = plugins.load_target(target, f"the {framework} trainer of workload {workload!r}")
    assert isinstance(cls, type) and issubclass(cls, Trainer), f"{target} is no psdk.plugins.trainer.Trainer"
    return cls(bridge, dict(record.options))


def _random_weights(spec: Any, seed: int) -> dict[str, np.ndarray]:
    """Weights no backend would start from: every bias non-zero, so a dropped bias shows."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, shape in spec.variables()}


def _plugin_spec(record: ModelRecord) -> Any:
    """The spec of a model a plugin registered, with its defaults (as ``model=<name>`` alone gives it)."""
    cls = plugins.load_target(record.target, f"the spec of model {record.name!r}")
    named = dataclasses.is_dataclass(cls) and any(f.name == "name" for f in dataclasses.fields(cls))
    return cls(name=record.name) if named else cls()


def _initial_weights(spec: Any, seed: int) -> dict[str, np.ndarray]:
    made = getattr(spec, "init_weights", None)
    return dict(made(seed)) if callable(made) else init_weights(spec, seed)


def _flat_views(spec: Any) -> dict[str, np.ndarray]:
    """Zeroed gradient buffers shaped as the ps client hands them out: views of one flat array."""
    specs = layout([(name, tuple(shape)) for name, shape in spec.variables()])
    return views(np.zeros(flat_size(specs), np.float32), specs)


def _gradients(bridge: Backend, model: Any, spec: Any) -> dict[str, np.ndarray]:
    """What ``bridge`` reads back of ``model``'s last backward pass, into psdk's buffers."""
    out = _flat_views(spec)
    bridge.read_gradients(model, out)
    return {name: view.copy() for name, view in out.items()}


class _Suite:
    """What both suites share: the plugin under test, the reference beside it, and the batches."""

    backend_name: ClassVar[str]
    """The name the backend is registered under (``backend=`` in a job)."""
    reference_backend: ClassVar[str] = "numpy"
    """The bridge the reference runs on, with the workload's trainer for its framework."""
    grad_rtol: ClassVar[float] = 1e-4
    grad_atol: ClassVar[float] = 1e-6

    @property
    def trained_workload(self) -> str:
        """The workload whose trainer the checks run (the suite's ``workload`` or ``trainer_workload``)."""
        raise NotImplementedError

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One test per model for checks that take one; pytest calls a test class's own hook for its tests only."""
        if "dense_model" in metafunc.fixturenames:
            metafunc.parametrize("dense_model", list(DENSE_MODELS))
        if "model_name" in metafunc.fixturenames:
            specs = getattr(self, "model_specs", None)
            metafunc.parametrize("model_name", list(specs() if callable(specs) else DENSE_MODELS))

    def make_batch(self, spec: Any, size: int, seed: int) -> Batch:
        """``size`` examples for ``spec`` from ``seed``, as the workload's shard would give them (MNIST's, ctr's)."""
        if self.trained_workload == "ctr":
            return ctr_batch(spec, size, seed)
        if self.trained_workload != "mnist":
            raise NotImplementedError(
                f"the suite makes the batches of mnist and ctr only: override make_batch for workload "
                f"{self.trained_workload!r}"
            )
        return mnist_batch(spec, size, seed)

    # -------------------------------------------------------------- fixtures
    @pytest.fixture
    def backend(self) -> Backend:
        return plugins.load_backend(self.backend_name)

    @pytest.fixture
    def reference(self) -> Backend:
        return plugins.load_backend(self.reference_backend)

    @pytest.fixture
    def trainer(self, backend: Backend) -> Trainer:
        return load_trainer(self.trained_workload, backend)

    @pytest.fixture
    def reference_trainer(self, reference: Backend) -> Trainer:
        return load_trainer(self.trained_workload, reference)
