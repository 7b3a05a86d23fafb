"""One transport contract, three transports: ZeroMQ, ZeroMQ with CURVE keys, and in-process.

The suite itself is :mod:`psdk.testing.transport_conformance`; here it runs
against each transport psdk ships. CURVE runs it with a key per ps task and
per worker, as a secure job does, so a transport option that changes the
handshake is held to the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from psdk.errors import PeerTimeoutError
from psdk.testing import transport_net
from psdk.testing.transport_conformance import TransportConformance
from psdk.testing.transport_net import Net, Role, TransportFactory
from psdk.transport import ClientEndpoint, Transport, security
from psdk.transport.inproc import InprocClient, InprocHub, InprocServer, InprocTransport, frames_of
from psdk.transport.wire import MAX_REPLY_HEADER_BYTES, Message, encode
from psdk.transport.zeromq import ZmqClient, ZmqOptions, ZmqTransport

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


class TestInprocTransport(TransportConformance):
    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        return lambda role, index, servers=(): InprocTransport()

    def send_raw(self, client: ClientEndpoint, index: int, frames: list[bytes]) -> None:
        assert isinstance(client, InprocClient)
        client.send_frames(index, frames)


class TestInprocTransportOnItsOwnHub(TestInprocTransport):
    """Transports on a private hub see each other and nothing of the process's."""

    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        hub = InprocHub()
        return lambda role, index, servers=(): InprocTransport(hub)


# ------------------------------------------------- the suite catches broken transports
class Mistagging(InprocTransport):
    """Tags every reply as the first server's."""

    def serve(self, bind: str, name: str) -> InprocServer:
        server = super().serve(bind, name)

        def reply(peer: bytes, message: Message) -> bool:
            link = server._peers[peer]
            return link.client.inbox.put((0, frames_of(message, MAX_REPLY_HEADER_BYTES)))

        server.reply = reply  # type: ignore[method-assign]
        return server


class Sharing(InprocTransport):
    """Hands the receiver views of the sender's arrays, volatile or not."""

    def connect(self, addresses: Sequence[str], names: Sequence[str], identity: bytes | None = None) -> InprocClient:
        client = super().connect(addresses, names, identity)

        def send(index: int, message: Message, wait_s: float | None = None) -> None:
            head, *arrays = encode(message)
            client.hub.post(client._links[index], [head, *(memoryview(a) for a in arrays)], 1.0)  # type: ignore[list-item]

        client.send = send  # type: ignore[method-assign]
        return client


class Unlimited(InprocTransport):
    """Sends reply headers of any size."""

    def serve(self, bind: str, name: str) -> InprocServer:
        server = super().serve(bind, name)
        server.reply = lambda peer, message: server._peers[peer].client.inbox.put(  # type: ignore[method-assign]
            (server._peers[peer].index, frames_of(message, 1 << 40))
        )
        return server


SUITE = TestInprocTransport()


@contextmanager
def broken_net(kind: type[InprocTransport]) -> Iterator[Net]:
    hub = InprocHub()
    net = Net(lambda role, index, servers=(): kind(hub), SUITE.bind)
    try:
        yield net
    finally:
        net.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "test"),
    [
        (Mistagging, SUITE.test_replies_are_tagged_with_the_index_of_the_server_that_sent_them),
        (Sharing, SUITE.test_a_volatile_messages_arrays_may_change_once_send_returns),
        (Unlimited, SUITE.test_a_reply_header_over_the_limit_raises_and_sends_nothing),
    ],
    ids=["mistagged-replies", "shared-volatile-arrays", "unlimited-reply-header"],
)
def test_the_suite_catches_a_broken_transport(
    kind: type[InprocTransport], test: Callable[[Net], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport_net, "WAIT_S", 1.0)  # what never comes is a failure, and sooner
    with broken_net(kind) as net, pytest.raises((AssertionError, pytest.fail.Exception, PeerTimeoutError)):
        test(net)
