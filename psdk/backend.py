"""The backend contract: what a framework plugin must do for a worker.

A backend builds a :class:`~psdk.models.ModelSpec` in its framework, moves
weights and gradients in and out as named numpy arrays in the canonical
layout (float32, C order, dense kernels (in, out)), computes loss and
gradients on a batch, evaluates, and places itself on a device. It also
recognises its framework's optimizers, whose type and hyper-parameters
select the ps's update rule.

The module that defines a backend class may import its framework at the
top: psdk imports it only when the backend is used. The module that
registers it (the plugin's entry point) must not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from psdk.models import ModelSpec
from psdk.optim import UpdateRule


class Backend(ABC):
    name: ClassVar[str]
    framework: ClassVar[str]
    """Top-level module of the framework (``"torch"``): its objects belong to this backend."""

    device: str = "cpu"

    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        """Import the framework, pin its threads and place this process on ``device``.

        ``device`` is framework-neutral (``"cpu"`` or ``"cuda:N"``); a backend
        that cannot use it falls back to the CPU and says so, like soft placement.
        """
        self.device = device

    def owns(self, obj: object) -> bool:
        """Whether ``obj`` (a model or optimizer) belongs to this backend's framework."""
        return type(obj).__module__.split(".")[0] == self.framework

    @abstractmethod
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> Any:
        """The model of ``spec`` on this backend's device, holding ``weights``."""

    @abstractmethod
    def make_optimizer(self, model: Any, rule: UpdateRule) -> Any:
        """The framework's own optimizer matching ``rule`` (what a user would write)."""

    @abstractmethod
    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        """The ps update rule a framework optimizer stands for; refuse unknown ones clearly."""

    @abstractmethod
    def variables(self, model: Any) -> dict[str, tuple[int, ...]]:
        """Trainable variables' canonical names and shapes, in creation order."""

    @abstractmethod
    def read_weights(self, model: Any) -> dict[str, np.ndarray]:
        """Copies of the weights, canonical layout."""

    @abstractmethod
    def write_weights(self, model: Any, weights: Mapping[str, np.ndarray]) -> None:
        """Set the model's weights from canonical arrays (which the caller keeps)."""

    @abstractmethod
    def read_gradients(self, model: Any, out: Mapping[str, np.ndarray]) -> None:
        """Copy the gradients left by the last backward pass into ``out`` (canonical layout)."""

    def share_buffers(self, model: Any, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> bool:
        """Optionally make the model's weights and gradients live in psdk's own buffers.

        If a backend can (torch on the CPU can), the backward pass writes the
        gradients straight into the buffers that are sent and the parameters
        that arrive land straight in the model; :meth:`read_gradients` and
        :meth:`write_weights` then copy only what no longer aliases those
        buffers (e.g. after a ``zero_grad(set_to_none=True)``). Return
        ``False`` (the default) to keep copying.
        """
        return False

    @abstractmethod
    def forward_backward(self, model: Any, x: np.ndarray, y: np.ndarray) -> float:
        """Mean softmax cross-entropy on a batch; leaves fresh gradients in the model."""

    @abstractmethod
    def accuracy(self, model: Any, x: np.ndarray, y: np.ndarray) -> float:
        """Fraction of ``x`` classified as ``y``."""
