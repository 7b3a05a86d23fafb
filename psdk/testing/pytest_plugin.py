"""psdk's pytest plugin (entry point ``pytest11``): fixtures for plugin authors' tests.

Loaded automatically where psdk is installed; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``
set, add ``-p psdk.testing.pytest_plugin``. The conformance suites themselves are
classes to subclass (:class:`psdk.testing.BridgeConformance`,
:class:`psdk.testing.TrainerConformance`); they do not depend on these fixtures.
Nothing here knows where a plugin's folder is: a plugin's tests pass wherever
the folder is copied, once psdk is installed and MNIST is given by ``PSDK_DATA_DIR``.

Every session of anyone who installs psdk loads this module, so it adds
fixtures only, each named ``psdk_...`` so none shadows or is shadowed by a
project's own, and no hook: :class:`psdk.testing.RuleAgreement` parametrizes
its own test from its class.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

if TYPE_CHECKING:
    from psdk.testing.ps import RunningPs


@pytest.fixture
def psdk_ps() -> Iterator[RunningPs]:
    """One ps task as a thread, over ``inproc://`` ZeroMQ; ``psdk_ps.cluster(n)`` for ``connect``."""
    from psdk.testing.ps import running_ps  # sockets only for tests that ask

    with running_ps() as ps:
        yield ps


@pytest.fixture(scope="session")
def psdk_mnist_dir() -> Path:
    """The MNIST folder ``$PSDK_DATA_DIR`` names; the test fails, saying how to fix it, when it is not there."""
    value = os.environ.get("PSDK_DATA_DIR")
    if not value:
        pytest.fail("set PSDK_DATA_DIR to a folder with the four MNIST IDX files (python -m psdk data fetches them)")
    folder = Path(value).expanduser().resolve()
    missing = [name for name in MNIST_FILES if not any(folder.glob(f"{name}*"))]
    if missing:
        pytest.fail(f"PSDK_DATA_DIR={value} lacks {', '.join(missing)} (gzipped or not)")
    return folder
