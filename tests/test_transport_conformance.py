"""One transport contract, held against ZeroMQ: plain, and with CURVE keys.

The suite itself is :mod:`psdk.testing.transport_conformance`; here it runs
against each transport psdk ships. CURVE runs it with a key per ps task and
per worker, as a secure job does, so a transport option that changes the
handshake is held to the same contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from psdk import security
from psdk.testing.transport_conformance import Role, TransportConformance, TransportFactory
from psdk.transport import ClientEndpoint, Transport
from psdk.zmq_transport import ZmqClient, ZmqOptions, ZmqTransport

NUM_PS, NUM_WORKERS = 3, 4
"""Enough keys for the suite: it serves at most three ps tasks and connects as at most four workers."""


class TestZmqTransport(TransportConformance):
    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        return lambda role, index, servers=(): ZmqTransport()

    def send_raw(self, client: ClientEndpoint, index: int, frames: list[bytes]) -> None:
        assert isinstance(client, ZmqClient)
        client.socks[index].send_multipart(frames)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return security.generate(tmp_path_factory.mktemp("keys") / "keys", NUM_WORKERS, NUM_PS)


class TestZmqCurveTransport(TestZmqTransport):
    @pytest.fixture
    def transport_factory(self, curve_keys: Path) -> TransportFactory:
        def make(role: Role, index: int, servers: Sequence[int] = ()) -> Transport:
            if role == "ps":
                return ZmqTransport(ZmqOptions(curve=security.load_server(curve_keys, index)))
            keys = security.load_worker(curve_keys, index, NUM_PS)
            return ZmqTransport(
                ZmqOptions(
                    curve=security.CurveKeys(keys.public, keys.secret, servers=tuple(keys.servers[j] for j in servers))
                )
            )

        return make
