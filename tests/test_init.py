"""``model.init``: the initial kernels a TF1 program draws, chosen in the config; Glorot-uniform by default."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from psdk.config import build, config_dir, prepare_hydra
from psdk.config.check import OverrideChecker
from psdk.errors import ConfigError
from psdk.plugins.models import INITIALIZERS, ModelSpec, init_weights

pytestmark = pytest.mark.timeout(60)

SOFTMAX = ModelSpec(name="softmax", hidden=())  # one 784 x 10 kernel: 7,840 draws


def test_the_default_is_glorot_uniform_drawn_exactly_as_before() -> None:
    spec = ModelSpec(hidden=(100,))
    rng = np.random.default_rng(7)
    for name, fan_in, fan_out in spec.layers():
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        expected = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)
        assert np.array_equal(init_weights(spec, 7)[f"{name}/kernel"], expected)
    assert spec.init == "glorot_uniform"


@pytest.mark.parametrize("stddev", [1.0, 0.1])
def test_normal_has_the_stddev_asked_for(stddev: float) -> None:
    kernel = init_weights(ModelSpec(name="softmax", hidden=(), init="normal", init_stddev=stddev), 0)["logits/kernel"]
    assert kernel.dtype == np.float32
    assert abs(float(kernel.mean())) < 0.05 * stddev  # 4 standard errors of 7,840 draws
    assert float(kernel.std()) == pytest.approx(stddev, rel=0.03)
    assert float(np.abs(kernel).max()) > 3 * stddev  # a normal's tails, which the truncated one lacks


def test_normal_without_a_stddev_is_tensorflows_one() -> None:
    kernel = init_weights(ModelSpec(name="softmax", hidden=(), init="normal"), 0)["logits/kernel"]
    assert float(kernel.std()) == pytest.approx(1.0, rel=0.03)


def test_truncated_normal_drops_draws_beyond_two_stddevs() -> None:
    kernel = init_weights(ModelSpec(name="softmax", hidden=(), init="truncated_normal", init_stddev=0.5), 3)
    values = kernel["logits/kernel"]
    assert float(np.abs(values).max()) <= 2 * 0.5 + 1e-6
    # A standard normal cut at +-2 has standard deviation 0.8796.
    assert float(values.std()) == pytest.approx(0.8796 * 0.5, rel=0.03)
    assert abs(float(values.mean())) < 0.05 * 0.5


def test_zeros_are_zeros_and_warn_with_hidden_layers(caplog: pytest.LogCaptureFixture) -> None:
    weights = init_weights(ModelSpec(name="softmax", hidden=(), init="zeros"), 0)
    assert all(not value.any() for value in weights.values())
    with caplog.at_level(logging.WARNING, logger="psdk.plugins.models"):
        init_weights(ModelSpec(hidden=(8,), init="zeros"), 0)
    assert "hidden layers do not learn" in caplog.text


@pytest.mark.parametrize("init", INITIALIZERS)
def test_every_initialiser_is_seeded_and_leaves_biases_at_zero(init: str) -> None:
    spec = ModelSpec(hidden=(16,), input_dim=20, init=init)
    first, again, other = init_weights(spec, 5), init_weights(spec, 5), init_weights(spec, 6)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert init == "zeros" or not np.array_equal(first["hidden1/kernel"], other["hidden1/kernel"])
    assert not first["hidden1/bias"].any() and not first["logits/bias"].any()


def test_the_config_chooses_the_initialiser_per_model() -> None:
    prepare_hydra()
    checker = OverrideChecker(config_dir())
    cfg = checker.composed(["model=softmax", "model.init=normal", "model.init_stddev=1.0"])
    spec = build.model_spec(cfg)
    assert (spec.init, spec.init_stddev) == ("normal", 1.0)
    assert float(spec.init_weights(0)["logits/kernel"].std()) == pytest.approx(1.0, rel=0.03)
    assert build.model_spec(checker.composed([])).init == "glorot_uniform"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"init": "random_normal"}, "model.init: unknown initialiser 'random_normal'; did you mean model.init=normal?"),
        ({"init": "xavier"}, "did you mean model.init=glorot_uniform?"),
        ({"init": "truncated_nromal"}, "did you mean model.init=truncated_normal?"),
        ({"init": "normal", "init_stddev": 0.0}, "model.init_stddev: must be a positive number, got 0.0"),
        ({"init": "normal", "init_stddev": float("nan")}, "model.init_stddev: must be a positive number"),
        ({"init": "truncated_normal", "init_stddev": -1.0}, "must be a positive number, got -1.0"),
        ({"init_stddev": 0.1}, "model.init_stddev: is 0.1, but model.init=glorot_uniform draws no normal"),
        ({"init": "zeros", "init_stddev": 1.0}, "read by model.init=normal or truncated_normal only"),
    ],
)
def test_bad_initialisers_are_refused_naming_the_key(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelSpec(**fields)  # type: ignore[arg-type]
    assert message in str(info.value)
