"""Same-host shared memory, the ZeroMQ transport's business: buffers lent, mapped, checked, and the fallback to frames.

The ps and the client never see it: the memory file's checks are tested on
:mod:`psdk.transport.shm`, the lending on real ZeroMQ endpoints (a worker's side by
hand, :class:`Lender`, where a test needs to misbehave), and the whole on a
real ps and client that train through it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq

from psdk.config.options import TransportOptions
from psdk.errors import ProtocolError, PsdkError
from psdk.transport import ServerEndpoint, shm
from psdk.transport.compact import JSON, Packer, Unpacker
from psdk.transport.lending import ATTACH, ATTACHED, REFUSED, UNLENT
from psdk.transport.wire import MAX_HEADER_BYTES, MAX_REPLY_HEADER_BYTES, Message, decode, encode
from psdk.transport.zeromq import ZmqOptions, ZmqServer, ZmqTransport

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc"),
]

SIZE = 1000


def header(op: str, rid: int, slot: str = "grads", **fields: Any) -> bytes:
    """A request's wire header whose one array lies in lent memory (as a worker's endpoint sends it as a message)."""
    head: bytes = encode(Message(op, fields, [], rid, lent=[slot]))[0]
    return head


def knock_header(op: str, rid: int, slot: str = "grads", **fields: Any) -> bytes:
    """The same request's header as a worker's endpoint writes it into its memory to knock (packed)."""
    return Packer(MAX_HEADER_BYTES).pack(Message(op, fields, [], rid), [slot])


def reply_of(head: bytes) -> Message:
    """A reply's header as the ps's endpoint wrote it into the worker's memory."""
    return Unpacker(MAX_REPLY_HEADER_BYTES).unpack(head)


# ------------------------------------------------------------------ the memory file
def test_the_ps_reads_the_gradient_and_writes_the_parameters_in_the_workers_memory() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    worker.grads[:] = 3.0
    worker.outbox[:] = 4.0
    assert ps.region("grads").sum() == 3.0 * SIZE
    assert ps.region("outbox").sum() == 4.0 * SIZE
    assert not ps.write_reply(np.arange(SIZE, dtype=np.float32), 7, None)  # no header: not rung
    into = np.zeros(SIZE, np.float32)
    worker.read_params(into, rid=7)
    np.testing.assert_array_equal(into, np.arange(SIZE, dtype=np.float32))
    ps.close()
    worker.close()


def test_parameters_written_for_another_request_are_never_used() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    ps.write_reply(np.ones(SIZE, np.float32), 7, None)
    into = np.zeros(SIZE, np.float32)
    with pytest.raises(PsdkError, match="belong to request 7, not 8"):
        worker.read_params(into, rid=8)
    ps._views.reply.seq[0] = 9  # a write for request 9 began while request 7's parameters were being read
    with pytest.raises(PsdkError, match="overwrote"):
        worker.read_params(into, rid=7)
    ps.close()
    worker.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"token": "00" * shm.TOKEN_BYTES}, "token"),
        ({"token": "not hex"}, "bad token"),
        ({"bytes": 64}, "which need"),
        ({"size": SIZE * 2}, "more than a message may hold"),
        ({"fd": 99999}, "cannot open"),
        ({"pid": -1}, "bad pid"),
        ({"fd": True}, "bad fd"),
        ({"size": "1000"}, "bad size"),
    ],
)
def test_a_bad_offer_is_refused_with_a_reason(change: dict[str, Any], message: str) -> None:
    worker = shm.WorkerBuffers(SIZE)
    with pytest.raises(ProtocolError, match=message):
        shm.AttachedBuffers({**worker.offer(), **change}, SIZE)
    worker.close()


