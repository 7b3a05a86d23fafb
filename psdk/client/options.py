"""A worker's options: the transport settings it holds, and how long it waits out a lost ps."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from psdk.config.options import TransportOptions
from psdk.errors import ConfigError
from psdk.protocol.chunks import MAX_CHUNK_ROWS

__all__ = ["ClientOptions"]


@dataclass(frozen=True)
class ClientOptions:
    """A worker's settings: the ``transport.*`` group as it is (its timeouts, and the transport
    :func:`psdk.connect` makes for it), and how long a lost ps is waited out.

    The transport settings are :class:`~psdk.config.options.TransportOptions`, held, never copied: the MNIST
    job passes its ``transport.*`` keys as they are; a transport passed to ``connect`` brings its own sockets.
    """

    transport: TransportOptions = field(default_factory=TransportOptions)
    """Heartbeats, request and init timeouts; for the transport ``connect`` makes: shared memory (False: arrays in
    ZeroMQ frames), doorbells and ZeroMQ I/O threads."""
    recovery_timeout_s: float | None = None
    """When set, a lost ps or a restored job is waited out (this long at most) instead of failing."""
    table_chunk_rows: int = 1 << 14
    """Rows per message when the chief checkpoints or restores an embedding table (docs/tables.md): what a
    checkpoint holds in memory per shard, and what the ps's cap on incoming messages follows during a restore."""

    def __post_init__(self) -> None:
        rows = self.table_chunk_rows
        if not (isinstance(rows, int) and not isinstance(rows, bool) and 1 <= rows <= MAX_CHUNK_ROWS):
            raise ConfigError("table_chunk_rows", f"must be an integer in 1 .. {MAX_CHUNK_ROWS}, got {rows!r}")


def _saying_where_transport_settings_are(init: Callable[..., None]) -> Callable[..., None]:
    """``ClientOptions(heartbeat_timeout_s=5)`` as scripts wrote it before the settings were held once: name the fix."""
    transport_keys = {f.name for f in dataclasses.fields(TransportOptions)}

    @functools.wraps(init)
    def checked(self: ClientOptions, *args: Any, **kwargs: Any) -> None:
        moved = sorted(set(kwargs) & transport_keys)
        if moved:
            given = ", ".join(f"{key}={kwargs[key]!r}" for key in moved)
            raise TypeError(
                f"ClientOptions holds the transport settings in its transport field: write "
                f"ClientOptions(transport=psdk.TransportOptions({given}))"
            )
        init(self, *args, **kwargs)

    return checked


setattr(ClientOptions, "__init__", _saying_where_transport_settings_are(ClientOptions.__init__))  # noqa: B010
