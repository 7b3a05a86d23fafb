"""The JAX backend, the bridge between JAX and the ps. This module imports JAX and optax; psdk loads it only when used.

It moves weights and gradients (and an embedding table's rows, gathered by
id: see :mod:`psdk_jax.models`), builds psdk's dense stacks, places JAX on a
device and maps optax to the ps's rules; it knows no loss or metric. Those
are a workload's trainer's: MNIST's is :class:`psdk_jax.mnist.JaxClassifier`.

What lives where:

* :mod:`psdk_jax.models`: psdk's dense networks as a params dict of jax arrays
  with a ``jax.jit``-compiled ``value_and_grad`` step per trainer's loss,
  canonical by construction;
* :mod:`psdk_jax.mnist`: MNIST's trainer (its loss, its predictions);
* :mod:`psdk_jax.optimizers`: psdk update rules as optax transformations, and
  why an optax optimizer alone cannot name the ps's rule;
* :mod:`psdk_jax.placement`: psdk's device string and thread count to JAX's
  setup.

The plugin's options (``backend_options.jax.<key>``, defaults in
:data:`psdk_jax.plugin.OPTIONS`) pick ``jit``, the matmul precision and the
persistent compilation cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk.rules import UpdateRule
from psdk_jax import optimizers, placement
from psdk_jax.models import DenseStack

PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
"""The ``matmul_precision`` values offered (``jax.lax.Precision`` names and ``jax_default_matmul_precision``'s)."""


class JaxBackend(Backend):
    def __init__(self) -> None:
        self.jax_device: Any = None
        self.jax_devices: list[Any] = []
        """The JAX device of each tower (:meth:`setup_towers`); empty without towers."""

    # ------------------------------------------------------------ placement
    def _cache(self) -> None:
        cache = self.option("compilation_cache_dir")
        if cache:
            jax.config.update("jax_compilation_cache_dir", str(cache))
            # psdk's programs compile in well under JAX's default threshold of 1 s: cache them all.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def setup(self, device: str = "cpu", threads: int | None = None, gpu_memory_fraction: float | None = None) -> None:
        self._cache()
        placement.start(device, threads, gpu_memory_fraction, jax)
        self.device, self.jax_device = placement.choose(device, placement.gpu_devices(jax), jax.devices("cpu")[0])
        jax.config.update("jax_default_device", self.jax_device)

    def setup_towers(
        self, devices: Sequence[str], threads: int | None = None, gpu_memory_fraction: float | None = None
    ) -> None:
        """A replica per device: ``cuda:N`` JAX's N-th GPU, ``cpu:K`` its K-th CPU device (one per tower is
        asked for before JAX starts, :func:`psdk_jax.placement.start`)."""
        self._cache()
        placement.start(devices[0], threads, gpu_memory_fraction, jax, cpu_devices=len(devices))
        chosen = placement.choose_towers(devices, placement.gpu_devices(jax), jax.devices("cpu"))
        self.tower_devices = [name for name, _ in chosen]
        self.jax_devices = [device for _, device in chosen]
        self.device, self.jax_device = chosen[0]
        jax.config.update("jax_default_device", self.jax_device)

    def device_handle(self) -> Any:
        """The JAX device of ``setup`` (the calling thread's tower's, with towers); the default one for a
        backend used without it (as the suite does).

        For a model plugin's builder, with :meth:`precision` and ``option("jit")``: what
        :class:`psdk_jax.models.DenseStack` (and a subclass of it) is built with.
        """
        if self.jax_devices:
            return self.jax_devices[self.tower_index]
        return self.jax_device if self.jax_device is not None else jax.devices()[0]

    def precision(self) -> str:
        """``backend_options.jax.matmul_precision``, checked."""
        value = str(self.option("matmul_precision")).lower()
        if value not in PRECISIONS:
            raise ConfigError("backend_options.jax.matmul_precision", f"got {value!r}", PRECISIONS)
        return value

    # ---------------------------------------------------------------- model
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> DenseStack:
        return DenseStack(spec, weights, self.device_handle(), jit=bool(self.option("jit")), precision=self.precision())

    def variables(self, model: DenseStack) -> dict[str, tuple[int, ...]]:
        return dict(model.shapes)

    def read_weights(self, model: DenseStack) -> dict[str, np.ndarray]:
        return model.read()

    def write_weights(self, model: DenseStack, weights: Mapping[str, np.ndarray]) -> None:
        model.write(weights)

    def read_gradients(self, model: DenseStack, out: Mapping[str, np.ndarray]) -> None:
        model.read_gradients(out)

    # --------------------------------------------------------------- tables
    def variable_records(self, model: DenseStack) -> dict[str, Variable]:
        """The dense params, then the model's embedding tables (``DenseStack(..., tables=...)``) as rows."""
        return {**as_variables(self.variables(model)), **model.tables}

    def write_rows(self, model: DenseStack, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        model.write_rows(table, ids, rows)

    def read_row_gradients(self, model: DenseStack, table: str) -> tuple[np.ndarray, np.ndarray]:
        return model.row_gradients(table)

    # ------------------------------------------------------------ optimizer
    def make_optimizer(self, model: Any, rule: UpdateRule) -> Any:
        return optimizers.make_optimizer(rule)

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        return optimizers.optimizer_rule(optimizer)
