"""psdk: a pluggable, framework-agnostic parameter server over ZeroMQ.

The public API is re-exported here lazily, so ``import psdk`` stays cheap and
a plugin can import :data:`hookimpl` without pulling in sockets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from psdk import _moved
from psdk.plugins.hookspecs import BackendRecord, DatasetRecord, ModelRecord, TrainerRecord, WorkloadRecord, hookimpl
from psdk.plugins.metrics import MetricSpec

_moved.install()

__version__ = "0.1.0"

_LAZY = {
    "ClusterSpec": "psdk.protocol.cluster",
    "Topology": "psdk.protocol.cluster",
    "connect": "psdk.api",
    "serve": "psdk.ps.serving",
    "PsServer": "psdk.ps.serving",
    "SummaryWriter": "psdk.report.writer",
    "WorkerSession": "psdk.api",
    "DistributedOptimizer": "psdk.api",
    "ClientOptions": "psdk.client",
    "TransportOptions": "psdk.config.options",
    "StepResult": "psdk.client",
    "SyncSpec": "psdk.ps.consistency",
    "Backend": "psdk.plugins.backend",
    "Trainer": "psdk.plugins.trainer",
    "WorkloadOptions": "psdk.plugins.options",
    "Batch": "psdk.plugins.batches",
    "JaggedIds": "psdk.plugins.batches",
    "Shard": "psdk.plugins.batches",
    "ShardRequest": "psdk.plugins.batches",
    "ArrayShard": "psdk.plugins.batches",
    "Dense": "psdk.plugins.variables",
    "Rows": "psdk.plugins.variables",
    "ModelSpec": "psdk.plugins.models",
    "init_weights": "psdk.plugins.models",
    "PsdkError": "psdk.errors",
}

__all__ = [
    "ArrayShard",
    "Backend",
    "BackendRecord",
    "Batch",
    "ClientOptions",
    "ClusterSpec",
    "DatasetRecord",
    "Dense",
    "DistributedOptimizer",
    "JaggedIds",
    "MetricSpec",
    "ModelRecord",
    "ModelSpec",
    "PsServer",
    "PsdkError",
    "Rows",
    "Shard",
    "ShardRequest",
    "StepResult",
    "SummaryWriter",
    "SyncSpec",
    "Topology",
    "Trainer",
    "TrainerRecord",
    "TransportOptions",
    "WorkerSession",
    "WorkloadOptions",
    "WorkloadRecord",
    "__version__",
    "connect",
    "hookimpl",
    "init_weights",
    "rules",
    "serve",
]
_SUBMODULES = ("rules", "plugins", "testing")
"""Reached as attributes (``psdk.rules.Adam``) without an import of their own."""

if TYPE_CHECKING:
    from psdk import rules
    from psdk.api import DistributedOptimizer, WorkerSession, connect
    from psdk.client import ClientOptions, StepResult
    from psdk.config.options import TransportOptions
    from psdk.errors import PsdkError
    from psdk.plugins.backend import Backend
    from psdk.plugins.batches import ArrayShard, Batch, JaggedIds, Shard, ShardRequest
    from psdk.plugins.models import ModelSpec, init_weights
    from psdk.plugins.options import WorkloadOptions
    from psdk.plugins.trainer import Trainer
    from psdk.plugins.variables import Dense, Rows
    from psdk.protocol.cluster import ClusterSpec, Topology
    from psdk.ps.consistency import SyncSpec
    from psdk.ps.serving import PsServer, serve
    from psdk.report.writer import SummaryWriter


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"psdk.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psdk' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
