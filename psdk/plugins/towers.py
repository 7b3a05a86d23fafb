"""In-graph replication: one worker task driving several local devices, a model replica ("tower") on each.

TensorFlow 1.x had two ways to use several devices: one worker task per
device (between-graph replication, psdk's workers) and one worker task
driving several (in-graph replication, its "towers"). This module is the
second, on any bridge that supports it (:meth:`~psdk.plugins.backend.Backend.setup_towers`).
Per step the worker still pulls once and pushes once; in between:

* the parameters just pulled are copied to every tower (:meth:`TowerBridge.write_weights`);
* the batch is cut into one slice per tower, as evenly as it goes (the first
  ``len % towers`` slices one example longer: :func:`split`);
* the towers run at once, each in a thread of its own inside
  :meth:`~psdk.plugins.backend.Backend.tower` (the frameworks release the
  GIL while they compute), through the workload's own trainer;
* their gradients are summed, each weighted by its slice's share of the
  batch, on the first tower's device (:meth:`~psdk.plugins.backend.Backend.reduce_gradients`),
  which for a loss that is a mean over the examples (every psdk workload's)
  is the gradient of the whole batch; the loss reported is weighted the same way.

The worker sees one model (:class:`Towers`), one bridge (:class:`TowerBridge`)
and one trainer (:class:`TowerTrainer`), so its loop, the ps and the wire
are those of a worker with one device. Predictions (validation, test) run on
the first tower. Embedding tables are refused for now: their rows would
have to be written to, and their row gradients read from, every tower.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.batches import Batch
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Rows, Variable
from psdk.ps.rules import UpdateRule


def split(size: int, towers: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each tower's slice of a batch of ``size``: the first ``size % towers`` one longer.

    A batch smaller than the towers leaves the last ones an empty slice (share 0: they sit the step out).
    """
    base, extra = divmod(size, towers)
    bounds, start = [], 0
    for k in range(towers):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class Towers:
    """One replica of the model per device, the first one the model the worker reads and predicts with."""

    models: list[Any]
    devices: tuple[str, ...]
    shares: list[float] = field(default_factory=list)
    """Each tower's share of the last batch (``n_k / n``): the weights of its gradients."""

    def __len__(self) -> int:
        return len(self.models)


class TowerBridge(Backend):
    """A bridge set up with towers, seen by the worker as one bridge of one model (:class:`Towers`).

    Everything a single model answers (variables, weights read, the
    optimizer) is the first tower's; weights written go to every tower,
    gradients read are the towers' weighted sum.
    """

    def __init__(self, inner: Backend):
        self.inner = inner
        self.record = inner.record
        self.options = getattr(inner, "options", {})
        self.device = inner.device
        self.tower_devices = inner.tower_devices

    def owns(self, obj: object) -> bool:
        return isinstance(obj, Towers) or self.inner.owns(obj)

    def variables(self, model: Towers) -> dict[str, tuple[int, ...]]:
        return self.inner.variables(model.models[0])

    def variable_records(self, model: Towers) -> dict[str, Variable]:
        return self.inner.variable_records(model.models[0])

    def read_weights(self, model: Towers) -> dict[str, np.ndarray]:
        return self.inner.read_weights(model.models[0])

    def write_weights(self, model: Towers, weights: Mapping[str, np.ndarray]) -> None:
        """The pulled parameters onto every tower's device (the first may share psdk's buffer: no copy)."""
        for replica in model.models:
            self.inner.write_weights(replica, weights)

    def read_gradients(self, model: Towers, out: Mapping[str, np.ndarray]) -> None:
        shares = model.shares or [1.0] + [0.0] * (len(model) - 1)  # no step yet: the first tower's
        self.inner.reduce_gradients(model.models, shares, out)

    def share_buffers(self, model: Towers, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> bool:
        """The first tower may share psdk's buffers (torch on the CPU); the others copy."""
        return self.inner.share_buffers(model.models[0], params, grads)

    def make_optimizer(self, model: Towers, rule: UpdateRule) -> Any:
        return self.inner.make_optimizer(model.models[0], rule)

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        return self.inner.optimizer_rule(optimizer)


class TowerTrainer(Trainer):
    """A workload's trainer run once per tower on its slice of each batch; see the module docstring."""

    def __init__(self, inner: Trainer, bridge: Backend):
        self.inner = inner
        self.bridge = bridge
        self.options = inner.options
        self.devices = bridge.tower_devices
        self._pool = ThreadPoolExecutor(len(self.devices) - 1, thread_name_prefix="psdk-tower")

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> Towers:
        """One replica per device, each built inside its tower; a model with embedding tables is refused."""
        models = []
        for index in range(len(self.devices)):
            with self.bridge.tower(index):
                models.append(self.inner.build_model(spec, weights))
        tables = sorted(n for n, v in self.bridge.variable_records(models[0]).items() if isinstance(v, Rows))
        if tables:
            raise ConfigError(
                "placement.towers",
                f"towers do not support embedding tables yet (this model has {tables}); use placement.towers=1 "
                "and one worker per device",
            )
        return Towers(models, self.devices)

    def _one(self, towers: Towers, index: int, batch: Batch) -> float:
        with self.bridge.tower(index):
            return self.inner.forward_backward(towers.models[index], batch)

    def forward_backward(self, model: Towers, batch: Batch) -> float:
        """Each tower's loss and gradients on its slice, at once; the loss of the whole batch (share-weighted)."""
        size = len(batch)
        bounds = split(size, len(model))
        live = [(k, start, stop) for k, (start, stop) in enumerate(bounds) if stop > start]
        futures = [self._pool.submit(self._one, model, k, batch.take(a, b)) for k, a, b in live[1:]]
        k0, a0, b0 = live[0]
        losses = {k0: self._one(model, k0, batch.take(a0, b0))}  # the first on this thread (pinned, niced)
        losses.update({k: f.result() for (k, _, _), f in zip(live[1:], futures, strict=True)})
        model.shares = [(stop - start) / size for start, stop in bounds]
        return float(sum(model.shares[k] * loss for k, loss in losses.items()))

    def predict(self, model: Towers, batch: Batch) -> np.ndarray:
        with self.bridge.tower(0):
            return self.inner.predict(model.models[0], batch)

    def predictions(self, model: Towers, batch: Batch, size: int = 5000) -> np.ndarray:
        with self.bridge.tower(0):
            return self.inner.predictions(model.models[0], batch, size)


def in_towers(bridge: Backend, trainer: Trainer) -> tuple[TowerBridge, TowerTrainer]:
    """The bridge and trainer a worker with towers uses (``bridge`` set up by ``setup_towers``)."""
    if len(bridge.tower_devices) < 2:
        raise ConfigError("placement.towers", f"the {bridge.name} backend was set up with one device, not towers")
    return TowerBridge(bridge), TowerTrainer(trainer, bridge)


def describe(devices: Sequence[str]) -> str:
    """``cuda:0, cuda:1 (2 towers, gradients averaged on cuda:0)``: for the worker's first log line."""
    if len(devices) == 1:
        return devices[0]
    return f"{', '.join(devices)} ({len(devices)} towers, gradients averaged on {devices[0]})"
