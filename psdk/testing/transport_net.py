"""What the transport conformance suite works with: the endpoints of one test, and bounded waits on them.

Kept apart from :mod:`psdk.testing.transport_conformance`, which holds the
contract's tests; a transport's own tests may use these too. Every wait is
bounded by :data:`WAIT_S`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from psdk.transport import ClientEndpoint, Incoming, ServerEndpoint, Transport
from psdk.transport.wire import ALLOWED_DTYPES, Message

Role = Literal["ps", "worker"]
WAIT_S = 10.0
"""The longest any single expected event may take (connection set-up included): a bound, never a pace.
Read at each use, so a test of the suite itself may shorten it."""


class TransportFactory(Protocol):
    def __call__(self, role: Role, index: int, servers: Sequence[int] = ()) -> Transport: ...


class Net:
    """The endpoints one test made, all closed at its end, whatever happened."""

    def __init__(self, factory: TransportFactory, bind: str):
        self.factory, self.bind = factory, bind
        self.transports: list[Transport] = []
        self.servers: list[ServerEndpoint] = []
        self.clients: list[ClientEndpoint] = []
        self._task_of: dict[int, int] = {}  # id(server) -> its ps task index
        self._transport_of: dict[int, Transport] = {}

    def transport(self, role: Role, index: int, servers: Sequence[int] = ()) -> Transport:
        transport = self.factory(role, index, servers)
        self.transports.append(transport)
        return transport

    def serve(self, index: int = 0, bind: str | None = None) -> ServerEndpoint:
        transport = self.transport("ps", index)
        server = transport.serve(self.bind if bind is None else bind, f"ps {index}")
        self.servers.append(server)
        self._task_of[id(server)] = index
        self._transport_of[id(server)] = transport
        return server

    def stop(self, server: ServerEndpoint) -> str:
        """Close ``server`` and the transport it came from, as a ps process ends; the address it had."""
        server.close()
        self._transport_of[id(server)].close()
        return server.address

    def connect(
        self,
        servers: Sequence[ServerEndpoint | str],
        identity: bytes | None = None,
        worker: int = 0,
        indices: Sequence[int] | None = None,
    ) -> ClientEndpoint:
        """A client of ``servers`` (endpoints, or addresses of ps tasks ``indices``), named ``ps <index>``."""
        if indices is None:
            indices = [self._task_of[id(s)] if isinstance(s, ServerEndpoint) else 0 for s in servers]
        addresses = [s.address if isinstance(s, ServerEndpoint) else s for s in servers]
        client = self.transport("worker", worker, indices).connect(addresses, [f"ps {i}" for i in indices], identity)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.close()
        for transport in self.transports:
            transport.close()


def receive(server: ServerEndpoint, timeout_s: float | None = None) -> Incoming:
    """The next request, which must come within ``timeout_s`` (default :data:`WAIT_S`)."""
    timeout_s = WAIT_S if timeout_s is None else timeout_s
    incoming = server.receive(timeout_s)
    assert incoming is not None, f"no request reached the server within {timeout_s} s"
    return incoming


def request(server: ServerEndpoint, timeout_s: float | None = None) -> tuple[bytes, Message]:
    """The next request's peer and message, which must come intact."""
    incoming = receive(server, timeout_s)
    assert incoming.message is not None, f"a well-formed request was refused: {incoming.error}"
    return incoming.peer, incoming.message


def replies(client: ClientEndpoint, count: int, timeout_s: float | None = None) -> list[tuple[int, Message]]:
    """Exactly ``count`` replies, which must all come within ``timeout_s`` (default :data:`WAIT_S`)."""
    timeout_s = WAIT_S if timeout_s is None else timeout_s
    got: list[tuple[int, Message]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and (left := deadline - time.monotonic()) > 0:
        got.extend(client.receive(min(left, 0.1)))
    assert len(got) == count, f"{len(got)} of {count} replies came within {timeout_s} s"
    return got


def answer(server: ServerEndpoint, peer: bytes, message: Message, **fields: Any) -> None:
    """Reply to ``message`` with its rid, its fields plus ``fields``, and its arrays."""
    assert server.reply(peer, Message("answer", {**message.fields, **fields}, list(message.arrays), message.rid))


def sample_arrays() -> list[np.ndarray]:
    """One array of every wire dtype, and the shapes that break naive framing: 0-d, empty, strided."""
    rng = np.random.default_rng(0)
    arrays = [(rng.normal(size=(3, 4)) * 100).astype(np.dtype(code)) for code in sorted(ALLOWED_DTYPES)]
    return [
        *arrays,
        np.array(2.5, np.float64),
        np.zeros(0, np.float32),
        np.zeros((2, 0, 3), np.int64),
        np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),  # not C-contiguous
        np.arange(10, dtype=np.int32)[::3],
    ]


FIELDS = {"text": "ünïcödé ✓", "n": -(1 << 62), "x": 0.1, "ok": True, "none": None, "nested": {"a": [1, [2, {}]]}}


def assert_same_arrays(got: Sequence[np.ndarray], sent: Sequence[np.ndarray]) -> None:
    assert len(got) == len(sent)
    for i, (a, b) in enumerate(zip(got, sent, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"array {i}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=f"array {i}")
