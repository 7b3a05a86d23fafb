"""Each ps update rule, in numpy, against torch.optim on random tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from psdk.optim import SGD, Adagrad, Adam, RMSProp, UpdateRule

CASES: list[tuple[UpdateRule, Any, dict[str, Any]]] = [
    (SGD(lr=0.1), torch.optim.SGD, {"lr": 0.1}),
    (SGD(lr=0.05, momentum=0.9), torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (
        SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    (Adam(lr=0.01), torch.optim.Adam, {"lr": 0.01}),
    (
        Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
        torch.optim.Adam,
        {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
    ),
    (
        Adagrad(lr=0.1, initial_accumulator_value=0.1),
        torch.optim.Adagrad,
        {"lr": 0.1, "initial_accumulator_value": 0.1},
    ),
    (RMSProp(lr=0.01), torch.optim.RMSprop, {"lr": 0.01}),
    (
        RMSProp(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
    ),
]


@pytest.mark.parametrize("rule, torch_cls, kwargs", CASES, ids=lambda c: getattr(c, "name", None))
def test_rule_matches_torch_optim(rule: UpdateRule, torch_cls: Any, kwargs: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    start = rng.normal(size=1000).astype(np.float32)
    grads = [rng.normal(size=1000).astype(np.float32) for _ in range(20)]

    params = start.copy()
    state = rule.new_state(params.size)
    for g in grads:
        rule.apply(params, g, state)

    weight = torch.nn.Parameter(torch.from_numpy(start.copy()))
    optimizer = torch_cls([weight], **kwargs)
    for g in grads:
        weight.grad = torch.from_numpy(g.copy())
        optimizer.step()

    np.testing.assert_allclose(params, weight.detach().numpy(), rtol=1e-5, atol=1e-6)
