"""The trainer conformance suite: what a workload's trainer must do on a framework (:mod:`psdk.testing.conformance`).

A workload whose model has embedding tables (``ctr``: its spec's
``tables()``) is held to the reference through the path a worker takes:
before each batch, the rows of its unique ids are written with
``write_rows`` (drawn from the seed and the id, as a ps's table draws them,
read-only as they arrive); after the backward pass, the row gradients
``read_row_gradients`` gives are summed per id as psdk's client sums them
and compared, beside the loss, the dense gradients and the predictions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

from psdk import plugins
from psdk.plugins.backend import Backend
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer

# Frameworks that listing plugins must never import, whichever plugin is tested.
from psdk.testing.suite import (
    DENSE_MODELS,
    _gradients,
    _initial_weights,
    _random_weights,
    _row_gradients,
    _Suite,
    ctr_models,
    load_trainer,
    write_batch_rows,
)


class TrainerConformance(_Suite):
    """A workload's trainer for one framework, held to the workload's trainer on the numpy bridge."""

    workload: ClassVar[str] = "mnist"
    """The workload whose trainer for the backend's framework is tested (``mnist`` or ``ctr`` as they are)."""
    models: ClassVar[Mapping[str, Any] | None] = None
    """The models the trainer must build and train, by test id (specs with ``variables()`` and
    ``init_weights(seed)``, and ``tables()`` for a model with tables); the first is what single-model checks
    build. ``None``: psdk's small ones for ``mnist`` (:data:`DENSE_MODELS`) and ``ctr`` (two DLRMs)."""
    loss_rtol: ClassVar[float] = 1e-5
    loss_atol: ClassVar[float] = 1e-6
    """Added to ``loss_rtol``: the loss (order 1 here) is float32 arithmetic whose last digits differ by CPU."""
    predict_rtol: ClassVar[float] = 1e-4
    predict_atol: ClassVar[float] = 1e-5
    score_atol: ClassVar[float | None] = None
    """The workload's metrics of the trainer's predictions against the reference's. ``None``: 1e-9 for MNIST's
    accuracy (the same decisions, so equal: one answer flipped of 600 would be 1.7e-3); 1e-6 otherwise, as
    ctr's log loss averages float32 logits (2e-8 apart on JAX) and one AUC pair flipped of 600 is 1.5e-5."""
    row_rtol: ClassVar[float] = 1e-4
    row_atol: ClassVar[float] = 1e-6
    """The row gradients summed per id (order 1e-3 here, as the loss is a mean over the batch)."""

    @property
    def trained_workload(self) -> str:
        return self.workload

    def model_specs(self) -> Mapping[str, Any]:
        if self.models is not None:
            return self.models
        if self.workload == "ctr":
            return ctr_models()
        if self.workload != "mnist":
            raise NotImplementedError(f"the suite has no models of workload {self.workload!r}: set models")
        return DENSE_MODELS

    def first_model(self) -> Any:
        return next(iter(self.model_specs().values()))

    def step(self, trainer: Trainer, model: Any, spec: Any, batch: Batch, rows_seed: int) -> float:
        """One worker's step: the rows of the batch's ids written (tables only), then forward and backward."""
        write_batch_rows(trainer.bridge, model, spec, batch, rows_seed)
        return trainer.forward_backward(model, batch)

    def predicted(self, trainer: Trainer, model: Any, spec: Any, batch: Batch, rows_seed: int, size: int = 0) -> Any:
        """An evaluation: the rows of the batch's ids written, then ``predict`` (or ``predictions`` by ``size``)."""
        write_batch_rows(trainer.bridge, model, spec, batch, rows_seed)
        return trainer.predictions(model, batch, size=size) if size else trainer.predict(model, batch)

    def assert_rows_match(self, got: Mapping[str, Any], expected: Mapping[str, Any], what: str = "") -> None:
        """Row gradients summed per id: the same ids, and rows within the tolerances."""
        for name, (ids, rows) in expected.items():
            np.testing.assert_array_equal(got[name][0], ids, err_msg=f"{what}the ids of table {name}'s gradients")
            np.testing.assert_allclose(
                got[name][1], rows, rtol=self.row_rtol, atol=self.row_atol, err_msg=f"{what}table {name}'s rows"
            )

    def scoring_batch(self, batch: Batch, reference_predictions: np.ndarray) -> Batch:
        """``batch`` with targets that make the score telling: for classifier logits, half set to the reference's
        answer, so accuracy is about 0.55 rather than a trivial 0.1. Override for other predictions."""
        if reference_predictions.ndim != 2:
            return batch
        targets = batch.targets.copy()
        targets[::2] = np.argmax(reference_predictions, axis=1)[::2]
        return Batch(batch.inputs, targets, batch.ids)

    def built(self, trainer: Trainer, reference_trainer: Trainer, spec: Any, seed: int) -> tuple[Any, Any]:
        """``spec`` on both sides from the same weights: :func:`init_weights`-drawn but with every bias non-zero."""
        weights = _random_weights(spec, seed)
        return trainer.build_model(spec, weights), reference_trainer.build_model(spec, weights)

    # ---------------------------------------------------------- registration
    def test_its_trainer_is_registered_for_the_backends_framework(self, backend: Backend) -> None:
        """The workload names a trainer for the framework (its own entry or a plugin's TrainerRecord) that imports."""
        trainer = load_trainer(self.workload, backend)
        assert trainer.bridge is backend

    # ----------------------------------------------------------------- models
    def test_its_trainer_builds_each_model(self, trainer: Trainer, backend: Backend, model_name: str) -> None:
        spec = self.model_specs()[model_name]
        weights = _initial_weights(spec, 0)
        model = trainer.build_model(spec, weights)
        assert list(backend.variables(model).items()) == [(name, tuple(shape)) for name, shape in spec.variables()]
        for name, value in backend.read_weights(model).items():
            np.testing.assert_array_equal(value, weights[name], err_msg=name)

    # --------------------------------------------------- loss and gradients
    def test_its_loss_and_gradients_match_the_reference(
        self,
        backend: Backend,
        reference: Backend,
        trainer: Trainer,
        reference_trainer: Trainer,
        model_name: str,
    ) -> None:
        """Loss and gradients (rows' too, summed per id) on the same weights and batch, also after a write of new
        weights and, with tables, of new rows of the same ids (each must reach the next forward pass)."""
        spec = self.model_specs()[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 2)
        for step, weights in enumerate((None, _random_weights(spec, 3))):
            if weights is not None:
                backend.write_weights(model, weights)
                reference.write_weights(ref, weights)
            batch = self.make_batch(spec, 64, step)  # ids repeat across the two: new rows of the same ids
            loss = self.step(trainer, model, spec, batch, step)
            expected_loss = self.step(reference_trainer, ref, spec, batch, step)
            assert isinstance(loss, float), f"forward_backward returned a {type(loss).__name__}, not a float"
            assert loss == pytest.approx(expected_loss, rel=self.loss_rtol, abs=self.loss_atol)
            grads, expected = _gradients(backend, model, spec), _gradients(reference, ref, spec)
            for name in expected:
                np.testing.assert_allclose(
                    grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
                )
            self.assert_rows_match(_row_gradients(backend, model, spec), _row_gradients(reference, ref, spec))

    def test_forward_backward_replaces_the_last_gradients(
        self, backend: Backend, reference: Backend, trainer: Trainer, reference_trainer: Trainer
    ) -> None:
        """A pass leaves its own batch's gradients, not a sum with the last pass's (the trainer zeroes them)."""
        spec = self.first_model()
        model, ref = self.built(trainer, reference_trainer, spec, 5)
        first, second = self.make_batch(spec, 32, 20), self.make_batch(spec, 32, 21)
        self.step(trainer, model, spec, first, 20)
        self.step(trainer, model, spec, second, 21)
        once, rows_once = _gradients(backend, model, spec), _row_gradients(backend, model, spec)
        trainer.forward_backward(model, second)
        again, rows_again = _gradients(backend, model, spec), _row_gradients(backend, model, spec)
        self.step(reference_trainer, ref, spec, second, 21)
        expected = _gradients(reference, ref, spec)
        self.assert_rows_match(rows_once, _row_gradients(reference, ref, spec))
        self.assert_rows_match(rows_again, rows_once, "a second pass: ")
        for name in expected:
            np.testing.assert_allclose(
                once[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
            )
            np.testing.assert_allclose(again[name], once[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name)

    # ------------------------------------------------------------ predictions
    def test_its_predictions_match_the_reference(
        self, trainer: Trainer, reference_trainer: Trainer, model_name: str
    ) -> None:
        """``predict`` gives numpy as the reference's, and ``predictions`` in slices joins to the same."""
        spec = self.model_specs()[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 4)
        batch = self.make_batch(spec, 50, 6)
        expected = np.asarray(self.predicted(reference_trainer, ref, spec, batch, 6))
        got = self.predicted(trainer, model, spec, batch, 6)
        assert isinstance(got, np.ndarray), f"predict returned a {type(got).__name__}, not numpy"
        assert got.shape == expected.shape, f"predictions of shape {got.shape}, the reference's {expected.shape}"
        np.testing.assert_allclose(got, expected, rtol=self.predict_rtol, atol=self.predict_atol)
        np.testing.assert_allclose(
            trainer.predictions(model, batch, size=16), expected, rtol=self.predict_rtol, atol=self.predict_atol
        )

    def test_predicting_changes_no_gradient_and_no_weight(self, backend: Backend, trainer: Trainer) -> None:
        """Predictions between a backward pass and the push must leave what the push reads as it was."""
        spec = self.first_model()
        model = trainer.build_model(spec, _random_weights(spec, 8))
        self.step(trainer, model, spec, self.make_batch(spec, 32, 30), 30)
        grads, weights = _gradients(backend, model, spec), backend.read_weights(model)
        rows = _row_gradients(backend, model, spec)
        self.predicted(trainer, model, spec, self.make_batch(spec, 40, 31), 31, size=16)
        for name, value in _gradients(backend, model, spec).items():
            np.testing.assert_array_equal(value, grads[name], err_msg=f"predicting changed the gradient of {name}")
        self.assert_rows_match(_row_gradients(backend, model, spec), rows, "predicting changed the gradient: ")
        for name, value in backend.read_weights(model).items():
            np.testing.assert_array_equal(value, weights[name], err_msg=f"predicting changed {name}")

    def test_its_score_equals_the_references(self, trainer: Trainer, reference_trainer: Trainer) -> None:
        """The workload's ``score`` of the trainer's predictions: the reference's, every metric."""
        record = plugins.installed_workloads()[self.workload]
        assert record.score, f"workload {self.workload!r} names no score entry"
        score = plugins.load_target(record.score, f"the score of workload {self.workload!r}")
        spec = self.first_model()
        model, ref = self.built(trainer, reference_trainer, spec, 9)
        batch = self.make_batch(spec, 600, 10)
        batch = self.scoring_batch(batch, np.asarray(self.predicted(reference_trainer, ref, spec, batch, 10, 600)))
        expected = score(np.asarray(self.predicted(reference_trainer, ref, spec, batch, 10, 600)), batch)
        got = score(self.predicted(trainer, model, spec, batch, 10, 600), batch)
        assert expected and set(got) == set(expected), f"scored {sorted(got)}, the reference {sorted(expected)}"
        atol = self.score_atol if self.score_atol is not None else 1e-9 if self.workload == "mnist" else 1e-6
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=0, abs=atol), name
