"""The backend contract: a framework's bridge to the ps.

A backend moves a model's weights and gradients in and out as named numpy
arrays in the canonical layout (float32, C order, dense kernels (in, out)),
says what variables a model has and of what kind, shares psdk's buffers where
its framework can, builds psdk's framework-neutral dense stacks
(:class:`~psdk.plugins.models.ModelSpec`) and places itself on a device. It
knows no loss, metric or data set: those are a workload's, written per
framework as a :class:`~psdk.plugins.trainer.Trainer` on this bridge. It also
recognises its framework's optimizers where they can be inspected, whose
type and hyper-parameters select the ps's update rule; a functional
framework's users pass the rule itself instead
(``DistributedOptimizer(None, model, session, rule=psdk.rules.Adam(lr=1e-3))``).

A backend's identity (name, framework, aliases, options) is its plugin's
:class:`~psdk.plugins.hookspecs.BackendRecord`, declared once: :func:`psdk.plugins.load_backend`
hands the record and the job's options to the instance.

Per training step a worker calls :meth:`Backend.write_weights` (the
parameters just pulled), the trainer's ``forward_backward``, then
:meth:`Backend.read_gradients` (into the buffers that are pushed).

A backend may drive several local devices in one worker (in-graph
replication, ``placement.towers``; :mod:`psdk.plugins.towers`): psdk then
calls :meth:`Backend.setup_towers` instead of :meth:`Backend.setup`, builds
and runs each replica inside :meth:`Backend.tower`, and has
:meth:`Backend.reduce_gradients` average the replicas' gradients into the
buffers that are pushed. One that does not refuses ``setup_towers`` (the
default) with a :class:`~psdk.errors.ConfigError`.

A backend written before workloads existed defined ``forward_backward`` and
``accuracy`` itself; :func:`psdk.plugins.load_backend` refuses one, naming
what to move where (docs/writing-a-backend.md, 'Moving a backend to a bridge').

The module that defines a backend class may import its framework at the
top: psdk imports it only when the backend is used. The module that
registers it (the plugin's entry point) must not.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk.ps.rules import UpdateRule

if TYPE_CHECKING:
    from psdk.plugins.hookspecs import BackendRecord

_TOWER = threading.local()
"""The tower the calling thread works for, as ``(bridge, index)``: towers run in threads of their own."""


class Backend(ABC):
    device: str = "cpu"
    options: dict[str, Any]
    """The plugin's own options (its record's defaults, overridden by ``backend_options.<name>``)."""
    _record: BackendRecord | None = None

    @property
    def record(self) -> BackendRecord:
        """The plugin's record of this backend; found by class when the instance was made directly."""
        if self._record is None:
            from psdk.plugins.registry import record_of

            self._record = record_of(type(self))
        return self._record

    @record.setter
    def record(self, record: BackendRecord) -> None:
        self._record = record

    @property
    def name(self) -> str:
        return self.record.name

    def option(self, key: str) -> Any:
        """One of the plugin's options: the job's value, else the record's default."""
        options = getattr(self, "options", None)
        return options[key] if options is not None and key in options else self.record.options[key]

    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        """Import the framework, pin its threads and place this process on ``device``.

        ``device`` is framework-neutral (``"cpu"`` or ``"cuda:N"``); a backend
        that cannot use it falls back to the CPU and says so, like soft placement.
        """
        self.device = device

    def setup_towers(
        self, devices: Sequence[str], threads: int | None = None, gpu_memory_fraction: float | None = None
    ) -> None:
        """Like :meth:`setup`, for one replica ("tower") of the model on each of ``devices``.

        ``devices`` are framework-neutral too: ``cuda:N``, or ``cpu:K`` for
        the K-th CPU replica (on a machine without GPUs, where towers prove
        the arithmetic). Set :attr:`tower_devices` to the devices used, the
        first one (where the gradients are averaged) also as ``device``. The
        default refuses: a backend says it can drive several devices by
        overriding this, :meth:`tower` if its device is not read through
        :attr:`tower_index`, and maybe :meth:`reduce_gradients`.
        """
        raise ConfigError(
            "placement.towers",
            f"the {self.name} backend drives one device per worker, not {len(devices)}; use placement.towers=1, "
            "or one worker per device (topology.num_workers)",
        )

    @property
    def tower_devices(self) -> tuple[str, ...]:
        """The devices of :meth:`setup_towers` (one entry, ``device``, without towers)."""
        return tuple(self.__dict__.get("_tower_devices", (self.device,)))

    @tower_devices.setter
    def tower_devices(self, devices: Sequence[str]) -> None:
        self.__dict__["_tower_devices"] = tuple(devices)

    @property
    def tower_index(self) -> int:
        """The tower the calling thread works for (0 outside :meth:`tower`): a backend places its work by it."""
        current = getattr(_TOWER, "current", None)
        return current[1] if current is not None and current[0] is self else 0

    @contextmanager
    def tower(self, index: int) -> Iterator[None]:
        """Inside, this thread builds and computes on tower ``index``'s device (``tf.device`` as TF 1 wrote it).

        The default sets :attr:`tower_index` for this thread only: a backend
        that reads its device from it needs nothing more.
        """
        before = getattr(_TOWER, "current", None)
        _TOWER.current = (self, index)
        try:
            yield
        finally:
            _TOWER.current = before

    def reduce_gradients(self, models: Sequence[Any], shares: Sequence[float], out: Mapping[str, np.ndarray]) -> None:
        """The towers' gradients, each weighted by its share of the batch, summed into ``out`` (what is pushed).

        With shares ``n_k / n`` and a loss that is a mean over the examples,
        the sum is the gradient of the whole batch. The default sums on the
        host, through :meth:`read_gradients`; a backend that can sums on the
        first tower's device and copies once (torch does).
        """
        scratch: dict[str, np.ndarray] | None = None
        first = True
        for model, share in zip(models, shares, strict=True):
            if share == 0.0:
                continue
            if first:
                self.read_gradients(model, out)
                for value in out.values():
                    value *= np.float32(share)
                first = False
                continue
            if scratch is None:
                scratch = {name: np.empty_like(value) for name, value in out.items()}
            self.read_gradients(model, scratch)
            for name, value in out.items():
                part = scratch[name]
                part *= np.float32(share)
                value += part

    def owns(self, obj: object) -> bool:
        """Whether ``obj`` (a model or optimizer) belongs to this backend.

        By default: its class, or one of its base classes, comes from the
        record's framework, one of its ``modules``, or the plugin's own package,
        so a user's ``class Net(torch.nn.Module)`` defined in a script belongs
        to torch. Override to be stricter.
        """
        from psdk.plugins.registry import package_of

        record = self.record
        packages = {record.framework, *record.modules, package_of(record.target)}
        return any(cls.__module__.split(".")[0] in packages for cls in type(obj).__mro__ if cls is not object)

    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> Any:
        """psdk's dense stack ``spec`` on this backend's device, holding ``weights`` (for workloads that use one)."""
        raise ConfigError("model", f"the {self.name} backend builds no dense stacks; model={spec.name} needs a builder")

    @abstractmethod
    def make_optimizer(self, model: Any, rule: UpdateRule) -> Any:
        """The framework's own optimizer matching ``rule`` (what a user would write)."""

    @abstractmethod
    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        """The ps update rule a framework optimizer stands for; refuse unknown ones clearly."""

    @abstractmethod
    def variables(self, model: Any) -> dict[str, tuple[int, ...]]:
        """Trainable variables' canonical names and shapes, in creation order."""

    def variable_records(self, model: Any) -> dict[str, Variable]:
        """Every variable of ``model`` with its kind (:mod:`psdk.plugins.variables`); dense by default."""
        return as_variables(self.variables(model))

    @abstractmethod
    def read_weights(self, model: Any) -> dict[str, np.ndarray]:
        """Copies of the weights, canonical layout."""

    @abstractmethod
    def write_weights(self, model: Any, weights: Mapping[str, np.ndarray]) -> None:
        """Set the model's weights from canonical arrays (which the caller keeps)."""

    @abstractmethod
    def read_gradients(self, model: Any, out: Mapping[str, np.ndarray]) -> None:
        """Copy the gradients left by the last backward pass into ``out`` (canonical layout)."""

    def write_rows(self, model: Any, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Put the rows of ``ids`` that the ps sent for table ``table`` where the model's next forward pass reads them.

        ``ids`` are unique and increasing (int64), ``rows`` is ``len(ids) x
        dim`` float32, read-only (copy it in). A table is a variable
        :meth:`variable_records` declares as :class:`~psdk.plugins.variables.Rows`;
        :meth:`variables`, :meth:`read_weights`, :meth:`write_weights` and
        :meth:`read_gradients` leave it out: its rows never travel whole.
        """
        raise ConfigError("model", f"the {self.name} backend keeps no embedding tables (table {table!r})")

    def read_row_gradients(self, model: Any, table: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, row gradients)`` the last backward pass left for table ``table``.

        ids int64 (duplicates allowed: psdk sums them), gradients ``len(ids) x
        dim`` float32; empty arrays when the pass did not touch the table.
        """
        raise ConfigError("model", f"the {self.name} backend keeps no embedding tables (table {table!r})")

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
