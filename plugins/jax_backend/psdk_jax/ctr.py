"""The click-through workload's trainer on JAX: a DLRM-style model, mean BCE with logits, logits out.

psdk's ``ctr`` workload names no framework; this plugin gives it a JAX
trainer through ``psdk_register_trainers`` (:mod:`psdk_jax.plugin`), as it
gives MNIST one. The model is the workload's (:mod:`psdk.workloads.ctr.model`,
the numpy reference every framework matches): one shared table ``emb`` that
every categorical field looks its ids up in, a bottom MLP over the dense
features (ReLU after each layer), the pairwise dot products ``i < j`` of the
27 vectors ``[bottom output, row of field 0, ..., row of field 25]`` in
``np.triu_indices`` order, and a top MLP over ``[bottom output, the dots]``
(ReLU between its layers) to one logit.

The table is JAX's way with sparse (:mod:`psdk_jax.models`): its rows live
in a local numpy array indexed by id (``np.zeros``, whose pages Linux maps
only when the ps's rows are written, so a ten-million-row table costs no
memory until rows arrive) and are gathered outside ``jax.jit``, one row per
(example, field): the compiled step takes ``[B * 26, dim]`` rows, a shape
fixed at a fixed batch size, where the batch's unique ids (a number that
changes every batch) would compile a new step each time. A training step
takes the rows of the batch's distinct ids instead, padded with zero rows to
that same fixed count, and each lookup's position among them (the batch's
``JaggedIds``, sorted once per batch); ``jax.jit`` gathers per lookup, and
the gradient comes back summed per id, in order, the row gradient psdk
pushes: nothing is left for the worker to sort or sum. Dense variables are
canonical by construction: ``bottom<i>`` and ``top<i>``, kernels (in, out).
This module imports JAX; psdk imports it only when a job trains ``ctr`` on
JAX.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.batches import Batch, JaggedIds
from psdk.plugins.trainer import Trainer
from psdk.workloads.ctr.data import CAT_INPUT, DENSE_INPUT, TABLE, own_lookups
from psdk.workloads.ctr.model import fields_of, table_of
from psdk_jax.backend import JaxBackend
from psdk_jax.models import DenseStack

_LAYER = re.compile(r"^(bottom|top)(\d+)/kernel$")


def layer_sizes(spec: Any) -> dict[str, list[tuple[int, int]]]:
    """(fan_in, fan_out) of the ``bottom`` and the ``top`` MLP's layers, numbered from 0, from the spec's kernels."""
    sizes: dict[str, dict[int, tuple[int, int]]] = {"bottom": {}, "top": {}}
    for name, shape in spec.variables():
        match = _LAYER.match(name)
        if match is not None:
            sizes[match[1]][int(match[2])] = (int(shape[0]), int(shape[1]))
        elif not re.match(r"^(bottom|top)\d+/bias$", name):
            raise ConfigError("model", f"the ctr model on JAX has dense layers bottom<i> and top<i>, not {name!r}")
    out = {part: [found[i] for i in range(len(found))] if sorted(found) == list(range(len(found))) else []
           for part, found in sizes.items()}  # fmt: skip
    if not out["bottom"] or not out["top"] or out["top"][-1][1] != 1:
        raise ConfigError(
            "model",
            f"the ctr model needs dense layers bottom0.. and top0.., numbered from 0, the last giving one logit; "
            f"got bottom {sorted(sizes['bottom'])}, top {sorted(sizes['top'])}",
        )
    return out


class ClickStack(DenseStack):
    """DLRM as a :class:`~psdk_jax.models.DenseStack`: ``apply(params, dense)`` reads the gathered rows as
    ``params["emb"]`` ([B * fields, dim], field-major per example, as ``cat.reshape(-1)`` orders them)."""

    def __init__(self, spec: Any, weights: Mapping[str, np.ndarray], device: Any = None, **options: Any):
        table = table_of(spec, "JAX")
        sizes = layer_sizes(spec)
        if sizes["bottom"][-1][1] != table.dim:
            raise ConfigError(
                "model",
                f"the bottom MLP's output ({sizes['bottom'][-1][1]}) meets the rows of table {TABLE!r} "
                f"({table.dim} wide) in dot products: make them the same size",
            )
        self.bottom_names = tuple(f"bottom{i}" for i in range(len(sizes["bottom"])))
        self.top_names = tuple(f"top{i}" for i in range(len(sizes["top"])))
        self.dim = table.dim
        self.fields = fields_of(sizes["top"][0][0], table.dim)
        """The categorical fields a batch has, as top0's inputs say: the rows' reshape and the batches' check."""
        super().__init__(spec, weights, device, tables={TABLE: table}, **options)

    def _dense(self, params: Mapping[str, Any], name: str, x: Any) -> Any:
        return jnp.matmul(x, params[f"{name}/kernel"], precision=self.precision) + params[f"{name}/bias"]

    def apply(self, params: Mapping[str, Any], x: Any) -> Any:
        """The logits [B] of dense features ``x`` [B, 13] and the gathered rows ``params["emb"]``."""
        examples, lookups = x.shape[0], params[TABLE].shape[0]  # static: the shapes are known while tracing
        if lookups != examples * self.fields:
            raise ConfigError(
                "model",
                f"the ctr model takes {self.fields} rows of {TABLE!r} per example (top0's "
                f"{self.shapes['top0/kernel'][0]} inputs say {self.fields} categorical fields), got {lookups} rows "
                f"for {examples} examples: the model's fields must be the data's",
            )
        for name in self.bottom_names:
            x = jax.nn.relu(self._dense(params, name, x))
        # The fields explicit, not -1: a batch of no examples has [0, dim] rows, and JAX cannot infer a -1 from them.
        rows = jnp.reshape(params[TABLE], (examples, self.fields, self.dim))
        vectors = jnp.concatenate([x[:, None, :], rows], axis=1)
        gram = jnp.matmul(vectors, jnp.swapaxes(vectors, 1, 2), precision=self.precision)
        upper = np.triu_indices(vectors.shape[1], 1)
        x = jnp.concatenate([x, gram[:, upper[0], upper[1]]], axis=1)
        for i, name in enumerate(self.top_names):
            x = self._dense(params, name, x)
            if i < len(self.top_names) - 1:
                x = jax.nn.relu(x)
        return x[:, 0]

    def check_fields(self, fields: int) -> None:
        """Refuse a batch of ``fields`` categorical fields that top0 does not take, by name.

        The trainer checks the batch's ids ([B, fields]) before ``apply``: the
        rows it gathers are flat, and those of a batch of no examples are
        [0, dim] whatever its fields, so only the ids tell that batch's fields.
        """
        if fields != self.fields:
            products = (fields + 1) * fields // 2
            raise ConfigError(
                "model",
                f"a batch of {fields} categorical fields gives the top MLP {self.dim} bottom outputs and {products} "
                f"dot products ({self.dim + products} inputs), but top0 takes {self.shapes['top0/kernel'][0]}: the "
                "model's fields must be the data's",
            )


