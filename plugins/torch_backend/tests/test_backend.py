"""The torch backend beyond the conformance suite: its registration, any nn.Module, psdk's buffers."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import numpy as np
import torch
from psdk_torch.backend import TorchBackend
from psdk_torch.mnist import TorchClassifier

import psdk
from psdk import plugins
from psdk.plugins.models import init_weights
from psdk.testing.ps import RunningPs
from psdk.workloads.mnist.trainers import IMAGE

from .conftest import SPEC, batch


def test_the_backend_is_registered_by_its_distribution() -> None:
    entry = plugins.installed_backends()["torch"]
    assert entry.distribution.startswith("psdk-torch") and entry.record.framework == "torch"
    assert plugins.resolve_backend_name("PyTorch") == "torch"


def test_psdk_plugins_lists_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psdk", "plugins"], capture_output=True, text=True, timeout=120, check=True
    )
    line = next(row for row in out.stdout.splitlines() if row.split()[:2] == ["backend", "torch"])
    assert "psdk-torch" in line


def test_any_nn_module_is_named_from_its_parameters_in_torchs_layout(backend: TorchBackend) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 4))
    model[2].bias.requires_grad_(False)  # frozen: not a variable of the ps
    assert backend.variables(model) == {"0/weight": (2, 3), "0/bias": (2,), "2/weight": (4, 2)}


def test_the_backends_view_of_a_model_does_not_keep_it_alive(backend: TorchBackend) -> None:
    model = torch.nn.Linear(3, 2)
    backend.read_weights(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_shared_buffers_survive_a_zero_grad_that_drops_the_gradients(
    backend: TorchBackend, trainer: TorchClassifier
) -> None:
    """After zero_grad(set_to_none=True) the next backward makes new tensors: copied once, then aliased again."""
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    params = {name: np.array(value) for name, value in backend.read_weights(model).items()}
    grads = {name: np.zeros_like(value) for name, value in params.items()}
    assert backend.share_buffers(model, params, grads)
    b = batch()
    x, y = b.inputs[IMAGE], b.targets
    trainer.forward_backward(model, b)
    first = {name: value.copy() for name, value in grads.items()}  # backward wrote straight into psdk's buffers
    assert any(value.any() for value in first.values())
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    for value in grads.values():
        value.fill(0.0)
    backend.read_gradients(model, grads)
    for name, value in grads.items():
        np.testing.assert_allclose(value, first[name], rtol=1e-6, atol=1e-7, err_msg=name)
    kernel = next(model.parameters())
    assert kernel.grad is not None and kernel.grad.data_ptr() == grads["hidden1/kernel"].ctypes.data


def test_a_plain_nn_module_trains_through_the_public_api(psdk_ps: RunningPs) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    reference = torch.nn.Sequential(torch.nn.Linear(50, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    reference.load_state_dict(model.state_dict())
    b = batch(seed=5)
    x, y = torch.from_numpy(b.inputs[IMAGE]), torch.from_numpy(b.targets)
    with psdk.connect(psdk_ps.cluster(1), 0, steps=5, transport=psdk_ps.transport) as session:
        opt = psdk.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, session)
        opt.broadcast_parameters()
        # On the CPU the model's tensors are psdk's own buffers: no copy per step.
        weight = next(model.parameters())
        assert weight.data_ptr() == session.client.params["0/weight"].ctypes.data
        while not session.should_stop():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        session.finish()
        opt.pull()
    assert session.global_step == 5
    local = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(5):
        local.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        local.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
