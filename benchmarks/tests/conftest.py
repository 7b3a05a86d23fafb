"""Fixtures for the peer smoke tests: the MNIST folder and a way to run a peer script.

The tests only run the peer scripts as subprocesses and read their JSON line,
so this pytest process imports neither torch nor TensorFlow.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"
MNIST_DIR = Path(
    os.environ.get("PSDK_DATA_DIR") or os.environ.get("PSDK_TEST_DATA_DIR") or REPO.parent / "shared" / "data" / "mnist"
)  # as tests/conftest.py: the README's PSDK_DATA_DIR first, the suites' old PSDK_TEST_DATA_DIR as an alias

if str(PEERS) not in sys.path:  # _common is framework-free: unit-testable here
    sys.path.insert(0, str(PEERS))


@pytest.fixture(scope="session")
def psdk_mnist_dir() -> Path:
    """psdk's pytest plugin's fixture, overridden with this suite's fallbacks, as tests/conftest.py does."""
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"MNIST is expected in {MNIST_DIR} (set PSDK_DATA_DIR; default: ../shared/data/mnist)")
    return MNIST_DIR


@pytest.fixture
def token() -> str:
    """A marker put in a run's environment, so its processes can be found in /proc afterwards."""
    return uuid.uuid4().hex
