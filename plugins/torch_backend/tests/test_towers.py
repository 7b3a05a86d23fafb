"""Towers on torch: CPU replicas prove the arithmetic (two half batches make the whole batch's gradient), and jobs.

On a machine without GPUs the towers are torch CPU replicas (``cpu:0``,
``cpu:1``): each its own tensors, the reduction the one a GPU box runs
(:meth:`TorchBackend.reduce_gradients`), so what is tested is the
arithmetic, never a speed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend
from psdk_torch.mnist import TorchClassifier

from psdk import plugins
from psdk.errors import ConfigError
from psdk.plugins.towers import TowerBridge, Towers, TowerTrainer, in_towers
from psdk.testing.towers import towers_beside_one_without, two_towers_against_one

from .conftest import SPEC, batch

ATOL, RTOL = 1e-6, 1e-5


def towers(count: int = 2) -> tuple[TowerBridge, TowerTrainer, TorchBackend]:
    bridge = plugins.load_backend("torch")
    assert isinstance(bridge, TorchBackend)
    bridge.setup_towers([f"cpu:{k}" for k in range(count)])
    outer, trainer = in_towers(bridge, TorchClassifier(bridge))
    return outer, trainer, bridge


def gradients(bridge: object, model: object) -> dict[str, np.ndarray]:
    out = {n: np.zeros(s, np.float32) for n, s in bridge.variables(model).items()}  # type: ignore[attr-defined]
    bridge.read_gradients(model, out)  # type: ignore[attr-defined]
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("size", "count"), [(64, 2), (33, 2), (10, 3)])
def test_replicas_on_slices_equal_one_device_on_the_whole_batch(
    backend: TorchBackend, trainer: TorchClassifier, size: int, count: int
) -> None:
    backend.setup("cpu")
    weights = SPEC.init_weights(0)
    whole = trainer.build_model(SPEC, weights)
    data = batch(size, seed=1)
    loss = trainer.forward_backward(whole, data)
    expected = gradients(backend, whole)

    outer, tower_trainer, _ = towers(count)
    model = tower_trainer.build_model(SPEC, weights)
    assert isinstance(model, Towers) and len(model) == count
    got_loss = tower_trainer.forward_backward(model, data)
    got = gradients(outer, model)
    assert abs(got_loss - loss) <= ATOL + RTOL * abs(loss)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    assert sum(model.shares) == pytest.approx(1.0)


@pytest.mark.timeout(30)
def test_shared_buffers_on_the_first_tower_still_give_the_whole_batch_gradient(
    backend: TorchBackend, trainer: TorchClassifier
) -> None:
    """On the CPU the first tower's parameters and gradients are psdk's own buffers, as in a job."""
    backend.setup("cpu")
    weights = SPEC.init_weights(0)
    whole = trainer.build_model(SPEC, weights)
    data = batch(50, seed=2)
    trainer.forward_backward(whole, data)
    expected = gradients(backend, whole)

    outer, tower_trainer, _ = towers(2)
    model = tower_trainer.build_model(SPEC, weights)
    params = {n: np.array(v) for n, v in weights.items()}
    pushed = {n: np.zeros_like(v) for n, v in weights.items()}
    assert outer.share_buffers(model, params, pushed)
    fresh = {n: (v + 0.01).astype(np.float32) for n, v in weights.items()}
    for name, value in fresh.items():  # a pull lands in psdk's buffer; write_weights copies it to the others
        np.copyto(params[name], value)
    outer.write_weights(model, params)
    for replica in model.models:
        np.testing.assert_allclose(outer.inner.read_weights(replica)["logits/bias"], fresh["logits/bias"], atol=0)
    outer.write_weights(model, weights)
    tower_trainer.forward_backward(model, data)
    outer.read_gradients(model, pushed)
    for name, value in expected.items():
        np.testing.assert_allclose(pushed[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.timeout(30)
def test_predictions_are_the_first_towers(trainer: TorchClassifier, backend: TorchBackend) -> None:
    backend.setup("cpu")
    weights = SPEC.init_weights(3)
    data = batch(20, seed=3)
    expected = trainer.predictions(trainer.build_model(SPEC, weights), data)
    _, tower_trainer, _ = towers(2)
    np.testing.assert_allclose(tower_trainer.predictions(tower_trainer.build_model(SPEC, weights), data), expected)


class WithTable(TorchClassifier):
    """A trainer whose model keeps an embedding table (a ``sparse=True`` embedding), as the ctr workload's does."""

    def build_model(self, spec: object, weights: object) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))


@pytest.mark.timeout(30)
def test_a_model_with_embedding_tables_is_refused_by_key() -> None:
    bridge = plugins.load_backend("torch")
    bridge.setup_towers(["cpu:0", "cpu:1"])
    _, trainer = in_towers(bridge, WithTable(bridge))
    with pytest.raises(ConfigError, match=r"placement\.towers: towers do not support embedding tables yet"):
        trainer.build_model(SPEC, SPEC.init_weights(0))


# ------------------------------------------------------------------ jobs
JOB_TIMEOUT_S = 110
"""A job trains for 3 s and starts for 10-30 s (a loaded 2-core host: 30); two at once, as long."""


@pytest.mark.timeout(JOB_TIMEOUT_S + 10)
def test_a_job_with_two_towers_trains_as_the_default_job(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """One worker, sync, the same seed: its batches are the default job's, so the parameters must be too.

    A reduction that summed instead of averaging, or kept one tower's
    gradient, ends hundreds of times further away than float rounding.
    Both jobs run at once (a job is mostly start-up).
    """
    summaries = two_towers_against_one("torch", tmp_path, psdk_mnist_dir, JOB_TIMEOUT_S)
    assert [s["workers"]["0"]["devices"] for s in summaries.values()] == [["cpu"], ["cpu:0", "cpu:1"]]
    assert summaries["t1"]["test_accuracy"] == pytest.approx(summaries["t2"]["test_accuracy"], abs=0.002)


@pytest.mark.timeout(JOB_TIMEOUT_S + 10)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_with_towers_beside_one_without(tmp_path: Path, psdk_mnist_dir: Path, mode: str) -> None:
    towers_beside_one_without("torch", mode, tmp_path, psdk_mnist_dir, JOB_TIMEOUT_S)