def test_a_file_that_is_not_a_sealed_memory_file_is_refused() -> None:
    """A peer cannot point the ps at some other file of this host to have parameters written into it."""
    worker = shm.WorkerBuffers(SIZE)
    with tempfile.TemporaryFile() as plain:
        plain.write(worker.token + bytes(shm.total_bytes(SIZE) - shm.TOKEN_BYTES))
        plain.flush()
        with pytest.raises(ProtocolError, match="not a sealed memory file"):
            shm.AttachedBuffers({**worker.offer(), "fd": plain.fileno()}, SIZE)
        before = os.pread(plain.fileno(), 32, 0)
    assert before[: shm.TOKEN_BYTES] == worker.token
    worker.close()


def test_a_device_is_never_opened() -> None:
    worker = shm.WorkerBuffers(SIZE)
    with open(os.devnull, "rb") as device, pytest.raises(ProtocolError, match="not a memory file"):
        shm.AttachedBuffers({**worker.offer(), "fd": device.fileno()}, SIZE)
    worker.close()


def test_an_unknown_region_is_refused() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    for slot in ("params", 7, None):
        with pytest.raises(ProtocolError, match="unknown shared-memory slot"):
            ps.region(slot)
    ps.close()
    worker.close()


def test_a_reply_header_rings_once_and_a_torn_one_is_not_taken() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    assert worker.take_reply() is None  # nothing written yet
    assert ps.write_reply(np.ones(SIZE, np.float32), 5, b"header of 5")
    assert worker.take_reply() == (5, b"header of 5")
    with pytest.raises(BlockingIOError):  # take_reply drained the doorbell
        os.read(worker.bell, 1)
    assert not ps.write_reply(np.ones(SIZE, np.float32), 6, b"x" * 4096)  # too big for its area: sent as a message
    assert worker.take_reply() is None  # and request 5's header does not come back as request 6's
    ps.write_reply(np.ones(SIZE, np.float32), 7, b"header of 7")
    ps._views.reply.seq[0] = 8  # the ps began writing the reply to request 8
    assert worker.take_reply() is None
    ps.close()
    worker.close()


def test_a_doorbell_that_is_not_a_pipe_is_never_written() -> None:
    worker = shm.WorkerBuffers(SIZE)
    with tempfile.TemporaryFile() as plain:
        ps = shm.AttachedBuffers({**worker.offer(), "bell": plain.fileno()}, SIZE)
        assert ps.bell == -1 and ps.knock == -1
        assert not ps.write_reply(np.ones(SIZE, np.float32), 3, b"header")
        assert os.fstat(plain.fileno()).st_size == 0
        ps.close()
    worker.close()


def test_only_two_different_anonymous_pipes_are_taken_as_doorbell_and_knock(tmp_path: Any) -> None:
    worker = shm.WorkerBuffers(SIZE)
    offer = worker.offer()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    named = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a FIFO some other process might be reading
    try:
        for bell, knock in ((named, offer["knock"]), (offer["bell"], named), (offer["bell"], offer["bell"])):
            ps = shm.AttachedBuffers({**offer, "bell": bell, "knock": knock}, SIZE)
            assert ps.knock == -1 and (ps.bell == -1 or bell == offer["bell"])
            ps.close()
    finally:
        os.close(named)
    worker.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_open_a_workers_shared_memory() -> None:
    """The ps maps a worker's memory through /proc/<pid>/fd: a process of another user gets EACCES there."""
    import subprocess

    worker = shm.WorkerBuffers(SIZE)
    try:

        def as_nobody() -> None:
            os.setgid(65534)
            os.setuid(65534)

        for path in (f"/proc/{os.getpid()}/fd/{worker.fd}", f"/proc/{os.getpid()}/fd/{worker.bell}"):
            done = subprocess.run(
                ["/bin/cat", path], preexec_fn=as_nobody, capture_output=True, timeout=30, check=False
            )  # fmt: skip
            assert done.returncode != 0 and b"Permission denied" in done.stderr, done.stderr
    finally:
        worker.close()


