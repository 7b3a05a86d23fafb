"""TensorFlow backend for psdk. Importing this package does not import TensorFlow.

:func:`record_gradients` is the one function a training script needs from
here (see :mod:`psdk_tf.models`), with :func:`mark_table` for a model that
looks up an embedding table of its own (:mod:`psdk_tf.tables`); they are
looked up lazily, so that psdk can import :mod:`psdk_tf.plugin` to list
backends without loading TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["mark_table", "record_gradients"]

if TYPE_CHECKING:
    from psdk_tf.models import record_gradients
    from psdk_tf.tables import mark_table


def __getattr__(name: str) -> Any:
    if name == "record_gradients":
        return importlib.import_module("psdk_tf.models").record_gradients
    if name == "mark_table":
        return importlib.import_module("psdk_tf.tables").mark_table
    raise AttributeError(f"module 'psdk_tf' has no attribute {name!r}")
