"""psdk: a pluggable, framework-agnostic parameter server over ZeroMQ.

The public API is re-exported here lazily, so ``import psdk`` stays cheap and
a plugin can import :data:`hookimpl` without pulling in sockets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from psdk.hookspecs import BackendRecord, hookimpl

__version__ = "0.1.0"

_LAZY = {
    "ClusterSpec": "psdk.cluster",
    "Topology": "psdk.cluster",
    "connect": "psdk.api",
    "WorkerSession": "psdk.api",
    "DistributedOptimizer": "psdk.api",
    "ClientOptions": "psdk.client",
    "StepResult": "psdk.client",
    "SyncSpec": "psdk.consistency",
    "Backend": "psdk.backend",
    "ModelSpec": "psdk.models",
    "init_weights": "psdk.models",
    "PsdkError": "psdk.errors",
}

__all__ = [
    "Backend",
    "BackendRecord",
    "ClientOptions",
    "ClusterSpec",
    "DistributedOptimizer",
    "ModelSpec",
    "PsdkError",
    "StepResult",
    "SyncSpec",
    "Topology",
    "WorkerSession",
    "__version__",
    "connect",
    "hookimpl",
    "init_weights",
]

if TYPE_CHECKING:
    from psdk.api import DistributedOptimizer, WorkerSession, connect
    from psdk.backend import Backend
    from psdk.client import ClientOptions, StepResult
    from psdk.cluster import ClusterSpec, Topology
    from psdk.consistency import SyncSpec
    from psdk.errors import PsdkError
    from psdk.models import ModelSpec, init_weights


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psdk' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
