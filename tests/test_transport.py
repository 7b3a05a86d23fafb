"""The ZeroMQ transport over real sockets: round trips, big arrays, late replies, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import numpy as np
import pytest
import zmq

from psdk.errors import PeerDeadError, PeerTimeoutError, PortInUseError
from psdk.transport import ServerEndpoint
from psdk.transport.wire import Message
from psdk.transport.zeromq import ZmqTransport


@contextmanager
def serving(
    transport: ZmqTransport, bind: str, handler: Callable[[ServerEndpoint, bytes, Message], None]
) -> Iterator[str]:
    endpoint = transport.serve(bind, "test server")
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            incoming = endpoint.receive(0.02)
            if incoming is not None and incoming.message is not None:
                handler(endpoint, incoming.peer, incoming.message)
        endpoint.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield endpoint.address
    finally:
        stop.set()
        thread.join(timeout=5)


def echo(endpoint: ServerEndpoint, peer: bytes, message: Message) -> None:
    arrays = [a * 2 for a in message.arrays]
    endpoint.reply(peer, Message("echo", message.fields, arrays, message.rid))


@pytest.fixture
def transport() -> Iterator[ZmqTransport]:
    t = ZmqTransport()
    yield t
    t.close()


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "inproc://echo"])
def test_round_trip_over_tcp_and_inproc(transport: ZmqTransport, bind: str) -> None:
    with serving(transport, bind, echo) as address:
        client = transport.connect([address], ["echo"])
        try:
            reply = client.request(0, Message("x", {"k": 1}, [np.arange(5, dtype=np.float32)]), 5.0, "echo")
        finally:
            client.close()
    assert reply.fields == {"k": 1}
    np.testing.assert_array_equal(reply.arrays[0], np.arange(5, dtype=np.float32) * 2)


def test_random_port_binding_reports_the_real_port(transport: ZmqTransport) -> None:
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    try:
        assert endpoint.address.startswith("tcp://127.0.0.1:")
        assert int(endpoint.address.rsplit(":", 1)[1]) > 0
    finally:
        endpoint.close()


def test_large_array_round_trip(transport: ZmqTransport) -> None:
    big = np.random.default_rng(0).random(8_000_000, dtype=np.float32)  # 32 MB
    with serving(transport, "127.0.0.1:0", echo) as address:
        client = transport.connect([address], ["echo"])
        try:
            reply = client.request(0, Message("x", {}, [big]), 30.0, "echo")
        finally:
            client.close()
    np.testing.assert_array_equal(reply.arrays[0], big * 2)


def test_requests_to_several_servers_are_in_flight_together(transport: ZmqTransport) -> None:
    # Each server answers only once both hold their request: requests sent one after the other would
    # break the barrier and get no answer at all (no timing involved).
    both = threading.Barrier(2, timeout=3)

    def echo_when_both_arrived(endpoint: ServerEndpoint, peer: bytes, message: Message) -> None:
        with suppress(threading.BrokenBarrierError):
            both.wait()
            echo(endpoint, peer, message)

    with (
        serving(transport, "127.0.0.1:0", echo_when_both_arrived) as a,
        serving(transport, "127.0.0.1:0", echo_when_both_arrived) as b,
    ):
        client = transport.connect([a, b], ["a", "b"])
        try:
            replies = client.request_many({0: Message("x", {"i": 0}), 1: Message("x", {"i": 1})}, 10.0, "echo")
        finally:
            client.close()
    assert {i: r.fields["i"] for i, r in replies.items()} == {0: 0, 1: 1}


def test_a_late_reply_is_never_taken_for_the_next_one(transport: ZmqTransport) -> None:
    release = threading.Event()

    def first_slow(endpoint: ServerEndpoint, peer: bytes, message: Message) -> None:
        if message.fields["n"] == 1:
            release.wait(5)  # answers the first request only after it timed out
        endpoint.reply(peer, Message("answer", {"n": message.fields["n"]}, [], message.rid))

    with serving(transport, "127.0.0.1:0", first_slow) as address:
        client = transport.connect([address], ["slow server"])
        try:
            with pytest.raises(PeerTimeoutError) as info:
                client.request(0, Message("q", {"n": 1}), 0.2, "the first answer")
            assert "slow server" in str(info.value) and "the first answer" in str(info.value)
            release.set()
            reply = client.request(0, Message("q", {"n": 2}), 5.0, "the second answer")
        finally:
            client.close()
    assert reply.fields["n"] == 2


def test_a_silent_peer_is_declared_dead_by_name(transport: ZmqTransport) -> None:
    with serving(transport, "127.0.0.1:0", lambda *_: None) as address:
        client = transport.connect([address], ["ps 3 (here)"])
        try:
            with pytest.raises(PeerDeadError) as info:
                client.request_many({0: Message("q")}, 10.0, "a push", silence_s=lambda i: 99.0, dead_after_s=1.0)
        finally:
            client.close()
    assert "ps 3 (here)" in str(info.value) and "a push" in str(info.value)


def test_binding_a_busy_port_says_so(transport: ZmqTransport) -> None:
    first = transport.serve("127.0.0.1:0", "ps 0")
    try:
        port = first.address.rsplit(":", 1)[1]
        with pytest.raises(PortInUseError) as info:
            transport.serve(f"127.0.0.1:{port}", "ps 1")
        assert port in str(info.value) and "ps 1" in str(info.value)
    finally:
        first.close()


def test_reply_to_a_vanished_peer_is_an_error_not_silence(transport: ZmqTransport) -> None:
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    try:
        assert endpoint.reply(b"\x00nobody", Message("x")) is False
    finally:
        endpoint.close()


def test_sockets_close_with_linger_zero(transport: ZmqTransport) -> None:
    client = transport.connect(["127.0.0.1:1"], ["nobody"])  # nothing listens there
    client.send(0, Message("q", {}, [np.zeros(1000, np.float32)]))
    assert client.socks[0].getsockopt(zmq.LINGER) == 0
    started = time.monotonic()
    client.close()
    transport.close()
    assert time.monotonic() - started < 1.0
