"""The trainer conformance suite: what a workload's trainer must do on a framework (:mod:`psdk.testing.conformance`)."""

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
from psdk.testing.suite import DENSE_MODELS, _gradients, _initial_weights, _random_weights, _Suite, load_trainer


class TrainerConformance(_Suite):
    """A workload's trainer for one framework, held to the workload's trainer on the numpy bridge."""

    workload: ClassVar[str] = "mnist"
    """The workload whose trainer for the backend's framework is tested."""
    models: ClassVar[Mapping[str, Any]] = DENSE_MODELS
    """The models the trainer must build and train, by test id: the workload's own for a workload other than
    MNIST (specs with ``variables()`` and ``init_weights(seed)``); the first is what single-model checks build."""
    loss_rtol: ClassVar[float] = 1e-5
    loss_atol: ClassVar[float] = 1e-6
    """Added to ``loss_rtol``: the loss (order 1 here) is float32 arithmetic whose last digits differ by CPU."""
    predict_rtol: ClassVar[float] = 1e-4
    predict_atol: ClassVar[float] = 1e-5
    score_atol: ClassVar[float] = 1e-9
    """The workload's metrics of the trainer's predictions against the reference's: the same decisions, so
    equal (one MNIST answer flipped of 600 would be 1.7e-3)."""

    @property
    def trained_workload(self) -> str:
        return self.workload

    def first_model(self) -> Any:
        return next(iter(self.models.values()))

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
        spec = self.models[model_name]
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
        """Loss and gradients on the same weights and batch, also after a write of new weights."""
        spec = self.models[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 2)
        for step, weights in enumerate((None, _random_weights(spec, 3))):
            if weights is not None:  # a write must reach the next forward pass
                backend.write_weights(model, weights)
                reference.write_weights(ref, weights)
            batch = self.make_batch(spec, 64, step)
            loss = trainer.forward_backward(model, batch)
            expected_loss = reference_trainer.forward_backward(ref, batch)
            assert isinstance(loss, float), f"forward_backward returned a {type(loss).__name__}, not a float"
            assert loss == pytest.approx(expected_loss, rel=self.loss_rtol, abs=self.loss_atol)
            grads, expected = _gradients(backend, model, spec), _gradients(reference, ref, spec)
            for name in expected:
                np.testing.assert_allclose(
                    grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
                )

    def test_forward_backward_replaces_the_last_gradients(
        self, backend: Backend, reference: Backend, trainer: Trainer, reference_trainer: Trainer
    ) -> None:
        """A pass leaves its own batch's gradients, not a sum with the last pass's (the trainer zeroes them)."""
        spec = self.first_model()
        model, ref = self.built(trainer, reference_trainer, spec, 5)
        first, second = self.make_batch(spec, 32, 20), self.make_batch(spec, 32, 21)
        trainer.forward_backward(model, first)
        trainer.forward_backward(model, second)
        once = _gradients(backend, model, spec)
        trainer.forward_backward(model, second)
        again = _gradients(backend, model, spec)
        reference_trainer.forward_backward(ref, second)
        expected = _gradients(reference, ref, spec)
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
        spec = self.models[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 4)
        batch = self.make_batch(spec, 50, 6)
        expected = np.asarray(reference_trainer.predict(ref, batch))
        got = trainer.predict(model, batch)
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
        trainer.forward_backward(model, self.make_batch(spec, 32, 30))
        grads, weights = _gradients(backend, model, spec), backend.read_weights(model)
        trainer.predictions(model, self.make_batch(spec, 40, 31), size=16)
        for name, value in _gradients(backend, model, spec).items():
            np.testing.assert_array_equal(value, grads[name], err_msg=f"predicting changed the gradient of {name}")
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
        batch = self.scoring_batch(batch, np.asarray(reference_trainer.predictions(ref, batch)))
        expected = score(np.asarray(reference_trainer.predictions(ref, batch)), batch)
        got = score(trainer.predictions(model, batch), batch)
        assert expected and set(got) == set(expected), f"scored {sorted(got)}, the reference {sorted(expected)}"
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=0, abs=self.score_atol), name
