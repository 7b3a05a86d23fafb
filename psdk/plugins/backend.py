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

A backend written before workloads existed defined ``forward_backward`` and
``accuracy`` itself; :func:`psdk.plugins.load_backend` refuses one, naming
what to move where (docs/writing-a-backend.md, 'Moving a backend to a bridge').

The module that defines a backend class may import its framework at the
top: psdk imports it only when the backend is used. The module that
registers it (the plugin's entry point) must not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk.ps.rules import UpdateRule

if TYPE_CHECKING:
    from psdk.plugins.hookspecs import BackendRecord


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
