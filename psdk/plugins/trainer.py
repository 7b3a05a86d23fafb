"""A workload's trainer: what it needs of one framework, written on that framework's bridge.

The backend (:class:`~psdk.plugins.backend.Backend`) is the bridge between a
framework and the ps: variables, weights, gradients, shared buffers, update
rules, devices. It knows no loss, metric or data set. Those are the
workload's: per framework it names a trainer (``WorkloadRecord.trainers``,
``{framework: "pkg.mod:Class"}``, imported only when used) that builds its
model, runs the forward and backward pass on a :class:`~psdk.plugins.batches.Batch`,
and predicts. Predictions come back as numpy, and the workload scores them
(its ``score`` entry) once for every framework, so a metric means the same
whichever framework computed the predictions.

A framework plugin can also give an existing workload a trainer for its
framework, without touching the workload: a
:class:`~psdk.plugins.hookspecs.TrainerRecord` through ``psdk_register_trainers``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from psdk.plugins.batches import Batch

if TYPE_CHECKING:
    from psdk.plugins.backend import Backend

PREDICT_BATCH = 5000
"""Examples per forward pass when predicting a whole set: big enough to be fast, small enough for any GPU."""


class Trainer(ABC):
    """One workload on one framework. Made as ``Trainer(bridge, options)`` with the workload's ``workload.*`` keys."""

    bridge_class: ClassVar[type[Backend] | None] = None
    """The bridge this trainer's models need, if one: checked when the trainer is made, since on another
    bridge its models would hold no tensors of its framework and it would fail mid-step instead."""

    def __init__(self, bridge: Backend, options: Mapping[str, Any] | None = None):
        wanted = type(self).bridge_class
        if wanted is not None and not isinstance(bridge, wanted):
            from psdk.errors import PluginError
            from psdk.plugins.registry import record_of

            raise PluginError(
                f"{type(self).__name__} trains on the {record_of(wanted).name} backend "
                f"({wanted.__module__}:{wanted.__qualname__}), not on {type(bridge).__module__}.{type(bridge).__name__}"
            )
        self.bridge = bridge
        self.options: Mapping[str, Any] = dict(options or {})

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> Any:
        """``spec``'s model on the bridge's device, holding ``weights``.

        By default: the model plugin's builder for this backend, else the
        bridge's own dense stack for a :class:`~psdk.plugins.models.ModelSpec`.
        """
        from psdk.plugins.models import build_model

        return build_model(self.bridge, spec, weights)

    @abstractmethod
    def forward_backward(self, model: Any, batch: Batch) -> float:
        """The loss on ``batch``, leaving its gradients in the model for the bridge to read."""

    @abstractmethod
    def predict(self, model: Any, batch: Batch) -> np.ndarray:
        """The model's predictions for ``batch``'s inputs, as numpy (no gradients)."""

    def predictions(self, model: Any, batch: Batch, size: int = PREDICT_BATCH) -> np.ndarray:
        """:meth:`predict` over a whole set, ``size`` examples at a time, joined."""
        starts = range(0, len(batch), size)
        parts = [np.asarray(self.predict(model, batch.take(start, start + size))) for start in starts]
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)
