"""The ``sines`` workload's framework-free parts: its record, data, shards, score, checks and numpy trainer.

No framework and no job here: the trainers of torch, TensorFlow and JAX are
held to the numpy one in ``test_sines_frameworks.py``, and whole jobs run in
``test_sines_job.py``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from psdk_example import sines
from psdk_example.regression_numpy import NumpyRegressor, squared_error
from psdk_example.regressor import RegressorSpec
from psdk_example.sines import INPUTS, SinesOptions

from psdk import ArrayShard, Batch, ShardRequest, plugins
from psdk.config import config_dir, prepare_hydra
from psdk.config.check import OverrideChecker
from psdk.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
SMALL = {"examples": 2_000, "validation_size": 300, "test_size": 500}


def request(task: int = 0, num_workers: int = 1, model: object = None, **options: object) -> ShardRequest:
    return ShardRequest(task, num_workers, data=None, model=model or RegressorSpec(), options={**SMALL, **options})


def test_the_workload_and_its_model_are_registered() -> None:
    record = plugins.installed_workloads()["sines"]
    assert set(record.trainers) == {"psdk", "torch", "tensorflow", "jax"}
    assert [m.name for m in record.metrics] == ["loss", "mse", "r2"]
    mse = next(m for m in record.metrics if m.primary)
    assert mse.name == "mse" and not mse.higher_is_better and mse.target == 0.03
    assert record.options == SinesOptions().as_dict()
    model = plugins.installed_models()["regressor"]
    assert set(model.builders) == {"numpy", "torch", "tf", "jax"}


def test_psdk_plugins_lists_it_and_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "from psdk.launch.cli import main\n"
        "main(['plugins'])\n"
        "print('loaded', sorted(m for m in ('torch', 'tensorflow', 'jax', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    rows = [line.split()[:3] for line in out.stdout.splitlines()]
    assert ["workload", "sines", "psdk-example"] in rows and ["model", "regressor", "psdk-example"] in rows
    assert out.stdout.strip().splitlines()[-1] == "loaded []"


def test_the_data_is_fixed_by_its_seed_and_scaled() -> None:
    options = SinesOptions(**SMALL)
    first, again = sines.generate(options), sines.generate(options)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.inputs[INPUTS], b.inputs[INPUTS]) and np.array_equal(a.targets, b.targets)
    train, validation, test = first
    assert (len(train), len(validation), len(test)) == (2_000, 300, 500)
    assert train.inputs[INPUTS].dtype == np.float32 and train.inputs[INPUTS].shape == (2_000, 8)
    assert train.targets.dtype == np.float32 and train.targets.shape == (2_000,)
    assert abs(float(train.targets.mean())) < 0.1 and 0.85 < float(train.targets.var()) < 1.2  # 1 + noise^2
    other = sines.generate(SinesOptions(**{**SMALL, "seed": 1}))[2]
    assert not np.allclose(other.targets, test.targets)
    bigger = sines.generate(SinesOptions(**{**SMALL, "examples": 4_000}))[2]
    assert np.array_equal(bigger.targets, test.targets)  # more training data: the same function and test set


def test_the_noise_is_what_no_model_can_learn() -> None:
    clean = sines.generate(SinesOptions(**SMALL, noise=0.0))[2]
    noisy = sines.generate(SinesOptions(**SMALL))[2]
    assert np.array_equal(clean.inputs[INPUTS], noisy.inputs[INPUTS])
    assert sines.score(clean.targets, noisy)["mse"] == pytest.approx(0.01, rel=0.2)  # noise 0.1


def test_the_workers_shards_partition_the_training_set() -> None:
    train = sines.generate(SinesOptions(**SMALL))[0]
    shards = [sines.shard(request(task, 3)) for task in range(3)]
    assert all(isinstance(s, ArrayShard) and s.train_size == 2_000 for s in shards)
    joined = np.concatenate([s.train.inputs[INPUTS] for s in shards])
    assert np.array_equal(joined, train.inputs[INPUTS])
    assert [len(s.train) for s in shards] == [666, 667, 667]
    for s in shards[1:]:
        assert s.validation is not None and shards[0].validation is not None
        assert np.array_equal(s.test.targets, shards[0].test.targets)
        assert np.array_equal(s.validation.targets, shards[0].validation.targets)
    batch = next(shards[1].batches(50, seed=0))
    assert len(batch) == 50 and batch.inputs[INPUTS].shape == (50, 8)


def test_the_score_is_mse_and_r2() -> None:
    batch = Batch({INPUTS: np.zeros((4, 2), np.float32)}, np.array([1.0, -1.0, 1.0, -1.0], np.float32))
    assert sines.score(batch.targets, batch) == {"mse": 0.0, "r2": 1.0}
    assert sines.score(np.zeros(4, np.float32), batch) == {"mse": 1.0, "r2": 0.0}
    half = sines.score(np.array([[0.5], [-0.5], [0.5], [-0.5]], np.float32), batch)  # [n, 1] is read as [n]
    assert half["mse"] == pytest.approx(0.25) and half["r2"] == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"noise": -0.1}, "workload.noise"),
        ({"examples": 2.5}, "workload.examples"),
        ({"input_dim": 0}, "workload.input_dim"),
        ({"test_size": True}, "workload.test_size"),
        ({"frequency": float("nan")}, "workload.frequency"),
    ],
)
def test_bad_options_are_refused_by_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        sines.shard(request(**options))
    assert caught.value.key == key


def test_a_model_that_does_not_fit_is_refused_before_a_task_starts() -> None:
    prepare_hydra()  # the schemas and the plugins' choices, as a task has them
    checker = OverrideChecker(config_dir())
    sines.check(checker.composed(["workload=sines", "model=regressor"]))
    with pytest.raises(ConfigError, match=r"model=mlp is no regression model.*use model=regressor") as caught:
        sines.check(checker.composed(["workload=sines"]))
    assert caught.value.key == "model"
    with pytest.raises(ConfigError, match=r"give model\.input_dim=16") as caught:
        sines.check(checker.composed(["workload=sines", "model=regressor", "workload.input_dim=16"]))
    assert caught.value.key == "model.input_dim"
    with pytest.raises(ConfigError, match="predicts one number") as caught:
        sines.check(checker.composed(["workload=sines", "model=regressor", "model.outputs=2"]))
    assert caught.value.key == "model.outputs"
    with pytest.raises(ConfigError, match=r"model\.input_dim"):  # and by each worker, started by hand or not
        sines.shard(request(model=RegressorSpec(input_dim=4)))
    with pytest.raises(ConfigError, match="fewer than the 3 workers"):
        sines.shard(request(num_workers=3, examples=2))


def reference_loss(spec: RegressorSpec, weights: dict[str, np.ndarray], batch: Batch) -> float:
    """The mean squared error in float64, from the spec's own numpy network."""
    weights64 = {name: value.astype(np.float64) for name, value in weights.items()}
    outputs = spec.forward(weights64, batch.inputs[INPUTS].astype(np.float64))
    return float(np.mean((outputs[:, 0] - batch.targets.astype(np.float64)) ** 2))


