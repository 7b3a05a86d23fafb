"""psdk's device string to torch's device and threads: soft placement, refusals, and a GPU when there is one."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend
from psdk_torch.mnist import TorchClassifier

from psdk.errors import ConfigError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import init_weights
from psdk.workloads.mnist.trainers import NumpyClassifier

from .conftest import SPEC, batch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU here")


@pytest.fixture
def threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_gpu_torch_does_not_see_means_the_cpu_and_a_warning(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: there is none on a CPU machine
    with caplog.at_level(logging.WARNING, logger="psdk.plugins.backends.kit"):
        backend.setup(missing)
    assert backend.device == "cpu" and backend.torch_device == torch.device("cpu")
    assert missing in caplog.text and "CPU" in caplog.text


def test_devices_and_fractions_psdk_does_not_know_are_refused_by_key(backend: TorchBackend) -> None:
    with pytest.raises(ConfigError, match=r"^placement.device: .*'tpu:0'.*valid choices: cpu, cuda, cuda:N"):
        backend.setup("tpu:0")
    with pytest.raises(ConfigError, match=r"^placement.gpu_memory_fraction"):
        backend.setup("cpu", gpu_memory_fraction=1.5)


def test_setup_pins_torchs_threads(backend: TorchBackend, threads_restored: None) -> None:
    backend.setup("cpu", threads=1)
    assert backend.device == "cpu" and torch.get_num_threads() == 1


@needs_gpu
def test_on_a_gpu_the_model_trains_there_and_keeps_its_own_buffers(
    backend: TorchBackend, trainer: TorchClassifier
) -> None:
    """cuda:0 is used as asked; MNIST's loss, gradients and predictions match numpy's; psdk's CPU buffers stay apart."""
    backend.setup("cuda:0", threads=1, gpu_memory_fraction=0.5)
    assert backend.device == "cuda:0"
    weights, data = init_weights(SPEC, 0), batch()
    bridge = NumpyBackend()
    reference, ref = NumpyClassifier(bridge), bridge.build_model(SPEC, weights)
    model = trainer.build_model(SPEC, weights)
    assert next(model.parameters()).device.type == "cuda"
    loss = trainer.forward_backward(model, data)
    assert loss == pytest.approx(reference.forward_backward(ref, data), rel=1e-4, abs=1e-5)
    out = {name: np.zeros(shape, np.float32) for name, shape in SPEC.variables()}
    assert not backend.share_buffers(model, backend.read_weights(model), out)
    backend.read_gradients(model, out)
    for name, grad in out.items():
        np.testing.assert_allclose(grad, ref.grads[name], rtol=1e-3, atol=1e-5, err_msg=name)
    logits, expected = trainer.predictions(model, data), reference.predictions(ref, data)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, rtol=1e-3, atol=1e-4)
    assert np.mean(logits.argmax(axis=1) == data.targets) == np.mean(expected.argmax(axis=1) == data.targets)
