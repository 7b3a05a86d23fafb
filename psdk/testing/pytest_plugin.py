"""psdk's pytest plugin (entry point ``pytest11``): fixtures for backend authors' tests.

Loaded automatically where psdk is installed; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``
set, add ``-p psdk.testing.pytest_plugin``. The conformance suite itself is a
class to subclass (:class:`psdk.testing.BackendConformance`); it does not depend
on these fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from psdk.testing.ps import RunningPs


@pytest.fixture
def psdk_ps() -> Iterator[RunningPs]:
    """One ps task as a thread, over ``inproc://`` ZeroMQ; ``psdk_ps.cluster(n)`` for ``connect``."""
    from psdk.testing.ps import running_ps  # sockets only for tests that ask

    with running_ps() as ps:
        yield ps