# ------------------------------------------------------- the ps endpoint, lent to by hand
class Lender:
    """A worker's side of the ZeroMQ transport by hand: a DEALER socket and a memory file it lends."""

    def __init__(self, server: ServerEndpoint, identity: bytes = b"w", size: int = SIZE):
        self.server = server
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(server.address)
        self.memory = shm.WorkerBuffers(size)
        self.identity = identity

    def send(self, message: Message) -> None:
        self.sock.send_multipart(encode(message))

    def reply(self, timeout_s: float = 10.0) -> Message:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply came"
        return decode(self.sock.recv_multipart(), 1 << 24)

    def attach(self, rid: int = 1, **change: Any) -> Message:
        """Offer the memory; the endpoint answers itself: the ps never sees the offer."""
        self.send(Message(ATTACH, {**self.memory.offer(), **change}, [], rid))
        assert self.server.receive(0.3) is None
        return self.reply()

    def knock(self, rid: int, slot: str = "grads", **fields: Any) -> bool:
        return self.memory.knock(rid, knock_header("push_pull", rid, slot, **fields))

    def close(self) -> None:
        self.memory.close()
        self.sock.close(linger=0)
        self.context.term()


@contextmanager
def ps_endpoint(**options: Any) -> Iterator[ZmqServer]:
    transport = ZmqTransport(ZmqOptions(TransportOptions(**options)))
    server = transport.serve("127.0.0.1:0", "ps 0")
    try:
        yield server
    finally:
        server.close()
        transport.close()


@contextmanager
def lender(server: ServerEndpoint, identity: bytes = b"w", size: int = SIZE) -> Iterator[Lender]:
    worker = Lender(server, identity, size)
    try:
        yield worker
    finally:
        worker.close()


def test_a_knock_reaches_the_ps_as_the_message_it_stands_for_with_its_gradient_borrowed() -> None:
    with ps_endpoint() as server, lender(server) as worker:
        answer = worker.attach()
        assert answer.op == ATTACHED and answer.fields == {"bell": True, "knock": True}
        worker.memory.knocks_heard()
        worker.memory.grads[...] = 1.5
        assert worker.knock(3, worker=0, version=0, seq=1)
        incoming = server.receive(5.0)
        assert incoming is not None and incoming.peer == b"w" and incoming.message is not None
        message = incoming.message
        assert (message.op, message.rid, message.fields) == ("push_pull", 3, {"worker": 0, "version": 0, "seq": 1})
        assert message.borrowed and not message.lent and (message.arrays[0] == 1.5).all()
        assert server.lent_memory(b"w") and not server.lent_memory(b"someone else")
        params = np.full(SIZE, 0.25, np.float32)
        assert server.reply(b"w", Message("params", {"version": 1}, [params], 3, in_place=True))
        params[:] = -1.0  # in place: the endpoint is done with it
        rid, head = worker.memory.take_reply() or (0, b"")
        reply = reply_of(head)
        assert rid == 3 and reply.op == "params" and reply.fields == {"version": 1} and reply.lent == ["params"]
        into = np.zeros(SIZE, np.float32)
        worker.memory.read_params(into, rid=3)
        assert (into == 0.25).all()
        os.write(worker.memory._knock_write, b"\x01")  # a second knock for request 3 is not a second request
        assert server.receive(0.2) is None


def test_a_torn_knock_is_skipped_and_a_bad_one_refused_naming_why() -> None:
    with ps_endpoint() as server, lender(server) as worker:
        worker.attach()
        worker.knock(3, worker=0)
        worker.memory._views.knock.seq[0] = 4  # the worker began writing request 4
        assert server.receive(0.2) is None
        worker.knock(4, slot="params", worker=0)  # a region a request may not name
        refused = server.receive(5.0)
        assert refused is not None and refused.message is None and refused.rid == 4
        assert "unknown shared-memory slot 'params'" in str(refused.error)
        worker.memory.knock(
            5, bytes([JSON]) + encode(Message("push_pull", {"worker": 0}, [], 5))[0]
        )  # names no memory at all
        refused = server.receive(5.0)
        assert refused is not None and refused.rid == 5 and "must name the memory" in str(refused.error)


