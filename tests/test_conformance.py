"""The conformance suite plugins subclass: it passes on the numpy reference, fails on broken backends."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from psdk.plugins.backends.numpy_backend import NumpyBackend, NumpyModel
from psdk.plugins.models import ModelSpec
from psdk.testing import BackendConformance


class TestNumpyBackendConformance(BackendConformance):
    backend_name = "numpy"


class TransposedKernels(NumpyBackend):
    """Reports kernels (out, in), as torch's nn.Linear stores them."""

    def variables(self, model: NumpyModel) -> dict[str, tuple[int, ...]]:
        return {n: s[::-1] if n.endswith("kernel") else s for n, s in super().variables(model).items()}


class SharedWeights(NumpyBackend):
    """Keeps the caller's arrays instead of copying them."""

    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> NumpyModel:
        model = super().build_model(spec, weights)
        self.held = model
        return model

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


SUITE = TestNumpyBackendConformance()


def test_the_suite_catches_kernels_in_another_layout() -> None:
    with pytest.raises(AssertionError):
        SUITE.test_variables_are_the_specs_in_order_and_shape(TransposedKernels())


def test_the_suite_catches_a_backend_that_keeps_the_callers_arrays() -> None:
    with pytest.raises(AssertionError):
        SUITE.test_weights_round_trip_through_the_canonical_layout(SharedWeights())


def test_the_suite_catches_wrong_gradients() -> None:
    with pytest.raises(AssertionError):
        SUITE.test_loss_and_gradients_match_the_numpy_reference(SummedGradients(), NumpyBackend())
