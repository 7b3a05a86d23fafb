"""The worker's side of the ps (see :mod:`psdk.client.client`).

Names load lazily: :mod:`psdk.client.recovery` and the client's parts import
:mod:`psdk.client.shards` without loading the client itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ParameterClient": "psdk.client.client",
    "ClientOptions": "psdk.client.options",
    "Heartbeat": "psdk.client.heartbeat",
    "Basis": "psdk.client.shards",
    "Shard": "psdk.client.shards",
    "StepResult": "psdk.client.shards",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'psdk.client' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
