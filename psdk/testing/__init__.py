"""Testing helpers for plugin and transport authors: conformance suites and a ps to train against.

A framework plugin checks its bridge and its trainers apart (:mod:`psdk.testing.conformance`)::

    from psdk.testing import BridgeConformance, TrainerConformance

    class TestMyBridge(BridgeConformance):
        backend_name = "mybackend"

    class TestMyMnistTrainer(TrainerConformance):
        backend_name = "mybackend"   # the MNIST trainer for its framework

:class:`BackendConformance` is both at once, for a backend and psdk's MNIST trainer on it.

A transport's tests subclass :class:`TransportConformance` and override its
``transport_factory`` fixture (see :mod:`psdk.testing.transport_conformance`).

Attributes are looked up lazily, so the pytest plugin (:mod:`psdk.testing.pytest_plugin`,
loaded in every pytest session where psdk is installed) costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "BackendConformance": "psdk.testing.conformance",
    "BridgeConformance": "psdk.testing.conformance",
    "TrainerConformance": "psdk.testing.conformance",
    "TableConformance": "psdk.testing.table_conformance",
    "TransportConformance": "psdk.testing.transport_conformance",
    "RuleAgreement": "psdk.testing.rule_agreement",
    "running_ps": "psdk.testing.ps",
    "run_job": "psdk.testing.jobs",
    "assert_every_worker_contributed": "psdk.testing.jobs",
}

__all__ = [
    "BackendConformance",
    "BridgeConformance",
    "RuleAgreement",
    "TableConformance",
    "TrainerConformance",
    "TransportConformance",
    "assert_every_worker_contributed",
    "run_job",
    "running_ps",
]

if TYPE_CHECKING:
    from psdk.testing.conformance import BackendConformance, BridgeConformance, TrainerConformance
    from psdk.testing.jobs import assert_every_worker_contributed, run_job
    from psdk.testing.ps import running_ps
    from psdk.testing.rule_agreement import RuleAgreement
    from psdk.testing.table_conformance import TableConformance
    from psdk.testing.transport_conformance import TransportConformance


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psdk.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
