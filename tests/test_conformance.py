"""The conformance suites plugins subclass: they pass on the numpy reference, fail on broken bridges and trainers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from psdk.plugins.backends.numpy_backend import NumpyBackend, NumpyModel
from psdk.plugins.backends.numpy_tables import NumpyTableModel
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Rows, Variable
from psdk.testing import BackendConformance, BridgeConformance, TrainerConformance
from psdk.workloads.ctr.data import TABLE
from psdk.workloads.ctr.trainers import NumpyDlrm
from psdk.workloads.mnist.trainers import NumpyClassifier

pytestmark = pytest.mark.timeout(120)


class TestNumpyBridge(BridgeConformance):
    backend_name = "numpy"


class TestNumpyMnistTrainer(TrainerConformance):
    backend_name = "numpy"


class TestNumpyCtrTrainer(TrainerConformance):
    """The ctr workload's own reference through the suite's table path (rows written, row gradients summed)."""

    backend_name = "numpy"
    workload = "ctr"


BRIDGE, TRAINER, CTR = TestNumpyBridge(), TestNumpyMnistTrainer(), TestNumpyCtrTrainer()


def checks_of(cls: type) -> set[str]:
    return {name for name in dir(cls) if name.startswith("test_")}


def test_backend_conformance_is_both_suites_and_neither_hides_a_check_of_the_other() -> None:
    assert issubclass(BackendConformance, BridgeConformance) and issubclass(BackendConformance, TrainerConformance)
    assert checks_of(BridgeConformance).isdisjoint(checks_of(TrainerConformance))
    assert checks_of(BackendConformance) == checks_of(BridgeConformance) | checks_of(TrainerConformance)
    assert BackendConformance.workload == BackendConformance.trainer_workload == "mnist"


# ------------------------------------------------------------ broken bridges
class TransposedKernels(NumpyBackend):
    """Reports kernels (out, in), as torch's nn.Linear stores them."""

    def variables(self, model: NumpyModel) -> dict[str, tuple[int, ...]]:
        return {n: s[::-1] if n.endswith("kernel") else s for n, s in super().variables(model).items()}


class SharedWeights(NumpyBackend):
    """Keeps the caller's arrays instead of copying them."""

    def write_weights(self, model: NumpyModel, weights: Mapping[str, np.ndarray]) -> None:
        model.params = dict(weights)

    def read_weights(self, model: NumpyModel) -> dict[str, np.ndarray]:
        return dict(model.params)


class SummedGradients(NumpyBackend):
    """Sums the batch's gradients where psdk means them (the loss is a mean)."""

    def read_gradients(self, model: NumpyModel, out: Mapping[str, np.ndarray]) -> None:
        super().read_gradients(model, out)
        for view in out.values():
            view *= 64


class TableBiases(NumpyBackend):
    """Declares its biases as tables of rows: not what a dense stack holds."""

    def variable_records(self, model: NumpyModel) -> dict[str, Variable]:
        records = super().variable_records(model)
        return {n: Rows(dim=1, capacity=16) if n.endswith("bias") else v for n, v in records.items()}


def test_the_bridge_suite_catches_kernels_in_another_layout() -> None:
    with pytest.raises(AssertionError):
        BRIDGE.test_variables_are_the_specs_in_order_and_shape(TransposedKernels())


def test_the_bridge_suite_catches_variables_of_the_wrong_kind() -> None:
    BRIDGE.test_its_variable_records_are_dense_with_the_same_shapes(NumpyBackend())
    with pytest.raises(AssertionError, match="bias"):
        BRIDGE.test_its_variable_records_are_dense_with_the_same_shapes(TableBiases())


def test_the_bridge_suite_catches_a_backend_that_keeps_the_callers_arrays() -> None:
    with pytest.raises(AssertionError):
        BRIDGE.test_weights_round_trip_through_the_canonical_layout(SharedWeights())


def test_the_bridge_suite_catches_wrong_gradients() -> None:
    reference = NumpyBackend()
    broken = SummedGradients()
    with pytest.raises(AssertionError):
        BRIDGE.test_gradients_read_back_as_the_reference_computes_them(
            broken, reference, NumpyClassifier(broken), NumpyClassifier(reference), "mlp"
        )


# ----------------------------------------------------------- broken trainers
class AccumulatingClassifier(NumpyClassifier):
    """Adds each pass's gradients to the last's, as torch does without ``zero_grad``."""

    def forward_backward(self, model: NumpyModel, batch: Batch) -> float:
        before = model.grad_flat.copy()
        loss = super().forward_backward(model, batch)
        model.grad_flat += before
        return loss


class BackwardInPredict(NumpyClassifier):
    """Runs a backward pass when asked to predict, overwriting the gradients a push is about to read."""

    def predict(self, model: NumpyModel, batch: Batch) -> np.ndarray:
        self.forward_backward(model, batch)
        return super().predict(model, batch)


class Probabilities(NumpyClassifier):
    """Predicts softmax probabilities where MNIST's trainers return logits: the same answers, other numbers."""

    def predict(self, model: NumpyModel, batch: Batch) -> np.ndarray:
        logits = super().predict(model, batch)
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        return exp / exp.sum(axis=1, keepdims=True)