def bce_with_logits(model: ClickStack, params: Any, dense: Any, labels: Any) -> Any:
    """Mean binary cross-entropy of the model's logits against 0/1 ``labels``, in its stable form.

    A batch of no examples gives NaN (the mean of nothing) and zero gradients,
    as torch's and TensorFlow's ctr trainers do: it is not made an error here.
    """
    z = model.apply(params, dense)
    return jnp.mean(jnp.maximum(z, 0.0) - z * labels + jnp.log1p(jnp.exp(-jnp.abs(z))))


def ids_of(model: ClickStack, batch: Batch) -> np.ndarray:
    """The batch's ids, one per (example, field), example-major: the order ``apply`` reshapes them in.

    Its fields are checked against the model's here, where the ids still
    have them: a batch of no examples has no rows for ``apply`` to count.
    """
    cat = np.asarray(batch.inputs[CAT_INPUT])
    if cat.ndim != 2:
        raise ConfigError(
            "workload", f"the ctr batch's {CAT_INPUT!r} must be [batch, fields] ids, got shape {cat.shape}"
        )
    model.check_fields(cat.shape[1])
    return cat.reshape(-1)


def lookups_of(model: ClickStack, batch: Batch) -> JaggedIds | np.ndarray:
    """The batch's own ids of the table when it has them (sorted once per batch: the step sums each id's
    gradient in ``jax.jit``); else its ids, one per (example, field)."""
    flat = ids_of(model, batch)
    lookups = own_lookups(batch, flat)
    return lookups if lookups is not None else flat


class JaxCtr(Trainer):
    """``ctr`` on JAX: one compiled value-and-grad step of :func:`bce_with_logits`, logits as float32 numpy [B]."""

    bridge: JaxBackend
    bridge_class = JaxBackend

    def build_model(self, spec: Any, weights: Mapping[str, np.ndarray]) -> ClickStack:
        bridge = self.bridge
        return ClickStack(
            spec, weights, bridge.device_handle(), jit=bool(bridge.option("jit")), precision=bridge.precision()
        )

    def forward_backward(self, model: ClickStack, batch: Batch) -> float:
        dense = np.asarray(batch.inputs[DENSE_INPUT], np.float32)
        labels = np.asarray(batch.targets, np.float32)
        return model.value_and_grad(bce_with_logits, dense, labels, ids={TABLE: lookups_of(model, batch)})

    def predict(self, model: ClickStack, batch: Batch) -> np.ndarray:
        """The logits of ``batch``, float32 [B]; the workload scores their AUC and log loss."""
        return model.outputs(np.asarray(batch.inputs[DENSE_INPUT], np.float32), ids={TABLE: ids_of(model, batch)})