def test_a_request_naming_memory_the_endpoint_does_not_hold_is_sent_back_to_go_whole() -> None:
    """Say a ps that restarted, or let go: its endpoint answers itself, the ps never sees the request."""
    with ps_endpoint() as server, lender(server) as stranger:
        stranger.sock.send_multipart([header("push_pull", 7, worker=0)])
        assert server.receive(0.3) is None
        answer = stranger.reply()
        assert answer.op == UNLENT and answer.rid == 7 and "send it whole" in answer.fields["error"]
        stranger.attach()  # lent now: memory and frames at once is refused
        stranger.sock.send_multipart([*encode(Message("push_pull", {}, [np.ones(3, np.float32)], 8, lent=["grads"]))])
        refused = server.receive(5.0)
        assert refused is not None and refused.rid == 8 and "not both" in str(refused.error)


@pytest.mark.parametrize("doorbells", [True, False], ids=["knock", "header"])
def test_a_restarted_server_gets_the_request_whole_and_nothing_is_lost(doorbells: bool) -> None:
    """The worker's transport finds out from a broken knock pipe, or from the new server's answer, and resends."""
    first = ZmqTransport(ZmqOptions(transport=TransportOptions(doorbells=doorbells)))
    server = first.serve("127.0.0.1:0", "ps 0")
    address = server.address.removeprefix("tcp://")
    worker = ZmqTransport(ZmqOptions(transport=TransportOptions(doorbells=doorbells)))
    client = worker.connect([address], ["ps 0"], b"w")
    second = ZmqTransport(ZmqOptions(transport=TransportOptions(doorbells=doorbells)))
    try:
        buffers = client.buffers(0, SIZE)
        for step in range(1, 21):  # lending is agreed beside the first steps: within a few, they use it
            buffers.grads[:] = step
            pending = client.start_many({0: Message("push", {}, [buffers.grads], stable=True)})
            incoming = server.receive(5.0)
            assert incoming is not None and incoming.message is not None
            assert server.reply(
                b"w", Message("params", {}, [np.zeros(SIZE, np.float32)], incoming.message.rid, in_place=True)
            )
            pending.wait(10.0, "the parameters")
            if incoming.message.borrowed:
                break
        assert incoming.message.borrowed and client.sharing(0) != "frames"
        server.close()
        first.close()  # the process ends: what it mapped goes with it
        restarted = second.serve(address, "ps 0")
        buffers.grads[:] = 3.0
        pending = client.start_many({0: Message("push", {}, [buffers.grads], stable=True)})
        deadline, got = time.monotonic() + 10, None
        while got is None and time.monotonic() < deadline:
            client.receive(0.01)  # the worker waits for its reply, and takes the server's answer meanwhile
            got = restarted.receive(0.05)
        assert got is not None and got.message is not None and not got.message.borrowed
        assert (got.message.arrays[0] == 3.0).all() and client.sharing(0) == "frames"
        assert restarted.reply(b"w", Message("params", {}, [np.full(SIZE, 4.0, np.float32)], got.message.rid))
        reply = pending.wait(10.0, "the parameters")[0]
        assert (reply.arrays[0] == 4.0).all()
    finally:
        client.close()
        for transport in (worker, first, second):
            transport.close()


def test_a_ps_that_does_not_take_shared_memory_answers_the_offer_with_why() -> None:
    with ps_endpoint(shared_memory=False) as server, lender(server) as worker:
        answer = worker.attach()
        assert answer.op == REFUSED and "transport.shared_memory=false" in answer.fields["error"]
        assert not server.lent_memory(b"w")
        params = np.ones(SIZE, np.float32)
        assert server.reply(b"w", Message("params", {}, [params], 3, in_place=True))
        params[:] = 0.0  # sent as a copy: in place means the endpoint is done with it either way
        reply = worker.reply()
        assert not reply.lent and (reply.arrays[0] == 1.0).all()


def test_an_offer_bigger_than_a_message_may_be_is_refused() -> None:
    with ps_endpoint() as server, lender(server) as worker:
        server.limit_incoming(SIZE * 4 - 4, 1 << 20)
        assert worker.attach().op == REFUSED and not server.lent_memory(b"w")


