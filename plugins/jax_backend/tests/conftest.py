"""The JAX plugin's tests run in a pytest process of their own: no torch or TensorFlow here.

Their fixtures (``psdk_mnist_dir`` from ``$PSDK_DATA_DIR``, ``psdk_ps``) come from
psdk's pytest plugin, so this folder passes wherever it is copied once psdk
and this plugin are installed.
"""

from __future__ import annotations

import sys

import pytest

OTHER_FRAMEWORKS = ("torch", "tensorflow", "keras")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Mixed-framework jobs run in subprocesses: another framework loaded here is a mistake of the tests."""
    loaded = [name for name in OTHER_FRAMEWORKS if name in sys.modules]
    if loaded:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nthe JAX plugin's tests imported {', '.join(loaded)} into their pytest process", file=sys.stderr)
