"""Fixtures of the torch plugin's tests, which run in a pytest process of their own (never with TensorFlow).

Nothing here knows where this folder is: MNIST comes from psdk's pytest
plugin (``psdk_mnist_dir``, from ``$PSDK_DATA_DIR``) and a ps to train against
from ``psdk_ps``, so the folder's tests pass wherever it is copied once psdk
is installed (psdk's ``tests/test_plugin_folder.py`` copies it out to check).
"""

from __future__ import annotations

import numpy as np
import pytest
from psdk_torch.backend import TorchBackend

from psdk import plugins
from psdk.plugins.models import ModelSpec
from psdk.testing.conformance import random_batch

SPEC = ModelSpec(name="small", hidden=(32, 16), input_dim=50, num_classes=10)


def batch(size: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return random_batch(SPEC, size, seed)


@pytest.fixture
def backend() -> TorchBackend:
    """The torch backend as a job gets it (record and options attached), not set up."""
    made = plugins.load_backend("torch")
    assert isinstance(made, TorchBackend)
    return made
