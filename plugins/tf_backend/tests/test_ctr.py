"""The click-through workload's TensorFlow trainer, held to the workload's float64 numpy DLRM, and a short job on it.

The reference is :mod:`psdk.workloads.ctr.model`'s forward and backward
pass, run in float64: the trainer's loss, dense gradients (read into
canonical views by the bridge), row gradients (one per lookup, under the
batch's ids) and logits can each be wrong and be caught. The model keeps
only the rows the ps sent (:mod:`psdk_tf.pulled_rows`), which the tests of
what it holds check, a ten-million-row table included.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from psdk_tf import plugin
from psdk_tf.backend import TfBackend
from psdk_tf.ctr import ClickModel, TfCtr
from psdk_tf.pulled_rows import PulledRows

from psdk import plugins
from psdk.client.rows import sum_duplicates
from psdk.errors import ConfigError, PluginError, PsdkError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.batches import Batch
from psdk.plugins.hookspecs import TrainerRecord
from psdk.plugins.variables import Dense, Rows
from psdk.protocol.tables import TableSpec
from psdk.testing.ctr import CONTRACT, click_batch, random_weights, table_rows
from psdk.testing.jobs import run_job
from psdk.workloads.ctr.model import DlrmSpec, backward, forward

pytestmark = pytest.mark.timeout(60)

SPEC = DlrmSpec(capacity=4096)


class Narrow(DlrmSpec):
    """A spec whose table is narrower than the bottom MLP's output: refused by name."""

    def tables(self) -> dict[str, Rows]:
        return {"emb": Rows(dim=8, capacity=10)}


class Users(DlrmSpec):
    """A spec whose table is not called ``emb``."""

    def tables(self) -> dict[str, Rows]:
        return {"users": Rows(dim=16, capacity=10)}


@pytest.fixture
def trainer(backend: TfBackend) -> TfCtr:
    return TfCtr(backend)


def built(trainer: TfCtr, seed: int) -> tuple[ClickModel, dict[str, np.ndarray], np.ndarray]:
    """A model holding random weights and, for every id, a random row written as the ps would write it."""
    weights, table = random_weights(SPEC, seed), table_rows(SPEC.capacity, seed)
    model = trainer.build_model(SPEC, weights)
    trainer.bridge.write_rows(model, "emb", np.arange(SPEC.capacity, dtype=np.int64), table)
    return model, weights, table


def close(actual: np.ndarray, wanted: np.ndarray, name: str = "") -> None:
    """float32 arithmetic against float64: 1e-4 relative, plus 1e-5 of the largest value."""
    np.testing.assert_allclose(actual, wanted, rtol=1e-4, atol=1e-5 * np.abs(wanted).max(), err_msg=name)


def test_the_plugin_gives_ctr_its_tf_trainer() -> None:
    assert TrainerRecord("ctr", "tensorflow", "psdk_tf.ctr:TfCtr") in plugin.psdk_register_trainers()
    assert plugins.load_target("psdk_tf.ctr:TfCtr", "the tf trainer") is TfCtr
    assert plugins.installed_workloads()["ctr"].trainer("tensorflow") == "psdk_tf.ctr:TfCtr"


def test_it_refuses_a_bridge_of_another_framework() -> None:
    with pytest.raises(PluginError, match=r"TfCtr trains on the tf backend .*not on .*NumpyBackend"):
        TfCtr(NumpyBackend())  # type: ignore[arg-type]  # the mistake it refuses