class ShiftedClasses(NumpyClassifier):
    """Predicts each class's logits in the next class's column: every answer off by one."""

    def predict(self, model: NumpyModel, batch: Batch) -> np.ndarray:
        return np.roll(super().predict(model, batch), 1, axis=1)


def trainers(broken: type[NumpyClassifier]) -> tuple[NumpyBackend, NumpyBackend, NumpyClassifier, NumpyClassifier]:
    backend, reference = NumpyBackend(), NumpyBackend()
    return backend, reference, broken(backend), NumpyClassifier(reference)


def test_the_trainer_suite_catches_gradients_summed_over_passes() -> None:
    TRAINER.test_forward_backward_replaces_the_last_gradients(*trainers(NumpyClassifier))
    with pytest.raises(AssertionError):
        TRAINER.test_forward_backward_replaces_the_last_gradients(*trainers(AccumulatingClassifier))


def test_the_trainer_suite_catches_a_predict_that_changes_the_gradients() -> None:
    backend, _, trainer, _ = trainers(BackwardInPredict)
    with pytest.raises(AssertionError, match="predicting changed the gradient"):
        TRAINER.test_predicting_changes_no_gradient_and_no_weight(backend, trainer)


def test_the_trainer_suite_catches_predictions_that_are_not_the_references() -> None:
    _, _, trainer, reference_trainer = trainers(Probabilities)
    with pytest.raises(AssertionError):
        TRAINER.test_its_predictions_match_the_reference(trainer, reference_trainer, "mlp")
    TRAINER.test_its_score_equals_the_references(trainer, reference_trainer)  # the same answers: the same accuracy


def test_the_trainer_suite_catches_a_score_that_is_not_the_references() -> None:
    _, _, trainer, reference_trainer = trainers(ShiftedClasses)
    with pytest.raises(AssertionError, match="accuracy"):
        TRAINER.test_its_score_equals_the_references(trainer, reference_trainer)


def test_a_workload_other_than_mnist_is_told_to_give_its_batches() -> None:
    class OtherWorkload(TrainerConformance):
        backend_name = "numpy"
        workload = "regression"

    with pytest.raises(NotImplementedError, match="override make_batch for workload 'regression'"):
        OtherWorkload().make_batch(ModelSpec(input_dim=4, num_classes=2), 8, 0)


# ------------------------------------------------------- broken ctr trainers
class FirstOccurrenceOnly(NumpyDlrm):
    """Keeps one gradient row per id, its first occurrence's, as if the batch's ids were unique: a duplicate's
    gradient is dropped where psdk sums them."""

    def forward_backward(self, model: NumpyTableModel, batch: Batch) -> float:
        loss = super().forward_backward(model, batch)
        ids, rows = model.row_grads[TABLE]
        _, first = np.unique(ids, return_index=True)
        model.row_grads[TABLE] = (ids[first], rows[first])
        return loss


class OwnRows(NumpyDlrm):
    """Looks ids up in rows it drew itself when built, never in the rows the ps sent (``write_rows``)."""

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> NumpyTableModel:
        model = super().build_model(spec, weights)
        own = np.random.default_rng(0).normal(0, 0.3, model.rows[TABLE].shape).astype(np.float32)
        model.lookup = lambda table, ids: own[np.asarray(ids)]  # type: ignore[method-assign]
        return model


def ctr_trainers(broken: type[NumpyDlrm]) -> tuple[NumpyBackend, NumpyBackend, NumpyDlrm, NumpyDlrm]:
    backend, reference = NumpyBackend(), NumpyBackend()
    return backend, reference, broken(backend), NumpyDlrm(reference)


def test_the_ctr_suite_catches_a_trainer_that_drops_duplicate_ids_gradients() -> None:
    CTR.test_its_loss_and_gradients_match_the_reference(*ctr_trainers(NumpyDlrm), "dlrm")
    with pytest.raises(AssertionError, match="table emb's rows"):
        CTR.test_its_loss_and_gradients_match_the_reference(*ctr_trainers(FirstOccurrenceOnly), "dlrm")
    with pytest.raises(AssertionError, match="table emb's rows"):
        CTR.test_forward_backward_replaces_the_last_gradients(*ctr_trainers(FirstOccurrenceOnly))


def test_the_ctr_suite_catches_a_trainer_that_ignores_the_rows_written() -> None:
    with pytest.raises(AssertionError):
        CTR.test_its_loss_and_gradients_match_the_reference(*ctr_trainers(OwnRows), "dlrm")
    _, _, trainer, reference_trainer = ctr_trainers(OwnRows)
    with pytest.raises(AssertionError):
        CTR.test_its_predictions_match_the_reference(trainer, reference_trainer, "dlrm")


def test_the_ctr_suite_has_its_models_and_batches_with_repeated_ids() -> None:
    specs = CTR.model_specs()
    assert set(specs) == {"dlrm", "dlrm-deep"} and all(TABLE in spec.tables() for spec in specs.values())
    batch = CTR.make_batch(CTR.first_model(), 64, 0)
    ids = batch.ids[TABLE]
    assert len(ids.unique()) < len(ids.values) == 64 * 26  # duplicates, for the suite to see them summed
