"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") as a ps update rule.

Each step moves every parameter by the same amount, ``lr``, in the direction
of the sign of an interpolation between the gradient and a momentum::

    c = beta1 * m + (1 - beta1) * g
    p -= lr * (sign(c) + weight_decay * p)      # decoupled decay, as the paper
    m = beta2 * m + (1 - beta2) * g

Its one slot, ``m``, lives on the ps beside the parameters and is saved in
checkpoints like Adam's moments: nothing in psdk knows this rule by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from psdk.errors import ConfigError
from psdk.ps.rules import Bounds, RuleState, UpdateRule


@dataclass(frozen=True)
class Lion(UpdateRule):
    """Lion: sign of an interpolated momentum, a fixed step size, decoupled weight decay."""

    name: ClassVar[str] = "lion"
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optimizer.{key}", f"must be in [0, 1), got {getattr(self, key)}")
        if self.weight_decay < 0:
            raise ConfigError("optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")

    def slot_names(self) -> tuple[str, ...]:
        return ("m",)

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        """Every step moves a parameter by at most ``lr * (1 + weight_decay * |p|)``."""
        lr = self.lr  # the decayed rate is never larger
        after = params + lr * (1.0 + self.weight_decay * params)
        m = self.beta2 * slots["m"] + (1.0 - self.beta2) * grad
        if not all(np.isfinite(v) and v < 1e37 for v in (after, m, grad)):
            return None
        return after * (1 + 1e-5) + 1e-30, {"m": m * (1 + 1e-5) + 1e-30}

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        m, step = state.slots["m"], state.scratch[0]
        lr = self.lr_at(state.step)
        np.multiply(m, self.beta1, out=step)
        step += (1.0 - self.beta1) * grad
        np.sign(step, out=step)
        if self.weight_decay:
            step += self.weight_decay * params
        step *= lr
        params -= step
        m *= self.beta2
        m += (1.0 - self.beta2) * grad
        state.step += 1
