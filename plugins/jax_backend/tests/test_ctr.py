"""The click-through workload's JAX trainer, held to the workload's numpy DLRM run in float64.

The reference is :mod:`psdk.workloads.ctr.model`'s forward and backward pass
on float64 copies of the same weights and rows; the trainer's loss, dense
gradients (read into canonical views by the bridge), row gradients (summed
per id as psdk's client sums them) and logits are each compared with an
atol and an rtol, so any of them can be wrong and be caught.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from psdk_jax import plugin
from psdk_jax.backend import JaxBackend
from psdk_jax.ctr import ClickStack, JaxCtr

from psdk import plugins
from psdk.client.rows import sum_duplicates
from psdk.errors import ConfigError, PluginError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.hookspecs import TrainerRecord
from psdk.plugins.variables import Dense, Rows
from psdk.protocol.tables import TableSpec
from psdk.testing.ctr import CONTRACT, random_weights, table_rows
from psdk.testing.jobs import run_job
from psdk.workloads.ctr.data import FIELDS, ClickLog
from psdk.workloads.ctr.model import DlrmSpec, backward, forward

pytestmark = pytest.mark.timeout(60)

SPEC = DlrmSpec(capacity=4096)


def click_batch(size: int, seed: int, spec: DlrmSpec = SPEC, vocab: int = 300) -> Batch:
    """The workload's own batch; a small vocabulary, so that ids repeat within and across fields."""
    return ClickLog(seed=seed, vocab=vocab, capacity=spec.capacity).batch(0, seed, 0, size)


def reference(spec: DlrmSpec, weights: dict[str, np.ndarray], table: np.ndarray, batch: Batch) -> dict[str, Any]:
    """Loss, dense gradients, row gradients summed per id and logits, in float64 numpy."""
    w = {name: value.astype(np.float64) for name, value in weights.items()}
    cat, y = batch.inputs["cat"], batch.targets.astype(np.float64)
    fwd = forward(spec, w, batch.inputs["dense"].astype(np.float64), table.astype(np.float64)[cat])
    z = fwd.logits
    grads = {name: np.zeros_like(value) for name, value in w.items()}
    d_rows = backward(spec, w, grads, fwd, (1.0 / (1.0 + np.exp(-z)) - y) / len(y))
    ids, where = np.unique(cat.reshape(-1), return_inverse=True)
    rows = np.zeros((len(ids), spec.dim))
    np.add.at(rows, where, d_rows.reshape(-1, spec.dim))
    loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    return {"loss": loss, "grads": grads, "ids": ids, "rows": rows, "logits": z}


@pytest.fixture
def backend() -> JaxBackend:
    made = plugins.load_backend("jax")
    assert isinstance(made, JaxBackend)
    return made


@pytest.fixture
def trainer(backend: JaxBackend) -> JaxCtr:
    return JaxCtr(backend)


def built(trainer: JaxCtr, spec: DlrmSpec, seed: int) -> tuple[ClickStack, dict[str, np.ndarray], np.ndarray]:
    """A model holding random weights and, for every id, a random row written as the ps writes it (read-only)."""
    weights, table = random_weights(spec, seed), table_rows(spec.capacity, seed, spec.dim)
    model = trainer.build_model(spec, weights)
    rows = table.copy()
    rows.flags.writeable = False
    trainer.bridge.write_rows(model, "emb", np.arange(spec.capacity, dtype=np.int64), rows)
    return model, weights, table


def test_the_plugin_gives_ctr_its_jax_trainer() -> None:
    assert TrainerRecord("ctr", "jax", "psdk_jax.ctr:JaxCtr") in plugin.psdk_register_trainers()
    assert plugins.installed_workloads()["ctr"].trainer("jax") == "psdk_jax.ctr:JaxCtr"


def test_it_refuses_a_bridge_of_another_framework() -> None:
    with pytest.raises(PluginError, match=r"JaxCtr trains on the jax backend .*not on .*NumpyBackend"):
        JaxCtr(NumpyBackend())  # type: ignore[arg-type]  # the mistake it refuses


