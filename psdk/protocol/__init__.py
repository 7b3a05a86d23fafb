"""The shared contracts between a worker and its ps tasks.

:mod:`psdk.protocol.ops` declares every op, :mod:`psdk.protocol.jobspec`
what the chief tells each shard at init, :mod:`psdk.protocol.sharding`
which shard holds which variable and its flat layout,
:mod:`psdk.protocol.cluster` who is in the job, and
:mod:`psdk.protocol.numerics` what counts as finite. Both sides import
these; neither imports the other.

The ops' names (``psdk.protocol.OPS``, ``admit``, ``request``...) are
re-exported here, lazily, so ``psdk.protocol`` reads as it did when it was
one module, and importing a contract module does not load the wire format.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(f"module 'psdk.protocol' has no attribute {name!r}")
    return getattr(importlib.import_module("psdk.protocol.ops"), name)
