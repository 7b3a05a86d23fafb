"""The TensorFlow bridge. This module imports TensorFlow; psdk loads it only when it is used.

TensorFlow 2, eager. The bridge knows variables, weights, gradients,
optimizers and devices; a workload's trainer brings the loss (MNIST's is
:mod:`psdk_tf.mnist`), which each model compiles once into a
``tf.function`` step. What lives where:

* :mod:`psdk_tf.models`: psdk's own network (canonical by construction, the
  fast path) and Keras models from training scripts (named from their Keras
  variable paths), with their weights and gradients as numpy arrays, and
  each trainer's compiled steps;
* :mod:`psdk_tf.tables`: embedding tables (Keras ``Embedding`` weights and
  variables marked with :func:`~psdk_tf.tables.mark_table`): rows scattered in,
  ``tf.IndexedSlices`` gradients out, never a whole table;
* a model that is its own binding (:class:`~psdk_tf.models.OwnBinding`), as the
  click-through trainer's (:mod:`psdk_tf.ctr`), whose table holds only the rows
  the ps sent: the bridge hands its calls over;
* :mod:`psdk_tf.optimizers`: Keras optimizers to and from psdk update rules;
* :mod:`psdk_tf.placement`: psdk's device string to TensorFlow's device setup.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.backend import Backend
from psdk.plugins.backends import kit
from psdk.plugins.models import ModelSpec
from psdk.plugins.variables import Variable, as_variables
from psdk.rules import UpdateRule
from psdk_tf import optimizers, placement
from psdk_tf._tf import tf
from psdk_tf.models import DenseStack, ForeignModel, OwnBinding, binding


class TfBackend(Backend):
    def __init__(self) -> None:
        self.plan = placement.CPU
        self.tf_devices: list[str] = []
        """TensorFlow's device of each tower (:meth:`setup_towers`); empty without towers."""

    def setup(
        self,
        device: str = "cpu",
        threads: int | None = None,
        gpu_memory_fraction: float | None = None,
    ) -> None:
        gpus = len(tf.config.list_physical_devices("GPU"))
        index = placement.gpu_to_use(device, gpus)
        total = None
        if gpu_memory_fraction is not None and index is not None:
            total = placement.total_memory_mb(placement.physical_id(index))
        growth_left_to_tf = "TF_FORCE_GPU_ALLOW_GROWTH" in os.environ
        self.plan = placement.plan(device, gpus, gpu_memory_fraction, total, growth_left_to_tf)
        placement.apply(self.plan, threads, tf)
        self.device = self.plan.device

    def setup_towers(
        self, devices: Sequence[str], threads: int | None = None, gpu_memory_fraction: float | None = None
    ) -> None:
        """A replica per device: ``cuda:N`` on that GPU, ``cpu:K`` on logical CPU device K (made before
        TensorFlow's runtime starts: :func:`psdk_tf.placement.apply_towers`)."""
        names = kit.fall_back_towers(devices, len(tf.config.list_physical_devices("GPU")), "TensorFlow")
        self.tf_devices = placement.apply_towers(names, threads, gpu_memory_fraction, tf)
        self.tower_devices = names
        self.device = names[0]

    def tf_device(self) -> str:
        """TensorFlow's device the calling thread builds and computes on (its tower's, with towers)."""
        return self.tf_devices[self.tower_index] if self.tf_devices else self.plan.tf_device

    @contextmanager
    def tower(self, index: int) -> Iterator[None]:
        """Tower ``index``'s device as TensorFlow 1's towers had it: ``with tf.device(...)``, for this thread."""
        with super().tower(index), tf.device(self.tf_device()):
            yield

    # ---------------------------------------------------------------- model
    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> DenseStack:
        with tf.device(self.tf_device()):
            return DenseStack(spec, weights)

    def variables(self, model: Any) -> dict[str, tuple[int, ...]]:
        """The dense variables: embedding tables are left out (see :meth:`variable_records`)."""
        return {name: tuple(int(d) for d in var.shape) for name, var in binding(model).dense}

    def variable_records(self, model: Any) -> dict[str, Variable]:
        """Every variable in creation order: tables as their ``Rows``, the rest dense."""
        bound = binding(model)
        shapes = self.variables(model)
        return as_variables((name, bound.tables.get(name) or shapes[name]) for name, _ in bound.named)

    def read_weights(self, model: Any) -> dict[str, np.ndarray]:
        return binding(model).read()

    def write_weights(self, model: Any, weights: Mapping[str, np.ndarray]) -> None:
        binding(model).write(weights)

    def read_gradients(self, model: Any, out: Mapping[str, np.ndarray]) -> None:
        binding(model).read_gradients(out)

    def write_rows(self, model: Any, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        self._with_tables(model, table).write_rows(table, ids, rows)

    def read_row_gradients(self, model: Any, table: str) -> tuple[np.ndarray, np.ndarray]:
        """The table's row gradients as the model left them: a script's lookups' ``tf.IndexedSlices`` as numpy,
        unconverted (a row per lookup), the ctr model's summed per id; a dense gradient on a table is refused."""
        return self._with_tables(model, table).read_row_gradients(table)

    def _with_tables(self, model: Any, table: str) -> ForeignModel | OwnBinding:
        bound = binding(model)
        if isinstance(bound, DenseStack):
            raise ConfigError("model", f"psdk's dense stack keeps no embedding tables (table {table!r})")
        return bound

    # ------------------------------------------------------------ optimizer
    def make_optimizer(self, model: Any, rule: UpdateRule) -> Any:
        return optimizers.make_optimizer(rule)

    def optimizer_rule(self, optimizer: Any) -> UpdateRule:
        return optimizers.optimizer_rule(optimizer)
