"""``resmlp`` on the JAX backend: psdk-jax's compiled model with this network as its pure function.

psdk-jax's :class:`~psdk_jax.models.DenseStack` holds the canonical params
dict and compiles each trainer's loss into one training step around the
network's pure function ``apply`` (here the logits); a model with another
architecture overrides ``apply`` and inherits the rest (staging, one transfer
per step, the outputs). The loss is the workload's trainer's (MNIST's:
``psdk_jax.mnist``), so this model trains under any workload whose outputs it fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from psdk_jax.models import DenseStack

from psdk_example.resmlp import ResMlpSpec


class ResMlp(DenseStack):
    def apply(self, params: Mapping[str, Any], x: Any) -> Any:
        def dense(name: str, h: Any) -> Any:
            return jnp.matmul(h, params[f"{name}/kernel"], precision=self.precision) + params[f"{name}/bias"]

        h = jax.nn.relu(dense("stem", x))
        for i in range(self.spec.blocks):  # type: ignore[attr-defined]
            h = h + jax.nn.relu(dense(f"block{i + 1}", h))
        return dense("logits", h)


def build(backend: Any, spec: ResMlpSpec, weights: Mapping[str, np.ndarray]) -> ResMlp:
    """The model on the backend's device, compiled as the backend's options say (``jit``, precision)."""
    device, precision = backend.device_handle(), backend.precision()
    # DenseStack takes any spec with layers() and variables(); it is typed for psdk's own ModelSpec.
    return ResMlp(spec, weights, device, jit=bool(backend.option("jit")), precision=precision)  # type: ignore[arg-type]