def test_its_variables_are_the_contracts(backend: JaxBackend, trainer: JaxCtr) -> None:
    model = trainer.build_model(SPEC, random_weights(SPEC, 0))
    assert list(backend.variables(model).items()) == list(CONTRACT.items())
    records = backend.variable_records(model)
    assert records == {**{name: Dense(shape) for name, shape in CONTRACT.items()}, "emb": SPEC.tables()["emb"]}
    weights = random_weights(SPEC, 1)
    backend.write_weights(model, weights)
    for name, value in backend.read_weights(model).items():  # no transposes: kernels are (in, out) here too
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradients_rows_and_logits_match_the_float64_reference(
    backend: JaxBackend, trainer: JaxCtr, seed: int
) -> None:
    model, weights, table = built(trainer, SPEC, seed)
    data = click_batch(256, seed)
    expected = reference(SPEC, weights, table, data)

    loss = trainer.forward_backward(model, data)
    assert isinstance(loss, float) and loss == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)

    grads = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, grads)
    for name, grad in grads.items():
        wanted = expected["grads"][name]
        assert np.abs(wanted).max() > 1e-4, name  # a gradient that could be wrong
        np.testing.assert_allclose(grad, wanted, rtol=1e-4, atol=1e-5 * np.abs(wanted).max(), err_msg=name)

    ids, rows = backend.read_row_gradients(model, "emb")
    assert ids.dtype == np.int64 and rows.dtype == np.float32
    np.testing.assert_array_equal(ids, expected["ids"])  # each id once, in order: nothing for psdk to sort or sum
    assert len(ids) < FIELDS * len(data)  # duplicates were there to sum
    scale = np.abs(expected["rows"]).max()
    np.testing.assert_allclose(rows, expected["rows"], rtol=1e-4, atol=1e-5 * scale)

    bare = Batch(data.inputs, data.targets)  # no ids of its own: one row per (example, field), summed by psdk
    trainer.forward_backward(model, bare)
    raw_ids, raw_rows = backend.read_row_gradients(model, "emb")
    assert raw_rows.shape == (FIELDS * len(data), SPEC.dim)
    summed_ids, summed = sum_duplicates(TableSpec("emb", SPEC.dim, SPEC.capacity), raw_ids, raw_rows)
    np.testing.assert_array_equal(summed_ids, expected["ids"])
    np.testing.assert_allclose(summed, expected["rows"], rtol=1e-4, atol=1e-5 * scale)

    logits = trainer.predictions(model, data, size=100)  # three slices, the last one short
    assert logits.dtype == np.float32 and logits.shape == (256,)
    scale = np.abs(expected["logits"]).max()
    np.testing.assert_allclose(logits, expected["logits"], rtol=1e-4, atol=1e-5 * scale)


def test_the_forward_reads_the_rows_write_rows_wrote(backend: JaxBackend, trainer: JaxCtr) -> None:
    """Rows written later replace those of their ids only, and the next forward pass reads them."""
    model, weights, table = built(trainer, SPEC, 2)
    data = click_batch(64, 2)
    before = trainer.predict(model, data)
    changed = np.unique(data.inputs["cat"][:, :3])  # the ids of the first three fields
    fresh = np.random.default_rng(9).normal(0, 0.5, (len(changed), SPEC.dim)).astype(np.float32)
    fresh.flags.writeable = False  # as the ps's rows arrive
    backend.write_rows(model, "emb", changed, fresh)
    table[changed] = fresh
    after = trainer.predict(model, data)
    assert np.abs(after - before).max() > 1e-3  # the new rows changed the logits
    np.testing.assert_allclose(after, reference(SPEC, weights, table, data)["logits"], rtol=1e-4, atol=1e-5)


class CountingStack(ClickStack):
    """Counts how often JAX traces ``apply``: once per compiled shape."""

    traces = 0

    def apply(self, params: Any, x: Any) -> Any:
        CountingStack.traces += 1
        return super().apply(params, x)


def test_batches_with_different_unique_ids_share_one_compiled_step(backend: JaxBackend) -> None:
    """The step takes [B * 26, dim] rows: a batch's number of unique ids, which varies, compiles nothing new."""
    spec = DlrmSpec(capacity=100_000)
    model = CountingStack(spec, random_weights(spec, 3), backend.device_handle(), precision="highest")
    trainer = JaxCtr(backend)
    uniques = set()
    for seed, vocab in ((3, 300), (4, 5000), (5, 100_000)):
        data = click_batch(128, seed, spec, vocab)
        uniques.add(len(data.ids["emb"].unique()))
        trainer.forward_backward(model, data)
    assert len(uniques) == 3 and CountingStack.traces == 1


def test_a_ten_million_row_table_maps_no_memory_until_rows_arrive(backend: JaxBackend, trainer: JaxCtr) -> None:
    """The local rows are np.zeros: 640 MB of table, of which only the rows written and read take pages."""
    spec = DlrmSpec(capacity=10_000_000)
    before = resident_mb()
    model = trainer.build_model(spec, random_weights(spec, 6))
    data = click_batch(256, 6, spec, vocab=spec.capacity)
    ids = data.ids["emb"].unique()
    backend.write_rows(model, "emb", ids, np.full((len(ids), spec.dim), 0.1, np.float32))
    trainer.forward_backward(model, data)
    assert set(backend.read_row_gradients(model, "emb")[0].tolist()) == set(ids.tolist())
    grown = resident_mb() - before
    assert grown < 100, f"building and training a 10M x 16 table took {grown:.0f} MB resident"


