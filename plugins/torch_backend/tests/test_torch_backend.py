"""The torch backend: canonical layout, gradients, optimizers, placement, and the public API."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend

import psdk
from psdk.backends.numpy_backend import NumpyBackend
from psdk.errors import ConfigError
from psdk.models import ModelSpec, init_weights
from psdk.optim import SGD, Adagrad, Adam, RMSProp
from psdk.transport.zeromq import ZmqTransport

SPEC = ModelSpec(hidden=(32, 16), input_dim=50, num_classes=10)


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((64, 50), dtype=np.float32), rng.integers(0, 10, 64)


def test_variables_are_in_the_canonical_layout() -> None:
    backend = TorchBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 1))
    assert list(backend.variables(model).items()) == SPEC.variables()
    weights = backend.read_weights(model)
    for name, value in init_weights(SPEC, 1).items():
        np.testing.assert_array_equal(weights[name], value)


def test_loss_and_gradients_match_the_numpy_reference() -> None:
    weights = init_weights(SPEC, 2)
    x, y = batch()
    torch_backend, numpy_backend = TorchBackend(), NumpyBackend()
    tm, nm = torch_backend.build_model(SPEC, weights), numpy_backend.build_model(SPEC, weights)
    assert torch_backend.forward_backward(tm, x, y) == pytest.approx(numpy_backend.forward_backward(nm, x, y), rel=1e-5)
    tg = {n: np.zeros(s, np.float32) for n, s in SPEC.variables()}
    ng = {n: np.zeros(s, np.float32) for n, s in SPEC.variables()}
    torch_backend.read_gradients(tm, tg)
    numpy_backend.read_gradients(nm, ng)
    for name in tg:
        np.testing.assert_allclose(tg[name], ng[name], rtol=1e-4, atol=1e-6)
    assert torch_backend.accuracy(tm, x, y) == numpy_backend.accuracy(nm, x, y)


@pytest.mark.parametrize(
    "rule",
    [
        SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        Adam(lr=1e-3, epsilon_mode="tf", decay_rate=0.5, decay_steps=100),
        Adagrad(lr=0.1),
        RMSProp(lr=0.01, centered=True),
    ],
)
def test_the_framework_optimizer_maps_back_to_its_rule(rule: object) -> None:
    backend = TorchBackend()
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    assert backend.optimizer_rule(backend.make_optimizer(model, rule)) == rule  # type: ignore[arg-type]


def test_optimizers_without_a_ps_rule_are_refused_clearly() -> None:
    backend = TorchBackend()
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ConfigError, match="AdamW"):
        backend.optimizer_rule(torch.optim.AdamW(params))
    with pytest.raises(ConfigError, match="amsgrad"):
        backend.optimizer_rule(torch.optim.Adam(params, amsgrad=True))
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ConfigError, match="parameter groups"):
        backend.optimizer_rule(torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}]))


def test_without_a_gpu_cuda_placement_falls_back_to_the_cpu() -> None:
    backend = TorchBackend()
    backend.setup("cuda:0" if not torch.cuda.is_available() else "cpu", threads=1)
    assert backend.device == "cpu"


def test_a_plain_nn_module_trains_through_the_public_api(ps_thread: tuple[ZmqTransport, str]) -> None:
    transport, address = ps_thread
    cluster = psdk.ClusterSpec({"ps": [address], "worker": ["localhost"]})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    reference = torch.nn.Sequential(torch.nn.Linear(50, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    reference.load_state_dict(model.state_dict())
    x, y = (torch.from_numpy(a) for a in batch(5))
    with psdk.connect(cluster, 0, steps=5, transport=transport) as session:
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
