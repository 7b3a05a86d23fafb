"""The one place this plugin imports TensorFlow and Keras, after quieting them.

``TF_CPP_MIN_LOG_LEVEL=2`` hides TensorFlow's C++ INFO and WARNING lines
(CPU feature notes, device listings) that every worker would otherwise print
at start. It is only a default: a user who set the variable keeps their
value. One line, oneDNN's "custom operations are on", is printed while the
library loads and honours the variable only when it is in the environment
before Python starts (``TF_CPP_MIN_LOG_LEVEL=2 python -m psdk run ...``).

Keras 3 can run on several frameworks; this backend needs it on TensorFlow,
so ``KERAS_BACKEND`` defaults to ``tensorflow`` here and any other choice
made before is refused with a message saying so.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import tensorflow as tf

from psdk.errors import PluginError

if keras.backend.backend() != "tensorflow":
    raise PluginError(
        f"the tf backend needs Keras on TensorFlow, but Keras runs on {keras.backend.backend()!r} "
        "(KERAS_BACKEND); unset KERAS_BACKEND or set it to tensorflow"
    )

__all__ = ["keras", "tf"]
