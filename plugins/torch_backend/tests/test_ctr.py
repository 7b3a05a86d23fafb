"""The click-through workload's torch trainer, held to a float64 numpy DLRM written here from the workload's contract.

The contract (issue 36): dense [B, 13] through the bottom MLP (ReLU after
each layer); the 27 vectors ``[bottom output, rows of the 26 fields]``; their
dot products ``i < j`` in ``np.triu_indices(27, 1)`` order; the top MLP over
``[bottom output, dots]`` (ReLU between) to a logit; mean BCE with logits.
The reference below is that, with its gradients by hand, so the trainer's
loss, dense gradients (read into canonical views by the bridge) and row
gradients (duplicates summed) can each be wrong and be caught.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from psdk_torch import plugin
from psdk_torch.backend import TorchBackend
from psdk_torch.ctr import ClickModel, TorchCtr
from psdk_torch.pulled import PulledEmbedding

from psdk import plugins
from psdk.client.rows import sum_duplicates
from psdk.errors import ConfigError, PluginError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.hookspecs import TrainerRecord
from psdk.plugins.variables import Dense, Rows
from psdk.protocol.tables import TableSpec
from psdk.testing.ctr import CONTRACT, click_batch, random_weights, table_rows

pytestmark = pytest.mark.timeout(120)

FIELDS, DENSE = 26, 13


@dataclass(frozen=True)
class Spec:
    """The contract's model spec: dense variables in ``variables()``, the table ``emb`` in ``tables()``."""

    dim: int = 16
    capacity: int = 4096
    bottom: tuple[int, ...] = (64,)
    top: tuple[int, ...] = (64,)
    tables_given: dict[str, Rows] = field(default_factory=dict)

    def layers(self) -> list[tuple[str, int, int]]:
        bottom = [DENSE, *self.bottom, self.dim]
        top = [self.dim + (FIELDS + 1) * FIELDS // 2, *self.top, 1]
        return [(f"bottom{i}", bottom[i], bottom[i + 1]) for i in range(len(bottom) - 1)] + [
            (f"top{i}", top[i], top[i + 1]) for i in range(len(top) - 1)
        ]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    def tables(self) -> dict[str, Rows]:
        return self.tables_given or {"emb": Rows(dim=self.dim, capacity=self.capacity)}


SPEC = Spec()


@dataclass
class Reference:
    loss: float
    logits: np.ndarray
    grads: dict[str, np.ndarray]
    row_ids: np.ndarray
    row_grads: np.ndarray


def reference(weights: dict[str, np.ndarray], table: np.ndarray, batch: Batch) -> Reference:
    """The contract's forward pass and its gradients, in float64 numpy."""
    w = {name: value.astype(np.float64) for name, value in weights.items()}
    x, cat, y = batch.inputs["dense"].astype(np.float64), batch.inputs["cat"], batch.targets.astype(np.float64)
    n_bottom = sum(1 for name in w if re.fullmatch(r"bottom\d+/kernel", name))
    n_top = sum(1 for name in w if re.fullmatch(r"top\d+/kernel", name))
    bottom = [x]
    for i in range(n_bottom):
        bottom.append(np.maximum(bottom[-1] @ w[f"bottom{i}/kernel"] + w[f"bottom{i}/bias"], 0.0))
    z = bottom[-1]
    vectors = np.concatenate([z[:, None, :], table.astype(np.float64)[cat]], axis=1)  # [B, 27, dim]
    upper = np.triu_indices(FIELDS + 1, 1)
    dots = (vectors @ vectors.transpose(0, 2, 1))[:, upper[0], upper[1]]
    top = [np.concatenate([z, dots], axis=1)]
    for i in range(n_top):
        h = top[-1] @ w[f"top{i}/kernel"] + w[f"top{i}/bias"]
        top.append(np.maximum(h, 0.0) if i < n_top - 1 else h)
    logits = top[-1][:, 0]
    loss = float(np.mean(np.logaddexp(0.0, logits) - y * logits))

    grads: dict[str, np.ndarray] = {}
    d = ((1.0 / (1.0 + np.exp(-logits)) - y) / len(y))[:, None]
    for i in reversed(range(n_top)):
        if i < n_top - 1:
            d = d * (top[i + 1] > 0)
        grads[f"top{i}/kernel"], grads[f"top{i}/bias"] = top[i].T @ d, d.sum(axis=0)
        d = d @ w[f"top{i}/kernel"].T
    dim = z.shape[1]
    d_gram = np.zeros((len(y), FIELDS + 1, FIELDS + 1))
    d_gram[:, upper[0], upper[1]] = d[:, dim:]
    d_vectors = (d_gram + d_gram.transpose(0, 2, 1)) @ vectors
    d = d[:, :dim] + d_vectors[:, 0]
    for i in reversed(range(n_bottom)):
        d = d * (bottom[i + 1] > 0)
        grads[f"bottom{i}/kernel"], grads[f"bottom{i}/bias"] = bottom[i].T @ d, d.sum(axis=0)
        d = d @ w[f"bottom{i}/kernel"].T
    row_ids, where = np.unique(cat.reshape(-1), return_inverse=True)
    row_grads = np.zeros((len(row_ids), dim))
    np.add.at(row_grads, where, d_vectors[:, 1:].reshape(-1, dim))  # duplicates summed
    return Reference(loss, logits, grads, row_ids, row_grads)


@pytest.fixture
def trainer(backend: TorchBackend) -> TorchCtr:
    return TorchCtr(backend)


def built(trainer: TorchCtr, spec: Spec, seed: int) -> tuple[ClickModel, dict[str, np.ndarray], np.ndarray]:
    """A model holding random weights and, for every id, a random row written as the ps would write it."""
    weights, table = random_weights(spec, seed), table_rows(spec.capacity, seed, spec.dim)
    model = trainer.build_model(spec, weights)
    trainer.bridge.write_rows(model, "emb", np.arange(spec.capacity, dtype=np.int64), table)
    return model, weights, table


def test_the_plugin_gives_ctr_its_torch_trainer() -> None:
    assert TrainerRecord("ctr", "torch", "psdk_torch.ctr:TorchCtr") in plugin.psdk_register_trainers()
    assert plugins.load_target("psdk_torch.ctr:TorchCtr", "the torch trainer") is TorchCtr
    workloads = plugins.installed_workloads()
    if "ctr" in workloads:  # once psdk's ctr workload is installed, this is the trainer it gets for torch
        assert workloads["ctr"].trainer("torch") == "psdk_torch.ctr:TorchCtr"


def test_it_refuses_a_bridge_of_another_framework() -> None:
    with pytest.raises(PluginError, match=r"TorchCtr trains on the torch backend .*not on .*NumpyBackend"):
        TorchCtr(NumpyBackend())  # type: ignore[arg-type]  # the mistake it refuses


def test_its_variables_are_the_contracts(backend: TorchBackend, trainer: TorchCtr) -> None:
    weights0 = random_weights(SPEC, 0)
    model = trainer.build_model(SPEC, weights0)
    assert list(backend.variables(model).items()) == list(CONTRACT.items()) == SPEC.variables()
    records = backend.variable_records(model)
    assert records == {**{name: Dense(shape) for name, shape in CONTRACT.items()}, "emb": Rows(16, 4096)}
    assert isinstance(model.emb, PulledEmbedding)
    scaled = Rows(dim=16, capacity=4096, initializer="uniform", init_scale=0.05)  # as the spec says, not torch's
    assert backend.variable_records(trainer.build_model(Spec(tables_given={"emb": scaled}), weights0))["emb"] == scaled
    weights = random_weights(SPEC, 1)
    backend.write_weights(model, weights)
    read = backend.read_weights(model)
    for name, value in weights.items():  # no transposes on the way: kernels are (in, out) in torch too
        np.testing.assert_array_equal(read[name], value, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradients_rows_and_predictions_match_the_reference(
    backend: TorchBackend, trainer: TorchCtr, seed: int
) -> None:
    model, weights, table = built(trainer, SPEC, seed)
    data = click_batch(256, seed)
    expected = reference(weights, table, data)

    loss = trainer.forward_backward(model, data)
    assert loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)

    grads = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, grads)
    for name, grad in grads.items():
        wanted = expected.grads[name]
        assert np.abs(wanted).max() > 1e-4, name  # a gradient that could be wrong
        np.testing.assert_allclose(grad, wanted, rtol=1e-4, atol=1e-5 * np.abs(wanted).max(), err_msg=name)

    raw_ids, raw_rows = backend.read_row_gradients(model, "emb")
    assert raw_ids.dtype == np.int64 and raw_rows.dtype == np.float32
    ids, rows = sum_duplicates(TableSpec("emb", SPEC.dim, SPEC.capacity), raw_ids, raw_rows)  # as the client does
    np.testing.assert_array_equal(ids, expected.row_ids)
    assert len(ids) < FIELDS * len(data)
    scale = np.abs(expected.row_grads).max()
    np.testing.assert_allclose(rows, expected.row_grads, rtol=1e-4, atol=1e-5 * scale)

    logits = trainer.predictions(model, data, size=100)  # three slices, the last one short
    assert logits.dtype == np.float32 and logits.shape == (256,)
    np.testing.assert_allclose(logits, expected.logits, rtol=1e-4, atol=1e-5 * np.abs(expected.logits).max())


