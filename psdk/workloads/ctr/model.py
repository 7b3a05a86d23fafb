"""The ``dlrm`` model's spec, and its forward and backward passes in numpy: the reference every framework matches.

DLRM-style: the 26 fields' rows of one table ``emb`` (``dim`` wide); a bottom
MLP over the 13 dense features (13 -> 64 -> dim, ReLU after each); the
interaction, all pairwise dot products ``i < j`` of the 27 vectors
``[bottom output, emb of field 0, ..., emb of field 25]`` (351 values, in
``np.triu_indices(27, 1)`` order, row-major); the top MLP over
``[bottom output (dim), the 351 products]`` (367 -> 64 -> 1, ReLU between)
gives the logit. Order as in Facebook's DLRM (``R = cat([x] + [Zflat])``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.errors import ConfigError, PluginError
from psdk.plugins.models import init_weights
from psdk.plugins.variables import Rows
from psdk.workloads.ctr.data import DENSE, FIELDS, TABLE


@dataclass(frozen=True)
class DlrmSpec:
    """Fields are the job's ``model.*`` keys (``model=dlrm model.capacity=10000000 model.dim=16``)."""

    name: str = "dlrm"
    dim: int = 16
    capacity: int = 1_000_000
    """The table's ids: the data hashes every field into [0, capacity)."""
    bottom: tuple[int, ...] = field(default=(64,))
    """The bottom MLP's hidden widths; its last layer is ``dim`` wide."""
    top: tuple[int, ...] = field(default=(64,))
    """The top MLP's hidden widths; its last layer is the logit."""
    init_scale: float = 0.01
    """The rows' initial standard deviation (drawn on the ps from the seed and the id)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bottom", tuple(int(h) for h in self.bottom))
        object.__setattr__(self, "top", tuple(int(h) for h in self.top))
        if min((self.dim, self.capacity, *self.bottom, *self.top)) < 1:
            raise ConfigError("model", f"the dlrm model's sizes must be positive: {self}")

    @property
    def interactions(self) -> int:
        vectors = FIELDS + 1
        return vectors * (vectors - 1) // 2

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each dense layer: ``bottom0..``, then ``top0..``."""
        bottom = [DENSE, *self.bottom, self.dim]
        top = [self.dim + self.interactions, *self.top, 1]
        return [(f"bottom{i}", bottom[i], bottom[i + 1]) for i in range(len(bottom) - 1)] + [
            (f"top{i}", top[i], top[i + 1]) for i in range(len(top) - 1)
        ]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    def tables(self) -> dict[str, Rows]:
        return {TABLE: Rows(dim=self.dim, capacity=self.capacity, init_scale=self.init_scale)}

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Glorot-uniform kernels and zero biases, drawn in numpy so every backend starts alike (rows: the ps's)."""
        return init_weights(self, seed)


def _mlp(
    weights: Mapping[str, np.ndarray], prefix: str, count: int, x: np.ndarray, last_relu: bool
) -> list[np.ndarray]:
    """The activations of an MLP: ``[input, layer 0's output, ...]``."""
    acts = [x]
    for i in range(count):
        h = acts[-1] @ weights[f"{prefix}{i}/kernel"] + weights[f"{prefix}{i}/bias"]
        acts.append(np.maximum(h, 0.0) if (last_relu or i < count - 1) else h)
    return acts


def _mlp_backward(
    weights: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], prefix: str, acts: list[np.ndarray],
    d_out: np.ndarray, last_relu: bool,
) -> np.ndarray:  # fmt: skip
    """Accumulate the MLP's gradients into ``grads``; return the gradient at its input."""
    count = len(acts) - 1
    d = d_out
    for i in reversed(range(count)):
        if last_relu or i < count - 1:
            d = d * (acts[i + 1] > 0)
        grads[f"{prefix}{i}/kernel"][...] += acts[i].T @ d
        grads[f"{prefix}{i}/bias"][...] += d.sum(axis=0)
        d = d @ weights[f"{prefix}{i}/kernel"].T
    return d


@dataclass
class Forward:
    """What a forward pass keeps for its backward pass."""

    bottom: list[np.ndarray]
    vectors: np.ndarray
    top: list[np.ndarray]

    @property
    def logits(self) -> np.ndarray:
        return self.top[-1][:, 0]


def forward(spec: DlrmSpec, weights: Mapping[str, np.ndarray], dense: np.ndarray, rows: np.ndarray) -> Forward:
    """The logits of a batch: ``dense`` [B, 13], ``rows`` [B, 26, dim] (each example's fields' rows)."""
    bottom = _mlp(weights, "bottom", len(spec.bottom) + 1, dense, last_relu=True)
    vectors = np.concatenate([bottom[-1][:, None, :], rows], axis=1)
    upper = np.triu_indices(FIELDS + 1, 1)
    products = np.matmul(vectors, vectors.transpose(0, 2, 1))[:, upper[0], upper[1]]
    top = _mlp(weights, "top", len(spec.top) + 1, np.concatenate([bottom[-1], products], axis=1), last_relu=False)
    return Forward(bottom, vectors, top)


def backward(
    spec: DlrmSpec, weights: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], fwd: Forward,
    d_logits: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Accumulate the dense gradients into ``grads``; return the rows' gradients [B, 26, dim]."""
    d_top_in = _mlp_backward(
        weights, grads, "top", fwd.top, d_logits[:, None].astype(fwd.vectors.dtype), last_relu=False
    )
    dim, n = spec.dim, len(d_logits)
    upper = np.triu_indices(FIELDS + 1, 1)
    d_products = np.zeros((n, FIELDS + 1, FIELDS + 1), fwd.vectors.dtype)
    d_products[:, upper[0], upper[1]] = d_top_in[:, dim:]
    d_vectors = np.matmul(d_products + d_products.transpose(0, 2, 1), fwd.vectors)
    d_bottom = d_top_in[:, :dim] + d_vectors[:, 0]
    _mlp_backward(weights, grads, "bottom", fwd.bottom, d_bottom, last_relu=True)
    return d_vectors[:, 1:]


def table_of(spec: Any, framework: str) -> Rows:
    """The spec's table ``emb``: the ``psdk.Rows`` its ``tables()`` gives (the dense layers are its ``variables()``).

    Every framework's ctr trainer needs it; ``framework`` names the one asking in the error.
    """
    tables = getattr(spec, "tables", None)
    declared = tables() if callable(tables) else None
    if isinstance(declared, Mapping) and isinstance(declared.get(TABLE), Rows):
        return declared[TABLE]
    raise PluginError(
        f"the ctr model on {framework} needs the spec's table {TABLE!r}: {type(spec).__name__}.tables() gives no "
        f"psdk.Rows named {TABLE!r} (use model=dlrm)"
    )


def fields_of(top_inputs: int, dim: int) -> int:
    """The categorical fields whose dot products (with the bottom output) make ``top_inputs`` inputs with it.

    A framework's ctr trainer shapes its gathered rows with this count rather
    than inferring it from them: a batch of no examples has no rows to infer
    it from (JAX refuses a ``-1`` beside a zero-size axis).
    """
    products = top_inputs - dim
    vectors = (1 + math.isqrt(1 + 8 * products)) // 2 if products > 0 else 0
    if vectors < 2 or vectors * (vectors - 1) // 2 != products:
        raise ConfigError(
            "model",
            f"top0 takes {top_inputs} inputs: not the bottom output ({dim}) plus the dot products of the bottom "
            "output and some fields' rows",
        )
    return vectors - 1