def test_a_batch_of_no_examples_steps_and_predicts_as_on_torch_and_tensorflow(
    backend: JaxBackend, trainer: JaxCtr
) -> None:
    """A batch of no examples (a worker's share of a small set, an empty slice) is no error: as torch's and
    TensorFlow's ctr trainers do, its loss is the mean of nothing (NaN), its dense gradients zeros (not the last
    step's), its row gradients none, and its logits an empty float32 array; the next batch trains as before."""
    model, _, _ = built(trainer, SPEC, 8)  # its weights still pending: the first step loads them
    empty = click_batch(0, 8)
    assert empty.inputs["cat"].shape == (0, FIELDS) and len(empty.ids["emb"].values) == 0
    for data in (empty, Batch(empty.inputs, empty.targets)):  # its own (jagged) ids, then a row per lookup
        assert np.isnan(trainer.forward_backward(model, data))
        grads = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
        backend.read_gradients(model, grads)
        for name, grad in grads.items():
            np.testing.assert_array_equal(grad, 0.0, err_msg=name)
        ids, rows = backend.read_row_gradients(model, "emb")
        assert ids.dtype == np.int64 and ids.shape == (0,)
        assert rows.dtype == np.float32 and rows.shape == (0, SPEC.dim)
        assert np.isfinite(trainer.forward_backward(model, click_batch(16, 9)))  # leaves gradients to replace
    logits = trainer.predict(model, empty)
    assert logits.dtype == np.float32 and logits.shape == (0,)
    assert trainer.predictions(model, empty, size=100).shape == (0,)


def test_a_spec_that_does_not_fit_is_refused_by_name(trainer: JaxCtr) -> None:
    class Narrow(DlrmSpec):
        def tables(self) -> dict[str, Rows]:
            return {"emb": Rows(dim=8, capacity=10)}

    class Elsewhere(DlrmSpec):
        def tables(self) -> dict[str, Rows]:
            return {"users": Rows(dim=16, capacity=10)}

    class Uneven(DlrmSpec):
        @property
        def interactions(self) -> int:
            return 352  # the dot products of no number of fields

    weights = random_weights(SPEC, 0)
    with pytest.raises(ConfigError, match=r"top0 takes 368 inputs: not the bottom output \(16\) plus the dot"):
        trainer.build_model(Uneven(), random_weights(Uneven(), 0))
    with pytest.raises(ConfigError, match=r"bottom MLP's output \(16\) meets the rows of table 'emb' \(8 wide\)"):
        trainer.build_model(Narrow(), weights)
    with pytest.raises(PluginError, match=r"needs the spec's table 'emb': Elsewhere.tables\(\) gives no psdk.Rows"):
        trainer.build_model(Elsewhere(), weights)
    model, _, _ = built(trainer, SPEC, 7)
    data = click_batch(8, 7)
    narrow = Batch({"dense": data.inputs["dense"], "cat": data.inputs["cat"][:, :20]}, data.targets)
    with pytest.raises(ConfigError, match=r"a batch of 20 categorical fields .* but top0 takes 367"):
        trainer.forward_backward(model, narrow)
    none = Batch({"dense": data.inputs["dense"][:0], "cat": data.inputs["cat"][:0, :20]}, data.targets[:0])
    with pytest.raises(ConfigError, match=r"a batch of 20 categorical fields .* but top0 takes 367"):
        trainer.predict(model, none)  # no rows to count: its ids' fields are refused
    with pytest.raises(ConfigError, match=r"takes 26 rows of 'emb' per example .* got 160 rows for 8 examples"):
        model.outputs(data.inputs["dense"], ids={"emb": data.inputs["cat"][:, :20].reshape(-1)})


@pytest.mark.timeout(90)
def test_a_short_ctr_job_on_jax_learns(tmp_path: Path) -> None:
    """``python -m psdk run workload=ctr backend=jax``: a JAX worker, rows pulled per batch, AUC above chance."""
    summary, stdout = run_job(
        tmp_path, "workload=ctr", "backend=jax", "topology.num_workers=1", "train.batch_size=256",
        "model.capacity=100000", "workload.vocab=10000", "workload.test_size=4000", "workload.validation_size=0",
        "train.validate_every=0", "train.steps=200", "train.log_every=50", "report.plot=false", timeout_s=80,
    )  # fmt: skip
    assert summary["backend"] == "jax" and {w["backend"] for w in summary["workers"].values()} == {"jax"}
    metrics = summary["metrics"]
    assert metrics["auc"] > 0.6, metrics  # chance is 0.5; 200 steps reach about 0.66, as on numpy
    assert metrics["logloss"] < 0.6 and metrics["auc"] < metrics["best_auc"]
    assert summary["tables"]["emb"]["created"] > 1000
    points = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(p.get("loss") is not None for p in points), stdout


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")
