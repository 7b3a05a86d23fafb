"""Each ps update rule, in numpy, against the torch.optim optimizer the backend makes for it."""

from __future__ import annotations

import numpy as np
import torch

from psdk.optim import UpdateRule
from psdk.plugins import load_backend
from psdk.testing import RuleAgreement


class TestTorchOptimizersAgreeWithTheRules(RuleAgreement):
    def framework_steps(self, rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        weight = torch.nn.Parameter(torch.from_numpy(start))
        optimizer = load_backend("torch").make_optimizer(torch.nn.ParameterList([weight]), rule)
        for g in grads:
            weight.grad = torch.from_numpy(g)
            optimizer.step()
        return weight.detach().numpy()