def test_without_doorbells_a_ps_listens_for_no_knock_and_sends_the_replys_header() -> None:
    with ps_endpoint(doorbells=False) as server, lender(server) as worker:
        assert worker.attach().fields == {"bell": False, "knock": False}
        assert not worker.knock(3, worker=0) or server.receive(0.2) is None  # the ps holds no knock pipe
        assert server.reply(b"w", Message("params", {"v": 1}, [np.full(SIZE, 2.0, np.float32)], 4, in_place=True))
        reply = worker.reply()
        assert reply.lent == ["params"] and not reply.arrays and reply.fields == {"v": 1}
        into = np.zeros(SIZE, np.float32)
        worker.memory.read_params(into, rid=4)
        assert (into == 2.0).all()


def test_a_reply_to_another_connection_is_never_written_into_this_ones_memory() -> None:
    """E.g. a late answer to an earlier process of the worker: its memory is not the new one's."""
    with ps_endpoint() as server, lender(server, b"wNEW") as worker, lender(server, b"wOLD") as old:
        worker.attach()
        assert old.sock.poll(0) == 0
        assert server.reply(b"wOLD", Message("params", {}, [np.ones(SIZE, np.float32)], 2, in_place=True))
        assert old.reply().arrays and worker.memory.take_reply() is None
        with pytest.raises(PsdkError, match="belong to request 0"):
            worker.memory.read_params(np.zeros(SIZE, np.float32), rid=2)


def test_a_reply_never_overwrites_one_the_worker_has_not_read() -> None:
    """Two answers due at once (say, pushes a sync round held): the first in place, the next whole, in frames."""
    with ps_endpoint() as server, lender(server) as worker:
        worker.attach()
        for rid in (3, 4):
            assert server.reply(b"w", Message("params", {}, [np.full(SIZE, rid, np.float32)], rid, in_place=True))
        framed = worker.reply()
        assert framed.rid == 4 and not framed.lent and (framed.arrays[0] == 4.0).all()
        rid, _ = worker.memory.take_reply() or (0, b"")
        into = np.zeros(SIZE, np.float32)
        worker.memory.read_params(into, rid=3)
        assert rid == 3 and (into == 3.0).all()
        worker.send(Message("ping", {}, [], 5))  # asking again: it has read what came before
        assert server.receive(5.0) is not None
        assert server.reply(b"w", Message("params", {}, [np.full(SIZE, 5.0, np.float32)], 5, in_place=True))
        assert (worker.memory.take_reply() or (0,))[0] == 5


def test_a_forgotten_or_hung_up_lender_is_let_go_and_its_knocks_fail() -> None:
    with ps_endpoint() as server, lender(server) as worker, lender(server, b"w2") as other:
        worker.attach()
        worker.memory.knocks_heard()
        other.attach()
        other.memory.knocks_heard()
        server.forget(b"w")  # the ps: this worker finished
        assert not server.lent_memory(b"w") and not worker.knock(3, worker=0)  # a broken pipe: send it as a message
        other.memory.close()  # the worker's process is gone: its knock pipe hangs up
        deadline = time.monotonic() + 10
        while server.lent_memory(b"w2") and time.monotonic() < deadline:
            server.receive(0.05)
        assert not server.lent_memory(b"w2")
        assert server._poller is None  # back to the socket alone


def test_a_knock_an_earlier_offer_never_read_is_not_replayed() -> None:
    with ps_endpoint() as server, lender(server) as worker:
        worker.attach()
        worker.memory.knocks_heard()
        worker.memory._views.knock.write(5, knock_header("push_pull", 5, worker=0))  # written, never knocked for
        worker.attach(rid=6)  # e.g. after a recovery: a new offer, a new knock pipe
        worker.memory.knocks_heard()
        os.write(worker.memory._knock_write, b"\x01")  # a stray knock finds only request 5
        assert server.receive(0.2) is None
        worker.knock(7, worker=0)
        taken = server.receive(5.0)
        assert taken is not None and taken.message is not None and taken.message.rid == 7
