"""Distributed training equals the single-process computation it stands for."""

from __future__ import annotations

import numpy as np
import pytest

from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.ps.rules import SGD, Adam, UpdateRule

from .conftest import running_ps
from .helpers import forward_backward, train_threads

SPEC = ModelSpec(hidden=(32,), input_dim=64, num_classes=10)
RNG = np.random.default_rng(42)
X = RNG.random((50, 2, 20, 64), dtype=np.float32)  # step, worker, batch, features
Y = RNG.integers(0, 10, (50, 2, 20))


def single_process(rule: UpdateRule, steps: int, batch: callable) -> dict[str, np.ndarray]:  # type: ignore[valid-type]
    backend = NumpyBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    state = rule.new_state(model.flat.size)
    for t in range(steps):
        forward_backward(model, *batch(t))
        rule.apply(model.flat, model.grad_flat, state)
    return backend.read_weights(model)


@pytest.mark.parametrize("num_ps", [1, 2])
@pytest.mark.parametrize("sharding", ["round_robin", "greedy"])
def test_sync_with_all_replicas_equals_one_process_on_the_concatenated_batches(num_ps: int, sharding: str) -> None:
    rule = SGD(lr=0.5)
    with running_ps(num_ps) as ps:
        result = train_threads(
            ps.cluster(2),
            ps.transport,
            SPEC,
            rule,
            50,
            lambda w, t: (X[t, w], Y[t, w]),
            sync="sync",
            sharding=sharding,
        )
    expected = single_process(rule, 50, lambda t: (X[t].reshape(-1, 64), Y[t].reshape(-1)))
    assert result["local_steps"] == {0: 50, 1: 50}
    for name, value in expected.items():
        np.testing.assert_allclose(result["params"][name], value, atol=1e-5, rtol=0)
    head = result["stats"][0]["stats"]
    assert (head["applied"], head["updates"], head["dropped"]) == (100, 50, 0)


@pytest.mark.parametrize("rule", [SGD(lr=0.3, momentum=0.9), Adam(lr=0.01)])
def test_async_with_one_worker_equals_one_process(rule: UpdateRule) -> None:
    with running_ps(2) as ps:
        cluster = ps.cluster(1)
        result = train_threads(cluster, ps.transport, SPEC, rule, 40, lambda w, t: (X[t, 0], Y[t, 0]))
    expected = single_process(rule, 40, lambda t: (X[t, 0], Y[t, 0]))
    for name, value in expected.items():
        np.testing.assert_allclose(result["params"][name], value, atol=1e-5, rtol=0)
