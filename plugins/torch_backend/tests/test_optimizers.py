"""torch.optim optimizers and ps update rules: the same updates, torch's defaults, and clear refusals.

The round trip of every rule and the option refusals are the conformance
suite's (test_conformance.py); this file holds what only torch has.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from psdk_torch.backend import TorchBackend

from psdk.errors import ConfigError
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing import RuleAgreement


class TestTorchOptimizersAgreeWithTheRules(RuleAgreement):
    """Each rule, in numpy, against the torch.optim optimizer the backend makes for it: 20 steps."""

    def framework_steps(self, rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        weight = torch.nn.Parameter(torch.from_numpy(start))
        optimizer = TorchBackend().make_optimizer(torch.nn.ParameterList([weight]), rule)
        for g in grads:
            weight.grad = torch.from_numpy(g)
            optimizer.step()
        return weight.detach().numpy()


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "optimizer, rule",
    [
        (torch.optim.SGD(params(), lr=0.1), SGD(lr=0.1)),
        (torch.optim.Adam(params()), Adam(lr=0.001, eps=1e-8)),
        (torch.optim.Adagrad(params()), Adagrad(lr=0.01, eps=1e-10)),
        (torch.optim.RMSprop(params()), RMSProp(lr=0.01, alpha=0.99, eps=1e-8)),
    ],
    ids=lambda o: type(o).__name__,
)
def test_a_torch_optimizer_written_by_hand_maps_to_its_rule(optimizer: torch.optim.Optimizer, rule: UpdateRule) -> None:
    """torch's own defaults carry over: psdk's rules follow torch.optim."""
    assert TorchBackend().optimizer_rule(optimizer) == rule


def test_a_changed_optimizer_no_longer_answers_with_the_kept_rule(backend: TorchBackend) -> None:
    """The remembered rule (here with a decay torch cannot say) holds only while torch's settings agree."""
    model = torch.nn.Linear(3, 2)
    optimizer = backend.make_optimizer(model, SGD(lr=0.05, momentum=0.9, decay_rate=0.5, decay_steps=100))
    optimizer.param_groups[0]["lr"] = 0.2
    assert backend.optimizer_rule(optimizer) == SGD(lr=0.2, momentum=0.9)


def test_optimizers_without_a_ps_rule_are_refused_clearly(backend: TorchBackend) -> None:
    no_rule = r"^optimizer: torch.optim.AdamW has no ps update rule.*rule=.*torch.optim.SGD"
    with pytest.raises(ConfigError, match=no_rule):
        backend.optimizer_rule(torch.optim.AdamW(params()))
    with pytest.raises(ConfigError, match=r"^optimizer.amsgrad: Adam\(amsgrad=True\) .*leave it at False"):
        backend.optimizer_rule(torch.optim.Adam(params(), amsgrad=True))
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ConfigError, match="parameter groups"):
        backend.optimizer_rule(torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}]))
    with pytest.raises(ConfigError, match=r"expected a torch.optim optimizer, got str.*rule="):
        backend.optimizer_rule("sgd")
