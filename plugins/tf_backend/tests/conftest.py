"""Fixtures of the TensorFlow plugin's tests (a pytest process of their own: no torch here).

A ps to train against comes from psdk's pytest plugin (``psdk_ps``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MNIST_DIR = Path(os.environ.get("PSDK_TEST_DATA_DIR", REPO.parent / "shared" / "data" / "mnist"))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"MNIST is expected in {MNIST_DIR} (../shared/data/mnist beside the repo)")
    return MNIST_DIR
