"""JAX backend for psdk. Importing this package does not import JAX.

:func:`record_gradients` hands a training script's own gradients to
``opt.step()`` (see :mod:`psdk_jax.models`), and :func:`make_optimizer` gives
the optax optimizer a psdk rule stands for (:mod:`psdk_jax.optimizers`); both
are looked up lazily, so that psdk can import :mod:`psdk_jax.plugin` to list
backends without loading JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["DenseStack", "make_optimizer", "record_gradients"]

_LAZY = {
    "DenseStack": "psdk_jax.models",
    "record_gradients": "psdk_jax.models",
    "make_optimizer": "psdk_jax.optimizers",
}

if TYPE_CHECKING:
    from psdk_jax.models import DenseStack, record_gradients
    from psdk_jax.optimizers import make_optimizer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psdk_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
