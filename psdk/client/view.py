"""The client as its parts see it: what recovery, the waits and the wrap-up use of :class:`ParameterClient`.

:mod:`psdk.client.client` imports those parts to call them; were they to
import it back for its type, the client and its parts would be a circle a
reader has to untangle (``tests/test_structure.py`` counts type-only imports
too). They take this :class:`ClientView` instead, and ``ParameterClient``
matches it without naming it: mypy checks each call that hands it over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np

from psdk.client.checkpoint import Checkpoint
from psdk.client.heartbeat import Heartbeat
from psdk.client.shards import Shard, StepResult
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec
from psdk.transport import ClientEndpoint, Pending
from psdk.transport.wire import Message

T = TypeVar("T")


class HeartbeatOptions(Protocol):
    """The transport settings the client's parts read."""

    @property
    def heartbeat_timeout_s(self) -> float: ...

    @property
    def request_timeout_s(self) -> float: ...


class TimeoutOptions(Protocol):
    """The client's options its parts read."""

    @property
    def transport(self) -> HeartbeatOptions: ...

    @property
    def recovery_timeout_s(self) -> float | None: ...

    @property
    def table_chunk_rows(self) -> int: ...


class ClientView(Protocol):
    """The attributes and requests of a :class:`~psdk.client.client.ParameterClient` its parts use."""

    cluster: ClusterSpec
    task_index: int
    addresses: list[str]
    names: list[str]
    endpoint: ClientEndpoint
    heartbeat: Heartbeat | None
    shards: list[Shard]
    job: JobSpec | None
    epoch: int
    boots: list[str | None]
    rule_json: dict[str, Any]
    fallback: Checkpoint | None
    recoveries: list[dict[str, Any]]
    recovery_source: Callable[[], Checkpoint | None] | None
    reports: dict[int, dict[str, Any]]
    report: dict[str, Any]
    tables: dict[str, TableSpec]

    @property
    def options(self) -> TimeoutOptions: ...

    def message(self, op: str, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message: ...

    def request(
        self, messages: Mapping[int, Message], what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]: ...

    def collect(
        self, pending: Pending, what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]: ...

    def heard_from(self, index: int, boot: str | None) -> None: ...

    def set_boot(self, index: int, boot: str | None) -> None: ...

    def renew(self) -> None: ...

    def pull(self) -> int: ...

    @property
    def initialized(self) -> bool: ...

    @property
    def global_step(self) -> int: ...

    def recover(self, why: str) -> StepResult: ...

    def finish(self, report: Mapping[str, Any], stays: bool = False) -> None: ...

    def statuses(self, reports: bool = False) -> dict[int, dict[str, Any]]: ...

    def wrapping_up(self, attempt: Callable[[], T], what: str) -> T: ...
