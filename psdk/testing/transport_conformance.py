"""The transport conformance suite: the contract of :mod:`psdk.transport` as the ps and the client rely on it.

A transport's tests subclass :class:`TransportConformance` and override the
``transport_factory`` fixture::

    # tests/test_my_transport.py
    import pytest
    from psdk.testing.transport_conformance import TransportConformance
    from mytransport import MyTransport

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def transport_factory(self):
            return lambda role, index, servers=(): MyTransport()

The factory is called once per endpoint the suite makes, as
``factory(role, index, servers)``: ``role`` is ``"ps"`` (the transport that
ps task ``index`` serves from) or ``"worker"`` (the one worker ``index``
connects from, to the ps tasks ``servers``, in the order of its address
list: a transport with a key per ps needs them). It may return a new
transport each time or the same one; the suite closes each it got at the end.
Servers bind :attr:`TransportConformance.bind`.

What the suite holds a transport to (each test's docstring says why the ps
or the client needs it):

- ``serve`` on port 0 binds a free port and reports it; a bound address
  cannot be bound twice (:class:`~psdk.errors.PortInUseError`);
- a client may send before its server binds: the message is delivered once it does;
- replies are tagged with the index of the server that sent them, and a
  client's requests to several servers are in flight together;
- a reply that comes after its request gave up is never read as the answer
  to a later one, and a wait that gave up can be resumed without losing one;
- ``request_many`` gives up at its deadline with
  :class:`~psdk.errors.PeerTimeoutError` naming the server(s) still silent;
- fields and arrays arrive intact (every dtype of :data:`psdk.transport.wire.ALLOWED_DTYPES`,
  0-d, empty, non-contiguous, several per message) and stay so while later
  messages arrive; a ``volatile`` message's arrays may change once the send
  call returns;
- the peer id a server sees is the ``identity`` a client connected with (its
  heartbeat connection's, ``identity + HEARTBEAT_SUFFIX``, too), stable per
  client, and replies to it reach that client only;
- ``reply`` to a peer that closed returns ``False`` (never raises or hangs);
- the wire rules of :mod:`psdk.transport.wire` hold on every transport, in-process ones
  too, so the ps sees the same checks whatever carries its messages: a header
  over the limit is refused at the sender with
  :class:`~psdk.errors.ProtocolError` and nothing is sent; a malformed request
  reaches the server as an :class:`~psdk.transport.Incoming` with ``error``
  (and the ``rid`` if its header had one); a request over the size given to
  ``limit_incoming`` is never handed over as a message;
- ``receive(timeout)`` returns ``None`` / ``[]`` after about ``timeout``
  when nothing came; ``close`` is idempotent and frees the address.

- a client's ``buffers`` carry a step both ways, lent to the server or not,
  and an ``in_place`` reply's array may change once ``reply`` returns.

Not covered: how a transport lends memory (ZeroMQ's has its own tests,
``tests/test_shm.py``), and authentication (``Incoming.user``). Malformed requests are sent through
:meth:`TransportConformance.send_raw`, which a subclass overrides; those
tests skip otherwise. Every wait is bounded, and each test has a pytest-timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pytest

from psdk.errors import PeerTimeoutError, PortInUseError, ProtocolError
from psdk.testing import transport_net
from psdk.testing.transport_net import (
    FIELDS,
    Net,
    TransportFactory,
    answer,
    assert_same_arrays,
    receive,
    replies,
    request,
    sample_arrays,
)
from psdk.transport import ClientEndpoint
from psdk.transport.wire import HEARTBEAT_SUFFIX, MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES, Message


@pytest.mark.timeout(60)
class TransportConformance:
    bind: ClassVar[str] = "127.0.0.1:0"
    """What servers bind: a free port of the transport's choosing."""

    # -------------------------------------------------------------- fixtures
    @pytest.fixture
    def transport_factory(self) -> TransportFactory:
        pytest.fail(f"{type(self).__name__} must override the transport_factory fixture")

    @pytest.fixture
    def net(self, transport_factory: TransportFactory) -> Iterator[Net]:
        net = Net(transport_factory, self.bind)
        try:
            yield net
        finally:
            net.close()

    def send_raw(self, client: ClientEndpoint, index: int, frames: list[bytes]) -> None:
        """Send ``frames`` as one message to server ``index``, bypassing :func:`psdk.transport.wire.encode`."""
        pytest.skip(f"{type(self).__name__} does not override send_raw: malformed requests are not tested")

    # ------------------------------------------------------------- addresses
    def test_serving_port_zero_binds_a_free_port_and_reports_it(self, net: Net) -> None:
        """A ps binds port 0 and announces ``address``: it must be a real, distinct, reachable address."""
        first, second = net.serve(0), net.serve(1)
        assert first.address != second.address
        for server in (first, second):
            assert not server.address.endswith((":0", ":*")), server.address
        client = net.connect([first, second])
        client.start_many({0: Message("q", {"to": 0}), 1: Message("q", {"to": 1})})
        assert request(first)[1].fields["to"] == 0
        assert request(second)[1].fields["to"] == 1

    def test_a_bound_address_cannot_be_bound_again(self, net: Net) -> None:
        """A second ps on the same address must fail loudly, not share or steal the first one's requests."""
        server = net.serve(0)
        with pytest.raises(PortInUseError):
            net.serve(1, bind=server.address)

    def test_a_request_sent_before_the_server_binds_is_delivered_once_it_does(self, net: Net) -> None:
        """A worker may start before its ps: its first request waits for the ps instead of being lost."""
        address = net.stop(net.serve(0))
        client = net.connect([address], indices=[0])
        pending = client.start_many({0: Message("wait_init", {"early": True})})
        server = net.serve(0, bind=address)
        peer, message = request(server)
        assert message.fields == {"early": True}
        answer(server, peer, message)
        assert pending.wait(transport_net.WAIT_S, "the early request")[0].fields == {"early": True}

    # ----------------------------------------------------- matching replies
    def test_replies_are_tagged_with_the_index_of_the_server_that_sent_them(self, net: Net) -> None:
        """A step's replies come from every shard at once; each must be read as its own shard's."""
        servers = [net.serve(i) for i in range(3)]
        client = net.connect(servers)
        pending = client.start_many({i: Message("q", {"i": i}) for i in range(3)})
        received = [request(s) for s in servers]  # all three in flight before any reply
        for index in reversed(range(3)):  # answered in the opposite order
            peer, message = received[index]
            assert message.fields["i"] == index
            answer(servers[index], peer, message, by=index)
        got = pending.wait(transport_net.WAIT_S, "three replies")
        assert {i: m.fields["by"] for i, m in got.items()} == {0: 0, 1: 1, 2: 2}

    def test_a_late_reply_is_never_taken_for_the_answer_to_a_later_request(self, net: Net) -> None:
        """A push that timed out must not make its reply the next push's: the rid tells them apart."""
        server = net.serve(0)
        client = net.connect([server])
        first = client.start_many({0: Message("q", {"n": 1})})
        with pytest.raises(PeerTimeoutError):
            first.wait(0.2, "the first answer")
        peer, message = request(server)
        answer(server, peer, message)  # late: its request gave up
        second = client.start_many({0: Message("q", {"n": 2})})
        peer, message = request(server)
        answer(server, peer, message)
        assert second.wait(transport_net.WAIT_S, "the second answer")[0].fields["n"] == 2

    def test_a_wait_that_gave_up_can_be_resumed_without_losing_a_reply(self, net: Net) -> None:
        """The client waits for a step in slices (checking heartbeats between them); no slice may eat a reply."""
        servers = [net.serve(0), net.serve(1)]
        client = net.connect(servers)
        pending = client.start_many({0: Message("q", {"i": 0}), 1: Message("q", {"i": 1})})
        peer, message = request(servers[0])
        answer(servers[0], peer, message)
        with pytest.raises(PeerTimeoutError):
            pending.wait(0.3, "both answers")
        peer, message = request(servers[1])
        answer(servers[1], peer, message)
        assert {i: m.fields["i"] for i, m in pending.wait(transport_net.WAIT_S, "both answers").items()} == {0: 0, 1: 1}

    def test_request_many_names_the_silent_server_at_its_deadline(self, net: Net) -> None:
        """A worker's error must say which ps did not answer, and come at the deadline, not later."""
        servers = [net.serve(0), net.serve(1)]
        client = net.connect(servers)
        pending = client.start_many({0: Message("q"), 1: Message("q")})
        peer, message = request(servers[0])
        answer(servers[0], peer, message)
        request(servers[1])  # received, never answered
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError) as info:
            pending.wait(0.5, "a push")
        elapsed = time.monotonic() - start
        assert "ps 1" in str(info.value) and "ps 0" not in str(info.value) and "a push" in str(info.value)
        assert 0.4 <= elapsed < 3.0, elapsed

    def test_a_request_to_a_server_that_closed_times_out_naming_it(self, net: Net) -> None:
        """A ps that is gone must cost a worker its deadline and a clear error, not a hang."""
        server = net.serve(0)
        client = net.connect([server])
        server.close()
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="ps 0"):
            client.request(0, Message("q"), 0.5, "an answer from a closed server")
        assert time.monotonic() - start < 3.0

    # ------------------------------------------------------ what arrives
    def test_fields_and_arrays_arrive_intact_both_ways(self, net: Net) -> None:
        """Gradients and parameters of every wire dtype and shape must cross unchanged, as must JSON fields."""
        server = net.serve(0)
        client = net.connect([server])
        sent = sample_arrays()
        kept = [a.copy() for a in sent]
        pending = client.start_many({0: Message("push", FIELDS, sent)})
        peer, message = request(server)
        assert message.op == "push" and message.fields == FIELDS
        assert_same_arrays(message.arrays, kept)
        answer(server, peer, message)
        reply = pending.wait(transport_net.WAIT_S, "the echo")[0]
        assert reply.op == "answer" and reply.fields == FIELDS
        assert_same_arrays(reply.arrays, kept)

    def test_received_arrays_stay_intact_while_later_messages_arrive(self, net: Net) -> None:
        """The ps holds a parked gradient while it receives others; a transport may not reuse its buffer."""
        server = net.serve(0)
        client = net.connect([server])
        ones, twos = np.ones(1000, np.float32), np.full(1000, 2.0, np.float32)
        client.start_many({0: Message("push", {}, [ones])})
        peer, first = request(server)
        client.start_many({0: Message("push", {}, [twos])})
        _, second = request(server)
        np.testing.assert_array_equal(first.arrays[0], 1.0)
        np.testing.assert_array_equal(second.arrays[0], 2.0)
        for value in (3.0, 4.0):
            server.reply(peer, Message("params", {}, [np.full(1000, value, np.float32)], rid=first.rid))
        (_, third), (_, fourth) = replies(client, 2)
        np.testing.assert_array_equal(third.arrays[0], 3.0)
        np.testing.assert_array_equal(fourth.arrays[0], 4.0)

    def test_a_volatile_messages_arrays_may_change_once_send_returns(self, net: Net) -> None:
        """A worker marks a message ``volatile`` when it reuses the buffer at once: the transport must copy it."""
        server = net.serve(0)
        client = net.connect([server])
        buffer = np.arange(100_000, dtype=np.float32)
        message = Message("push", {}, [buffer], rid=client.new_rid(), volatile=True)
        client.send(0, message)
        buffer[:] = -1.0
        peer, got = request(server)
        np.testing.assert_array_equal(got.arrays[0], np.arange(100_000, dtype=np.float32))
        buffer[:] = np.arange(100_000, dtype=np.float32)
        assert server.reply(peer, Message("params", {}, [buffer], rid=got.rid, volatile=True))
        buffer[:] = -2.0
        ((_, reply),) = replies(client, 1)
        np.testing.assert_array_equal(reply.arrays[0], np.arange(100_000, dtype=np.float32))

    def test_a_clients_buffers_carry_a_step_both_ways_and_may_be_reused(self, net: Net) -> None:
        """A worker computes into ``buffers().grads``, pushes it (or ``outbox``), and takes ``params`` back.

        Whether the transport lends those buffers to the ps (shared memory)
        or sends them in frames, the ps must get the gradient as it was
        sent, an ``in_place`` reply's array may change once ``reply``
        returns, and every step of a long run goes the same way.
        """
        server = net.serve(0)
        client = net.connect([server])
        size = 50_000
        buffers = client.buffers(0, size)
        for array in (buffers.grads, buffers.outbox, buffers.params):
            assert array.dtype == np.float32 and array.shape == (size,) and array.flags.writeable
        assert len({id(buffers.grads), id(buffers.outbox), id(buffers.params)}) == 3
        fresh = np.zeros(size, np.float32)
        for step in range(1, 6):
            buffers.grads[:] = step
            sent = buffers.grads
            if step % 2 == 0:  # as a worker that computes its next gradient while this one travels
                np.copyto(buffers.outbox, buffers.grads)
                sent = buffers.outbox
            pending = client.start_many({0: Message("push", {"step": step}, [sent], stable=True)})
            peer, message = request(server)
            assert message.fields == {"step": step}
            np.testing.assert_array_equal(message.arrays[0], float(step))
            fresh[:] = -step
            assert server.reply(peer, Message("params", {"step": step}, [fresh], message.rid, in_place=True))
            fresh[:] = 999.0  # the transport is done with it
            reply = pending.wait(transport_net.WAIT_S, "the parameters")[0]
            assert reply.fields == {"step": step}
            np.testing.assert_array_equal(reply.arrays[0], float(-step))
        assert isinstance(client.sharing(0), str)

    def test_a_push_with_table_arrays_and_a_reply_with_rows_carry_every_array(self, net: Net) -> None:
        """A push's ids and rows after its gradient, and the rows its reply pulled, arrive as sent, step after step.

        The client said how much room they take (``buffers``'s extras), so a
        transport may lend that too; the next step's arrays never change the
        ids of a message already handed over, nor its rows unless they were
        borrowed (valid until the reply, as a lent gradient is).
        """
        server = net.serve(0)
        client = net.connect([server])
        size, ids = 1000, np.arange(0, 400, 4, dtype=np.int64)
        buffers = client.buffers(0, size, extra_bytes=ids.size * (8 + 64 + 8), extra_arrays=3)
        earlier: list[tuple[np.ndarray, np.ndarray]] = []  # the last step's table arrays, and copies of them
        for step in range(1, 8):
            buffers.grads[:] = step
            rows = np.full((ids.size, 16), step, np.float32)
            push = Message("push_pull", {"step": step}, [buffers.grads, ids + step, rows, ids], stable=True)
            pending = client.start_many({0: push})
            peer, message = request(server)
            for taken, copy in earlier:  # this step's push changed nothing the server took before
                np.testing.assert_array_equal(taken, copy)
            earlier = [(a, a.copy()) for a in message.arrays[1:] if a.dtype == np.int64 or not message.borrowed]
            assert [a.dtype for a in message.arrays] == [np.float32, np.int64, np.float32, np.int64]
            np.testing.assert_array_equal(message.arrays[0], float(step))
            np.testing.assert_array_equal(message.arrays[1], ids + step)
            np.testing.assert_array_equal(message.arrays[2], rows)
            pulled = rows[: ids.size // 2] * -1
            reply = Message("params", {"step": step}, [np.full(size, -step, np.float32), pulled], message.rid)
            reply.in_place = True
            assert server.reply(peer, reply)
            answer = pending.wait(transport_net.WAIT_S, "the parameters")[0]
            assert answer.fields == {"step": step} and len(answer.arrays) == 2
            np.testing.assert_array_equal(answer.arrays[0], float(-step))
            np.testing.assert_array_equal(answer.arrays[1], pulled)

    # -------------------------------------------------------------- peers
    def test_the_server_sees_each_clients_identity_as_a_stable_peer_id(self, net: Net) -> None:
        """The ps binds a worker to its identity, and its heartbeats to identity + /hb; replies go back to each."""
        server = net.serve(0)
        clients = {
            "main": net.connect([server], b"w-a", worker=0),
            "heartbeat": net.connect([server], b"w-a" + HEARTBEAT_SUFFIX, worker=0),
            "other": net.connect([server], b"w-b", worker=1),
            "anonymous 1": net.connect([server], worker=2),
            "anonymous 2": net.connect([server], worker=3),
        }
        for n in range(2):
            for who, client in clients.items():
                client.start_many({0: Message("q", {"who": who, "n": n})})
        peers: dict[str, set[bytes]] = {who: set() for who in clients}
        for _ in range(2 * len(clients)):
            peer, message = request(server)
            peers[message.fields["who"]].add(peer)
            answer(server, peer, message)
        assert all(len(ids) == 1 for ids in peers.values()), peers
        ids = {who: next(iter(p)) for who, p in peers.items()}
        assert ids["main"] == b"w-a" and ids["other"] == b"w-b"
        assert ids["heartbeat"] == b"w-a" + HEARTBEAT_SUFFIX
        assert ids["heartbeat"].removesuffix(HEARTBEAT_SUFFIX) == ids["main"]
        assert len(set(ids.values())) == len(ids), ids
        for who, client in clients.items():
            got = replies(client, 2)
            assert sorted((i, m.fields["who"], m.fields["n"]) for i, m in got) == [(0, who, 0), (0, who, 1)]

    def test_a_reply_to_a_peer_that_closed_returns_false(self, net: Net) -> None:
        """A ps answers workers that may have died meanwhile: that must be a ``False``, not an error or a hang."""
        server = net.serve(0)
        client = net.connect([server], b"w-gone")
        client.start_many({0: Message("q")})
        peer, message = request(server)
        client.close()
        deadline = time.monotonic() + transport_net.WAIT_S  # a socket may learn of the close only after a reply or two
        while True:
            start = time.monotonic()
            sent = server.reply(peer, Message("answer", rid=message.rid))
            assert time.monotonic() - start < 2.0, "reply blocked on a closed peer"
            if not sent:
                break
            assert time.monotonic() < deadline, "reply to a closed peer kept returning True"
            assert server.receive(0.02) is None
        assert server.reply(b"never-connected", Message("answer", rid=1)) is False

    # ---------------------------------------------------------- wire rules
    def test_a_reply_header_over_the_limit_raises_and_sends_nothing(self, net: Net) -> None:
        """The ps answers an oversized reply with an error instead; the worker must not get half of it."""
        server = net.serve(0)
        client = net.connect([server])
        pending = client.start_many({0: Message("q")})
        peer, message = request(server)
        huge = Message("answer", {"x": "a" * (MAX_REPLY_HEADER_BYTES + 1)}, rid=message.rid)
        with pytest.raises(ProtocolError):
            server.reply(peer, huge)
        assert client.receive(0.3) == []
        assert server.reply(peer, Message("error", {"error": "too big"}, rid=message.rid))
        assert pending.wait(transport_net.WAIT_S, "the error")[0].op == "error"

    def test_a_request_header_over_the_limit_raises_and_sends_nothing(self, net: Net) -> None:
        """What a ps reads from anyone is bounded; a client must refuse to send more, not let the ps choke."""
        server = net.serve(0)
        client = net.connect([server])
        with pytest.raises(ProtocolError):
            client.send(0, Message("q", {"x": "a" * MAX_HEADER_BYTES}, rid=client.new_rid()))
        client.start_many({0: Message("q", {"after": True})})
        assert request(server)[1].fields == {"after": True}  # the first one never came

    @pytest.mark.parametrize(
        ("frames", "rid"),
        [
            ([b'{"op":"push","rid":7,"f":{},"a":[["<f4",[2]]]}', b"\0" * 3], 7),  # frame shorter than declared
            ([b'{"op":"push","rid":8,"f":{},"a":[["|O",[1]]]}', b"\0" * 8], 8),  # a dtype off the list
            ([b'{"op":"push","rid":9,"f":{},"a":[]}', b"extra"], 9),  # a frame nobody declared
            ([b"\xff not json"], None),
        ],
        ids=["short-frame", "object-dtype", "undeclared-frame", "not-json"],
    )
    def test_a_malformed_request_reaches_the_server_as_an_error_with_its_rid(
        self, net: Net, frames: list[bytes], rid: int | None
    ) -> None:
        """The ps answers a malformed request with an error to its rid, and goes on serving."""
        server = net.serve(0)
        client = net.connect([server])
        self.send_raw(client, 0, frames)
        incoming = receive(server)
        assert incoming.message is None and isinstance(incoming.error, ProtocolError)
        assert incoming.rid == rid
        client.start_many({0: Message("q", {"after": True})})
        assert request(server)[1].fields == {"after": True}

    def test_a_request_over_the_incoming_limit_is_never_handed_over(self, net: Net) -> None:
        """Once a ps knows its job's sizes, a bigger request must not reach a handler (its memory is bounded)."""
        server = net.serve(0)
        server.limit_incoming(4096, 1 << 20)
        big = net.connect([server], b"w-big")
        big.start_many({0: Message("push", {}, [np.zeros(10_000, np.float32)])})
        small = net.connect([server], b"w-small", worker=1)
        small.start_many({0: Message("q", {"small": True})})
        for _ in range(2):  # the big one as an error (or dropped with its connection), then the small one
            incoming = receive(server)
            if incoming.message is not None:
                break
            assert isinstance(incoming.error, ProtocolError) and incoming.peer == b"w-big"
        assert incoming.message is not None and incoming.message.fields == {"small": True}

    # --------------------------------------------------------- idle, close
    @pytest.mark.parametrize("timeout_s", [0.0, 0.3])
    def test_receive_returns_nothing_after_about_its_timeout_when_idle(self, net: Net, timeout_s: float) -> None:
        """The ps's loop and the client's wait slices check deadlines between receives: these must return."""
        server = net.serve(0)
        client = net.connect([server])
        for idle in (lambda: server.receive(timeout_s), lambda: client.receive(timeout_s)):
            start = time.monotonic()
            assert not idle()
            elapsed = time.monotonic() - start
            assert timeout_s * 0.8 <= elapsed < timeout_s + 1.0, elapsed

    def test_close_is_idempotent_and_frees_the_address(self, net: Net) -> None:
        """A ps closes its endpoint on every way out (twice, on some); a restarted ps binds the same address.

        An endpoint's close may finish in the background (ZeroMQ's I/O thread
        releases the port); once its transport is closed too, the address is free.
        """
        server = net.serve(0)
        client = net.connect([server])
        client.start_many({0: Message("q")})
        request(server)  # a connection that carried traffic, not only a listener
        for close in (server.close, server.close, client.close, client.close):
            close()
        address = net.stop(server)
        for transport in net.transports:
            transport.close()
        again = net.serve(0, bind=address)
        assert again.address == address
        later = net.connect([again])
        later.start_many({0: Message("q", {"again": True})})
        assert request(again)[1].fields == {"again": True}
