"""TensorFlow backend for psdk. Importing this package does not import TensorFlow.

:func:`record_gradients` is the one function a training script needs from
here (see :mod:`psdk_tf.models`); it is looked up lazily, so that psdk can
import :mod:`psdk_tf.plugin` to list backends without loading TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["record_gradients"]

if TYPE_CHECKING:
    from psdk_tf.models import record_gradients


def __getattr__(name: str) -> Any:
    if name == "record_gradients":
        return importlib.import_module("psdk_tf.models").record_gradients
    raise AttributeError(f"module 'psdk_tf' has no attribute {name!r}")