def test_the_numpy_trainers_gradients_are_the_losss() -> None:
    """Every gradient of the numpy trainer against a central difference of the float64 loss."""
    spec = RegressorSpec(hidden=(12, 6), input_dim=8)
    weights = {name: value + np.float32(0.05) for name, value in spec.init_weights(1).items()}  # non-zero biases
    batch = sines.generate(SinesOptions(**SMALL))[0].take(0, 32)
    bridge = plugins.load_backend("numpy")
    trainer = NumpyRegressor(bridge, {})
    model = trainer.build_model(spec, weights)
    loss = trainer.forward_backward(model, batch)
    assert loss == pytest.approx(reference_loss(spec, weights, batch), rel=1e-5, abs=1e-6)
    grads = {name: np.zeros(shape, np.float32) for name, shape in spec.variables()}
    bridge.read_gradients(model, grads)
    eps = 1e-4
    for name, _ in spec.variables():
        numeric = np.zeros(weights[name].shape)
        for index in np.ndindex(weights[name].shape):
            up = {k: v.astype(np.float64) for k, v in weights.items()}
            down = {k: v.astype(np.float64) for k, v in weights.items()}
            up[name][index] += eps
            down[name][index] -= eps
            numeric[index] = (reference_loss(spec, up, batch) - reference_loss(spec, down, batch)) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-3, atol=1e-5, err_msg=name)
    predicted = trainer.predictions(model, batch, size=10)  # in slices, joined
    assert predicted.dtype == np.float32 and predicted.shape == (32,)
    np.testing.assert_allclose(predicted, spec.forward(weights, batch.inputs[INPUTS])[:, 0], rtol=1e-5, atol=1e-6)


def test_squared_error_gradient_at_the_outputs() -> None:
    loss, d_outputs = squared_error(np.array([[1.0], [3.0]], np.float32), np.array([0.0, 1.0], np.float32))
    assert loss == pytest.approx(2.5) and d_outputs.tolist() == [[1.0], [2.0]]


def test_the_numpy_trainer_learns_the_function() -> None:
    """Plain SGD on one shard, no ps: far below the variance of y (about 1), and far below a linear fit (0.68)."""
    shard = sines.shard(request(examples=20_000, validation_size=1_000, test_size=2_000))
    spec = RegressorSpec()
    bridge = plugins.load_backend("numpy")
    trainer = NumpyRegressor(bridge, {})
    model = trainer.build_model(spec, spec.init_weights(0))
    grads = {name: np.zeros(shape, np.float32) for name, shape in spec.variables()}
    weights = bridge.read_weights(model)
    velocity = {name: np.zeros_like(value) for name, value in weights.items()}
    batches = shard.batches(100, seed=0)
    for _ in range(1_500):
        trainer.forward_backward(model, next(batches))
        bridge.read_gradients(model, grads)
        for name, value in weights.items():
            velocity[name] = 0.9 * velocity[name] + grads[name]
            value -= 0.02 * velocity[name]
        bridge.write_weights(model, weights)
    scored = sines.score(trainer.predictions(model, shard.test), shard.test)
    assert scored["mse"] < 0.1 and scored["r2"] > 0.9, scored
