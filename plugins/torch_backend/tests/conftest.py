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
from psdk_torch.mnist import TorchClassifier

from psdk import plugins
from psdk.plugins.batches import Batch
from psdk.plugins.models import ModelSpec
from psdk.workloads.mnist.trainers import IMAGE

SPEC = ModelSpec(name="small", hidden=(32, 16), input_dim=50, num_classes=10)


def batch(size: int = 64, seed: int = 0) -> Batch:
    """An MNIST-shaped batch of ``SPEC``'s size: random images in [0, 1] and labels, from ``seed``."""
    rng = np.random.default_rng(seed)
    images = rng.random((size, SPEC.input_dim), dtype=np.float32)
    return Batch({IMAGE: images}, rng.integers(0, SPEC.num_classes, size))


@pytest.fixture
def backend() -> TorchBackend:
    """The torch backend as a job gets it (record and options attached), not set up."""
    made = plugins.load_backend("torch")
    assert isinstance(made, TorchBackend)
    return made


@pytest.fixture
def trainer(backend: TorchBackend) -> TorchClassifier:
    """MNIST's torch trainer on that backend."""
    return TorchClassifier(backend)
