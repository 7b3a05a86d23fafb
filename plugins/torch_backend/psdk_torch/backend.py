"""The PyTorch backend. This module imports torch; psdk loads it only when it is used.

psdk's own models are built from :class:`Dense` layers whose ``kernel`` is
stored (in, out), so their parameters are in the canonical layout by
construction and need no transposes on the way to or from the ps. Any other
``nn.Module`` works through the public API too: its variables are its
``named_parameters()`` with ``.`` turned into ``/``, in torch's own layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psdk.backend import Backend
from psdk.errors import ConfigError
from psdk.models import ModelSpec
from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule

log = logging.getLogger(__name__)

EVAL_BATCH = 5000


class Dense(nn.Module):
    """``x @ kernel + bias`` with the kernel stored (in, out), as the ps keeps it."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(fan_in, fan_out))
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.kernel)


class DenseStack(nn.Module):
    """The :class:`~psdk.models.ModelSpec` network: dense layers with ReLU between them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.layer_names = [name for name, _, _ in spec.layers()]
        for name, fan_in, fan_out in spec.layers():
            self.add_module(name, Dense(fan_in, fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layer_names) - 1
        for i, name in enumerate(self.layer_names):
            x = getattr(self, name)(x)
            if i < last:
                x = F.relu(x)
        return x


def _only_group(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = optimizer.param_groups
    keys = [k for k in groups[0] if k != "params"]
    if any(any(g.get(k) != groups[0].get(k) for k in keys) for g in groups[1:]):
        raise ConfigError(
            "optimizer",
            "parameter groups with different hyper-parameters cannot run on the ps; use one group",
        )
    return groups[0]


def _refuse(group: Mapping[str, Any], name: str, **unsupported: Any) -> None:
    for key, neutral in unsupported.items():
        if key in group and group[key] not in (neutral, None):
            raise ConfigError(
                f"optimizer.{key}",
                f"{name}({key}={group[key]!r}) has no ps update rule; leave it at {neutral!r}",
            )


class TorchBackend(Backend):
    def __init__(self) -> None:
        self.torch_device = torch.device("cpu")
        self._named: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self._shared: dict[int, list[tuple[int, torch.Tensor]]] = {}

    # ------------------------------------------------------------ placement
    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
            with contextlib.suppress(RuntimeError):  # it can be set once per process
                torch.set_num_interop_threads(1)
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("torch sees no CUDA device; %s falls back to the CPU", device)
            device = "cpu"
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda":
            torch.cuda.set_device(self.torch_device)
            if gpu_memory_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, self.torch_device)
        self.device = str(self.torch_device)

    # ---------------------------------------------------------------- model
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> nn.Module:
        model = DenseStack(spec).to(self.torch_device)
        self.write_weights(model, weights)
        return model

    def _parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        key = id(model)
        if key not in self._named:
            self._named[key] = [(name.replace(".", "/"), p) for name, p in model.named_parameters() if p.requires_grad]
        return self._named[key]

    def variables(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self._parameters(model)}

    def read_weights(self, model: nn.Module) -> dict[str, np.ndarray]:
        return {name: p.detach().cpu().numpy().astype(np.float32, copy=True) for name, p in self._parameters(model)}

    @torch.no_grad()
    def write_weights(self, model: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
        shared = self._shared.get(id(model))
        for i, (name, p) in enumerate(self._parameters(model)):
            if shared is not None and p.data_ptr() == shared[i][0] and weights[name].ctypes.data == shared[i][0]:
                continue  # the parameter is the very buffer the weights arrived in
            p.copy_(torch.as_tensor(np.asarray(weights[name])), non_blocking=False)

    @torch.no_grad()
    def read_gradients(self, model: nn.Module, out: Mapping[str, np.ndarray]) -> None:
        shared = self._shared.get(id(model))
        for i, (name, p) in enumerate(self._parameters(model)):
            if shared is not None and p.grad is shared[i][1]:
                continue  # backward wrote straight into the buffer that is sent
            if p.grad is None:
                out[name].fill(0.0)
            else:
                np.copyto(out[name], p.grad.detach().cpu().numpy())
                if shared is not None:
                    p.grad = shared[i][1]  # alias again (a zero_grad(set_to_none=True) had replaced it)

    @torch.no_grad()
    def share_buffers(
        self, model: nn.Module, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]
    ) -> bool:
        """On the CPU, point every parameter and its gradient at psdk's buffers (no copies per step)."""
        named = self._parameters(model)
        if self.torch_device.type != "cpu" or any(
            p.dtype != torch.float32 or tuple(p.shape) != params[n].shape or not params[n].flags.writeable
            for n, p in named
        ):
            return False
        shared = []
        for name, p in named:
            p.data = torch.from_numpy(params[name])
            p.grad = torch.from_numpy(grads[name])
            shared.append((p.data.data_ptr(), p.grad))
        self._shared[id(model)] = shared
        return True

    def forward_backward(self, model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
        xt = torch.from_numpy(x).to(self.torch_device, non_blocking=True)
        yt = torch.from_numpy(y).to(self.torch_device, non_blocking=True)
        model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        return float(loss.item())

    @torch.no_grad()
    def accuracy(self, model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
        correct = 0
        for start in range(0, len(x), EVAL_BATCH):
            xt = torch.from_numpy(x[start : start + EVAL_BATCH]).to(self.torch_device)
            yt = torch.from_numpy(y[start : start + EVAL_BATCH]).to(self.torch_device)
            correct += int((model(xt).argmax(dim=1) == yt).sum().item())
        return correct / max(1, len(x))

    # ------------------------------------------------------------ optimizer
    def make_optimizer(self, model: nn.Module, rule: UpdateRule) -> torch.optim.Optimizer:
        params = [p for _, p in self._parameters(model)]
        optimizer: torch.optim.Optimizer
        if isinstance(rule, SGD):
            optimizer = torch.optim.SGD(
                params,
                lr=rule.lr,
                momentum=rule.momentum,
                nesterov=rule.nesterov,
                weight_decay=rule.weight_decay,
            )
        elif isinstance(rule, Adam):
            optimizer = torch.optim.Adam(
                params,
                lr=rule.lr,
                betas=(rule.beta1, rule.beta2),
                eps=rule.eps,
                weight_decay=rule.weight_decay,
            )
        elif isinstance(rule, Adagrad):
            optimizer = torch.optim.Adagrad(
                params,
                lr=rule.lr,
                eps=rule.eps,
                initial_accumulator_value=rule.initial_accumulator_value,
                weight_decay=rule.weight_decay,
            )
        elif isinstance(rule, RMSProp):
            optimizer = torch.optim.RMSprop(
                params,
                lr=rule.lr,
                alpha=rule.alpha,
                eps=rule.eps,
                momentum=rule.momentum,
                centered=rule.centered,
                weight_decay=rule.weight_decay,
            )
        else:
            raise ConfigError("optimizer", f"no torch optimizer for {rule.name}")
        # torch's Adam has no TensorFlow epsilon convention: keep the exact rule beside it.
        setattr(optimizer, "psdk_rule", rule)  # noqa: B010
        return optimizer

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("optimizer", f"expected a torch.optim optimizer, got {type(optimizer).__name__}")
        g = _only_group(optimizer)
        lr, wd = float(g["lr"]), float(g.get("weight_decay", 0.0))
        kind = type(optimizer)
        rule: UpdateRule
        if kind is torch.optim.SGD:
            _refuse(g, "SGD", dampening=0, maximize=False)
            rule = SGD(momentum=float(g["momentum"]), nesterov=bool(g["nesterov"]), lr=lr, weight_decay=wd)
        elif kind is torch.optim.Adam:
            _refuse(g, "Adam", amsgrad=False, maximize=False)
            beta1, beta2 = g["betas"]
            rule = Adam(beta1=float(beta1), beta2=float(beta2), eps=float(g["eps"]), lr=lr, weight_decay=wd)
        elif kind is torch.optim.Adagrad:
            _refuse(g, "Adagrad", lr_decay=0, maximize=False)
            accumulator = float(g["initial_accumulator_value"])
            rule = Adagrad(eps=float(g["eps"]), initial_accumulator_value=accumulator, lr=lr, weight_decay=wd)
        elif kind is torch.optim.RMSprop:
            _refuse(g, "RMSprop", maximize=False)
            rule = RMSProp(
                alpha=float(g["alpha"]),
                eps=float(g["eps"]),
                momentum=float(g["momentum"]),
                centered=bool(g["centered"]),
                lr=lr,
                weight_decay=wd,
            )
        else:
            raise ConfigError(
                "optimizer",
                f"torch.optim.{kind.__name__} has no ps update rule",
                ["torch.optim.SGD", "torch.optim.Adam", "torch.optim.Adagrad", "torch.optim.RMSprop"],
            )
        return _with_psdk_only_options(rule, getattr(optimizer, "psdk_rule", None))


def _with_psdk_only_options(rule: UpdateRule, kept: UpdateRule | None) -> UpdateRule:
    """``kept`` (the rule this optimizer was made from) when torch agrees with it.

    torch.optim has no place for the learning-rate decay or TensorFlow's Adam
    epsilon convention, so :meth:`TorchBackend.make_optimizer` keeps the rule
    beside the optimizer; a user who changed the optimizer since gets the rule
    torch's own hyper-parameters describe.
    """
    if kept is None or type(kept) is not type(rule):
        return rule
    psdk_only = {"decay", "decay_rate", "decay_steps", "epsilon_mode"}
    same = all(
        getattr(kept, f.name) == getattr(rule, f.name) for f in dataclasses.fields(rule) if f.name not in psdk_only
    )
    return kept if same else rule