def test_the_forward_reads_the_rows_write_rows_wrote(backend: TorchBackend, trainer: TorchCtr) -> None:
    """After a lookup a write replaces the rows held; writes in a row add up, a later row of an id replacing
    the earlier one; the next forward pass reads them."""
    model, weights, table = built(trainer, SPEC, 2)
    data = click_batch(64, 2)
    cat = data.inputs["cat"]
    np.testing.assert_array_equal(model.emb(torch.from_numpy(cat)).detach().numpy(), table[cat])
    before = trainer.predict(model, data)

    changed = np.unique(cat[:, :3])  # the ids of the first three fields
    fresh = np.random.default_rng(9).normal(0, 0.5, (len(changed), SPEC.dim)).astype(np.float32)
    fresh.flags.writeable = False  # as the ps's rows arrive
    backend.write_rows(model, "emb", np.arange(SPEC.capacity, dtype=np.int64), table)
    backend.write_rows(model, "emb", changed, fresh)
    table[changed] = fresh
    after = trainer.predict(model, data)
    assert np.abs(after - before).max() > 1e-3  # the new rows changed the logits
    np.testing.assert_allclose(after, reference(weights, table, data).logits, rtol=1e-4, atol=1e-5)


def test_a_second_step_starts_from_fresh_gradients(backend: TorchBackend, trainer: TorchCtr) -> None:
    """Two steps on one batch leave one step's gradients, dense and rows, not twice them."""
    model, _, _ = built(trainer, SPEC, 3)
    first, second = click_batch(128, 3), click_batch(128, 4)
    trainer.forward_backward(model, first)
    once = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, once)
    ids_once, rows_once = backend.read_row_gradients(model, "emb")
    trainer.forward_backward(model, second)
    trainer.forward_backward(model, first)
    twice = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, twice)
    ids, rows = backend.read_row_gradients(model, "emb")
    for name, grad in twice.items():
        np.testing.assert_allclose(grad, once[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(ids, ids_once)
    np.testing.assert_allclose(rows, rows_once, rtol=1e-6, atol=1e-7)


def test_read_only_inputs_train_as_memory_mapped_data_would(trainer: TorchCtr, tmp_path: Path) -> None:
    model, _, _ = built(trainer, SPEC, 5)
    data = click_batch(32, 5)
    inputs = {}
    for name, array in data.inputs.items():
        np.save(tmp_path / f"{name}.npy", array)
        inputs[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    mapped = Batch(inputs, data.targets, data.ids)
    assert trainer.forward_backward(model, mapped) == pytest.approx(trainer.forward_backward(model, data), rel=1e-6)


def test_a_ten_million_row_table_maps_no_memory_until_rows_arrive(backend: TorchBackend, trainer: TorchCtr) -> None:
    """The table holds the rows written only: 640 MB of table, of which a batch's rows take memory."""
    spec = Spec(capacity=10_000_000)
    before = resident_mb()
    model = trainer.build_model(spec, random_weights(spec, 6))
    data = click_batch(256, 6, vocab=spec.capacity)
    ids = data.ids["emb"].unique()
    backend.write_rows(model, "emb", ids, np.full((len(ids), spec.dim), 0.1, np.float32))
    trainer.forward_backward(model, data)
    assert set(backend.read_row_gradients(model, "emb")[0].tolist()) == set(ids.tolist())
    grown = resident_mb() - before
    assert grown < 100, f"building and training a 10M x 16 table took {grown:.0f} MB resident"


def test_a_spec_that_does_not_fit_is_refused_by_name(trainer: TorchCtr) -> None:
    with pytest.raises(ConfigError, match=r"bottom MLP's output \(16\) meets the rows of table 'emb' \(8 wide\)"):
        trainer.build_model(Spec(tables_given={"emb": Rows(dim=8, capacity=10)}), random_weights(SPEC, 0))
    with pytest.raises(PluginError, match=r"needs the spec's table 'emb': Spec.tables\(\) gives no psdk.Rows named"):
        trainer.build_model(Spec(tables_given={"users": Rows(dim=16, capacity=10)}), random_weights(SPEC, 0))
    model, _, _ = built(trainer, SPEC, 7)
    data = click_batch(8, 7)
    narrow = Batch({"dense": data.inputs["dense"], "cat": data.inputs["cat"][:, :20]}, data.targets)
    with pytest.raises(ConfigError, match=r"a batch of 20 categorical fields .* but top0 takes 367"):
        trainer.forward_backward(model, narrow)


def test_time_one_step_at_batch_1024(trainer: TorchCtr, capsys: pytest.CaptureFixture[str]) -> None:
    """Printed, never asserted: the machine is shared. One torch thread, as the recipe's job sets (then restored)."""
    spec = Spec(capacity=1_000_000)
    model = trainer.build_model(spec, random_weights(spec, 8))
    data = click_batch(1024, 8, vocab=spec.capacity)
    ids = data.ids["emb"].unique()
    trainer.bridge.write_rows(model, "emb", ids, table_rows(len(ids), 8))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wall, cpu = [], []
        for _ in range(8):
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.forward_backward(model, data)
            trainer.bridge.read_row_gradients(model, "emb")
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(
            f"\nctr on torch, batch 1024, 1 thread: forward+backward+row gradients "
            f"{statistics.median(wall[2:]) * 1e3:.1f} ms wall, {statistics.median(cpu[2:]) * 1e3:.1f} ms CPU "
            f"(median of 6)"
        )


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")