def test_its_variables_are_the_contracts(backend: TfBackend, trainer: TfCtr) -> None:
    model = trainer.build_model(SPEC, random_weights(SPEC, 0))
    assert list(backend.variables(model).items()) == list(CONTRACT.items()) == SPEC.variables()
    records = backend.variable_records(model)
    assert records == {**{name: Dense(shape) for name, shape in CONTRACT.items()}, "emb": SPEC.tables()["emb"]}
    weights = random_weights(SPEC, 1)
    backend.write_weights(model, weights)
    read = backend.read_weights(model)
    assert list(read) == list(CONTRACT)
    for name, value in weights.items():  # no transposes on the way: kernels are (in, out) here too
        np.testing.assert_array_equal(read[name], value, err_msg=name)
    with pytest.raises(PsdkError, match=r"'emb' is an embedding table: its rows travel by id"):
        backend.write_weights(model, {"emb": np.zeros((4096, 16), np.float32)})
    with pytest.raises(PsdkError, match=r"no embedding table 'users'; its tables are \['emb'\]"):
        backend.write_rows(model, "users", np.zeros(1, np.int64), np.zeros((1, 16), np.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradients_rows_and_logits_match_the_float64_reference(
    backend: TfBackend, trainer: TfCtr, seed: int
) -> None:
    model, weights, table = built(trainer, seed)
    data = click_batch(256, seed)
    cat, y = data.inputs["cat"], data.targets.astype(np.float64)
    w64 = {name: value.astype(np.float64) for name, value in weights.items()}
    fwd = forward(SPEC, w64, data.inputs["dense"].astype(np.float64), table.astype(np.float64)[cat])
    z = fwd.logits
    wanted_loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    grads64 = {name: np.zeros(shape) for name, shape in SPEC.variables()}
    d_rows = backward(SPEC, w64, grads64, fwd, (1.0 / (1.0 + np.exp(-z)) - y) / len(y))

    loss = trainer.forward_backward(model, data)
    assert loss == pytest.approx(wanted_loss, rel=1e-5, abs=1e-6)

    grads = {name: np.full(shape, np.nan, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, grads)
    for name, grad in grads.items():
        assert np.abs(grads64[name]).max() > 1e-4, name  # a gradient that could be wrong
        close(grad, grads64[name], name)

    ids, rows = backend.read_row_gradients(model, "emb")
    assert ids.dtype == np.int64 and rows.dtype == np.float32
    distinct, where = np.unique(cat.reshape(-1), return_inverse=True)
    assert len(distinct) < cat.size  # the batch repeats ids: their lookups' gradients must be summed
    summed = np.zeros((len(distinct), 16))
    np.add.at(summed, where, d_rows.reshape(-1, 16))
    np.testing.assert_array_equal(ids, distinct)  # each id once, in order: nothing for psdk to sort or sum
    close(rows, summed, "rows")

    logits = trainer.predictions(model, data, size=100)  # three slices, the last one short
    assert logits.dtype == np.float32 and logits.shape == (256,)
    close(logits, z, "logits")


def test_row_gradients_are_summed_per_id_whether_or_not_the_batch_names_its_ids(
    backend: TfBackend, trainer: TfCtr
) -> None:
    """A batch's own ids (sorted once per batch) or none, whose ids are found from its input: the same rows."""
    model, _, _ = built(trainer, 3)
    data = click_batch(128, 3)
    trainer.forward_backward(model, data)
    ids, rows = backend.read_row_gradients(model, "emb")
    trainer.forward_backward(model, Batch(data.inputs, data.targets))  # no ids: found from the "cat" input
    bare_ids, bare_rows = backend.read_row_gradients(model, "emb")
    np.testing.assert_array_equal(ids, np.unique(data.inputs["cat"]))
    np.testing.assert_array_equal(bare_ids, ids)
    np.testing.assert_allclose(bare_rows, rows, rtol=1e-6, atol=1e-9)


def test_the_forward_reads_the_rows_written_since_the_last_step(backend: TfBackend, trainer: TfCtr) -> None:
    """Writes between steps add up (later rows of an id win); the first write after a step starts afresh."""
    model, weights, table = built(trainer, 2)
    data = click_batch(64, 2)
    cat = data.inputs["cat"]
    np.testing.assert_array_equal(model.rows.gather(cat), table[cat])
    before = trainer.predict(model, data)

    changed = np.unique(cat[:, :3])  # the ids of the first three fields
    fresh = np.random.default_rng(9).normal(0, 0.5, (len(changed), 16)).astype(np.float32)
    fresh.flags.writeable = False  # as the ps's rows arrive
    backend.write_rows(model, "emb", changed, fresh)
    table[changed] = fresh
    after = trainer.predict(model, data)
    assert np.abs(after - before).max() > 1e-3  # the new rows changed the logits
    w64 = {name: value.astype(np.float64) for name, value in weights.items()}
    close(after, forward(SPEC, w64, data.inputs["dense"].astype(np.float64), table.astype(np.float64)[cat]).logits)
    assert model.rows.held == SPEC.capacity

    trainer.forward_backward(model, data)  # a step: the next write brings the next batch's rows
    assert model.rows.held == SPEC.capacity  # kept until then (a step may be repeated)
    backend.write_rows(model, "emb", changed[:5], fresh[:5])
    assert model.rows.held == 5
    np.testing.assert_array_equal(model.rows.gather(changed[:5]), fresh[:5])
    np.testing.assert_array_equal(model.rows.gather(changed[5:]), 0.0)  # no longer held: zeros, as the ps's unseen


def test_pulled_rows_merge_writes_and_refuse_bad_ones() -> None:
    rows = PulledRows("emb", 2, 100)
    np.testing.assert_array_equal(rows.gather(np.array([[3, 7]])), np.zeros((1, 2, 2)))  # nothing written
    rows.write(np.array([5, 9]), np.array([[1, 1], [2, 2]], np.float32))
    rows.write(np.array([1, 9, 50]), np.array([[3, 3], [4, 4], [5, 5]], np.float32))
    assert rows.held == 4
    got = rows.gather(np.array([[9, 1], [5, 6], [99, 50]]))
    np.testing.assert_array_equal(got, [[[4, 4], [3, 3]], [[1, 1], [0, 0]], [[0, 0], [5, 5]]])
    distinct = np.array([1, 5, 9, 50])  # the held ids: the held rows themselves, no copy
    assert np.shares_memory(rows.rows_of(distinct), rows.rows_of(distinct))  # two calls, one held array: no copy
    np.testing.assert_array_equal(rows.rows_of(distinct), [[3, 3], [1, 1], [4, 4], [5, 5]])
    np.testing.assert_array_equal(rows.rows_of(np.array([0, 5, 50, 99])), [[0, 0], [1, 1], [5, 5], [0, 0]])
    np.testing.assert_array_equal(PulledRows("emb", 2, 100).rows_of(np.array([3, 4])), np.zeros((2, 2)))
    with pytest.raises(PsdkError, match=r"table 'emb': ids must be in \[0, 100\), got 3 .. 100"):
        rows.write(np.array([3, 100]), np.zeros((2, 2), np.float32))
    with pytest.raises(PsdkError, match=r"got rows of shape \(1, 3\) for 1 ids of width 2"):
        rows.write(np.array([3]), np.zeros((1, 3), np.float32))


def test_a_second_step_starts_from_fresh_gradients(backend: TfBackend, trainer: TfCtr) -> None:
    """Two steps on one batch leave one step's gradients, dense and rows, not twice them."""
    model, _, _ = built(trainer, 3)
    first, second = click_batch(128, 3), click_batch(128, 4)
    trainer.forward_backward(model, first)
    once = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, once)
    ids_once, rows_once = backend.read_row_gradients(model, "emb")
    trainer.forward_backward(model, second)
    trainer.predict(model, click_batch(32, 5))  # predictions change no gradient
    trainer.forward_backward(model, first)
    twice = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    backend.read_gradients(model, twice)
    ids, rows = backend.read_row_gradients(model, "emb")
    for name, grad in twice.items():
        np.testing.assert_allclose(grad, once[name], rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(ids, ids_once)
    np.testing.assert_allclose(rows, rows_once, rtol=1e-6, atol=1e-7)


def test_one_trace_serves_every_batch(trainer: TfCtr, tmp_path: Path) -> None:
    """Batches of other sizes, other counts of distinct ids and read-only (memory-mapped) inputs retrace nothing."""
    model, _, _ = built(trainer, 5)
    for size, vocab in [(32, 300), (7, 4096), (100, 20)]:
        trainer.forward_backward(model, click_batch(size, size, vocab))
        trainer.predict(model, click_batch(size, size, vocab))
    data = click_batch(32, 5)
    inputs = {}
    for name, array in data.inputs.items():
        np.save(tmp_path / f"{name}.npy", array)
        inputs[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    mapped = Batch(inputs, data.targets, data.ids)
    assert trainer.forward_backward(model, mapped) == pytest.approx(trainer.forward_backward(model, data), rel=1e-6)
    assert model._step.experimental_get_tracing_count() == 1
    assert model._logits.experimental_get_tracing_count() == 1


def test_a_ten_million_row_table_costs_only_the_rows_written(backend: TfBackend, trainer: TfCtr) -> None:
    """No capacity x dim variable: 640 MB of table, of which the model holds the rows the ps sent."""
    spec = DlrmSpec(capacity=10_000_000)
    before = resident_mb()
    model = trainer.build_model(spec, random_weights(spec, 6))
    data = click_batch(256, 6, vocab=spec.capacity)
    ids = data.ids["emb"].unique()
    backend.write_rows(model, "emb", ids, np.full((len(ids), 16), 0.1, np.float32))
    trainer.forward_backward(model, data)
    assert set(backend.read_row_gradients(model, "emb")[0].tolist()) == set(ids.tolist())
    assert model.rows.held == len(ids) and backend.variable_records(model)["emb"] == Rows(16, 10_000_000)
    grown = resident_mb() - before
    assert grown < 100, f"building and training a 10M x 16 table took {grown:.0f} MB resident"


def test_a_spec_that_does_not_fit_is_refused_by_name(trainer: TfCtr) -> None:
    with pytest.raises(ConfigError, match=r"bottom MLP's output \(16\) meets the rows of table 'emb' \(8 wide\)"):
        trainer.build_model(Narrow(), random_weights(SPEC, 0))
    with pytest.raises(PluginError, match=r"needs the spec's table 'emb': Users.tables\(\) gives no psdk.Rows named"):
        trainer.build_model(Users(), random_weights(SPEC, 0))
    model, _, _ = built(trainer, 7)
    data = click_batch(8, 7)
    narrow = Batch({"dense": data.inputs["dense"], "cat": data.inputs["cat"][:, :20]}, data.targets)
    with pytest.raises(ConfigError, match=r"a batch of 20 categorical fields is not what top0 takes \(367 inputs"):
        trainer.forward_backward(model, narrow)


def test_time_one_step_at_batch_1024(trainer: TfCtr, capsys: pytest.CaptureFixture[str]) -> None:
    """Printed, never asserted: the machine is shared, and this process's TensorFlow threads are its default."""
    spec = DlrmSpec(capacity=1_000_000)
    model = trainer.build_model(spec, random_weights(spec, 8))
    data = click_batch(1024, 8, vocab=spec.capacity)
    ids = data.ids["emb"].unique()
    trainer.bridge.write_rows(model, "emb", ids, table_rows(len(ids), 8))
    wall, cpu = [], []
    for _ in range(8):
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.forward_backward(model, data)
        sum_duplicates(TableSpec("emb", 16, capacity=spec.capacity), *trainer.bridge.read_row_gradients(model, "emb"))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    with capsys.disabled():
        print(
            f"\nctr on TensorFlow, batch 1024: forward+backward+row gradients, summed per id as pushed "
            f"{statistics.median(wall[2:]) * 1e3:.1f} ms wall, {statistics.median(cpu[2:]) * 1e3:.1f} ms CPU "
            f"(median of 6)"
        )


@pytest.mark.timeout(200)  # 45-70 s on 2 loaded cores, most of it TensorFlow's import in each process
def test_a_short_ctr_job_on_tensorflow_learns(tmp_path: Path) -> None:
    summary, stdout = run_job(
        tmp_path, "workload=ctr", "backend=tf", "topology.num_workers=1", "train.batch_size=256",
        "model.capacity=100000", "workload.vocab=10000", "workload.test_size=5000", "workload.validation_size=0",
        "train.validate_every=0", "train.log_every=50", "train.steps=150", timeout_s=190,
    )  # fmt: skip
    assert summary["backend"] == "tf" and summary["model"] == "dlrm"
    metrics = summary["metrics"]
    assert 0.6 < metrics["auc"] < metrics["best_auc"], metrics  # chance is 0.5; the numpy trainer's 200 steps: 0.66
    assert metrics["logloss"] < 0.6
    assert 1000 < summary["tables"]["emb"]["created"] <= 100_000
    assert "psdk done: backend=tf model=dlrm" in stdout and "table emb:" in stdout


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")
