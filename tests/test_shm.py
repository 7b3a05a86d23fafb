"""Same-host shared memory: a worker's buffers mapped by its ps, checked, and the fallback to frames."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from psdk import shm
from psdk.client import ParameterClient
from psdk.cluster import ClusterSpec
from psdk.consistency import SyncSpec
from psdk.errors import ProtocolError, PsdkError, RemoteError
from psdk.jobspec import JobSpec
from psdk.optim import SGD
from psdk.ps.server import ParameterServer
from psdk.transport import Incoming, ServerEndpoint
from psdk.wire import Message
from psdk.zmq_transport import ZmqOptions, ZmqTransport
from tests.conftest import running_ps
from tests.helpers import FAST

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc"),
]

SIZE = 1000


def test_the_ps_reads_the_gradient_and_writes_the_parameters_in_the_workers_memory() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    worker.grads[:] = 3.0
    worker.outbox[:] = 4.0
    assert ps.gradient("grads").sum() == 3.0 * SIZE
    assert ps.gradient("outbox").sum() == 4.0 * SIZE
    ps.write_params(np.arange(SIZE, dtype=np.float32), rid=7)
    into = np.zeros(SIZE, np.float32)
    worker.read_params(into, rid=7)
    np.testing.assert_array_equal(into, np.arange(SIZE, dtype=np.float32))
    ps.close()
    worker.close()


def test_parameters_written_for_another_request_are_never_used() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    ps.write_params(np.ones(SIZE, np.float32), rid=7)
    into = np.zeros(SIZE, np.float32)
    with pytest.raises(PsdkError, match="belong to request 7, not 8"):
        worker.read_params(into, rid=8)
    ps._seq[0] = 9  # a write for request 9 began while request 7's parameters were being read
    with pytest.raises(PsdkError, match="overwrote"):
        worker.read_params(into, rid=7)
    ps.close()
    worker.close()


def _bad(offer: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**offer, **change}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"token": "00" * shm.TOKEN_BYTES}, "token"),
        ({"token": "not hex"}, "bad token"),
        ({"bytes": 64}, "needs"),
        ({"fd": 99999}, "cannot open"),
        ({"pid": -1}, "bad pid"),
        ({"fd": True}, "bad fd"),
    ],
)
def test_a_bad_offer_is_refused_with_a_reason(change: dict[str, Any], message: str) -> None:
    worker = shm.WorkerBuffers(SIZE)
    with pytest.raises(ProtocolError, match=message):
        shm.AttachedBuffers(_bad(worker.offer(), **change), SIZE)
    worker.close()


def test_a_file_that_is_not_a_sealed_memory_file_is_refused() -> None:
    """A peer cannot point the ps at some other file of this host to have parameters written into it."""
    worker = shm.WorkerBuffers(SIZE)
    with tempfile.TemporaryFile() as plain:
        plain.write(worker.token + bytes(shm.total_bytes(SIZE) - shm.TOKEN_BYTES))
        plain.flush()
        offer = _bad(worker.offer(), fd=plain.fileno())
        with pytest.raises(ProtocolError, match="not a sealed memory file"):
            shm.AttachedBuffers(offer, SIZE)
        before = os.pread(plain.fileno(), 32, 0)
    assert before[: shm.TOKEN_BYTES] == worker.token
    worker.close()


def test_a_device_is_never_opened() -> None:
    worker = shm.WorkerBuffers(SIZE)
    with open(os.devnull, "rb") as device, pytest.raises(ProtocolError, match="not a memory file"):
        shm.AttachedBuffers(_bad(worker.offer(), fd=device.fileno()), SIZE)
    worker.close()


def test_an_unknown_slot_is_refused() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    with pytest.raises(ProtocolError, match="unknown shared-memory slot"):
        ps.gradient("params")
    ps.close()
    worker.close()


@contextmanager
def ps_over_tcp(shared_memory: bool) -> Iterator[tuple[ParameterServer, str]]:
    with running_ps(scheme="tcp", shared_memory=shared_memory) as ps:
        yield ps.servers[0], ps.addresses[0]


def _train(
    address: str,
    shared_memory: bool,
    copy: bool,
    doorbells: bool = True,
    before_close: Callable[[], None] | None = None,
) -> tuple[np.ndarray, bool]:
    """Ten SGD steps of made-up gradients from one worker; the final parameters, and whether memory was shared.

    ``before_close`` looks at the ps while the worker is still there (its buffers go when it closes).
    """
    transport = ZmqTransport(ZmqOptions(heartbeat_interval_s=0.2, shared_memory=shared_memory, doorbells=doorbells))
    client = ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["127.0.0.1"]}), 0, FAST)
    try:
        job = JobSpec(SyncSpec("async").resolved(1), 10, 1)
        client.initialize({"w": np.linspace(-1, 1, SIZE, dtype=np.float32)}, job, SGD(lr=0.5))
        shared = client.shards[0].shared
        rng = np.random.default_rng(0)
        done = False
        while not done:
            client.grads["w"][...] = rng.standard_normal(SIZE).astype(np.float32)
            done = client.finish_push_pull(client.start_push_pull(copy=copy)).done
        client.pull()
        if before_close is not None:
            before_close()
        return client.params["w"].copy(), shared
    finally:
        client.close()
        transport.close()


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "outbox"])
def test_training_through_shared_memory_matches_training_through_frames(copy: bool) -> None:
    def knocked_and_rung() -> None:
        attached = server.shared.by_worker[0]
        assert attached.bell >= 0 and attached.knock >= 0 and attached._last_knock > 0

    with ps_over_tcp(shared_memory=True) as (server, address):
        shared_params, shared = _train(address, shared_memory=True, copy=copy, before_close=knocked_and_rung)
        assert shared
        deadline = time.monotonic() + 10  # the closed worker's knock pipe hung up: the ps lets its memory go
        while server.shared.by_worker and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.shared.by_worker
    with ps_over_tcp(shared_memory=True) as (server, address):
        framed_params, framed_shared = _train(address, shared_memory=False, copy=copy)
        assert not framed_shared and not server.shared.by_worker
    np.testing.assert_array_equal(shared_params, framed_params)
    assert not np.array_equal(shared_params, np.linspace(-1, 1, SIZE, dtype=np.float32))


def test_without_doorbells_the_parameters_still_come_through_shared_memory() -> None:
    def no_pipes() -> None:  # pushes and replies were header-only ZeroMQ messages
        assert server.shared.by_worker[0].bell == -1 and server.shared.by_worker[0].knock == -1

    with ps_over_tcp(shared_memory=True) as (server, address):
        params, shared = _train(address, shared_memory=True, copy=False, doorbells=False, before_close=no_pipes)
        assert shared
    with ps_over_tcp(shared_memory=True) as (server, address):
        rung, _ = _train(address, shared_memory=True, copy=False)
    np.testing.assert_array_equal(params, rung)


def test_a_ps_that_refuses_shared_memory_leaves_the_worker_on_frames() -> None:
    with ps_over_tcp(shared_memory=False) as (server, address):
        params, shared = _train(address, shared_memory=True, copy=False)
        assert not shared and not server.shared.by_worker
        assert server.stats.rejected == 0  # a refusal is not a rejected request
        assert server.store.version == 10
    assert np.isfinite(params).all()


class CapturingEndpoint(ServerEndpoint):
    """Collects the ps's replies, so a test can drive its handlers one request at a time."""

    address = "capture"
    shares_memory = True
    knocks = True

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.listening: dict[int, Callable[[], Incoming | None]] = {}

    def listen(self, fd: int, take: Callable[[], Incoming | None]) -> None:
        self.listening[fd] = take

    def unlisten(self, fd: int) -> None:
        self.listening.pop(fd, None)

    def receive(self, timeout_s: float) -> Incoming | None:
        return None

    def reply(self, peer: bytes, message: Message) -> bool:
        self.sent.append((peer, message))
        return True

    def close(self) -> None:
        pass


def _attached_ps(offer: dict[str, Any], session: bytes = b"w") -> tuple[ParameterServer, CapturingEndpoint]:
    """A ps driven by hand, initialised by worker 0 (ones), which then offers ``offer`` from ``session``."""
    endpoint = CapturingEndpoint()
    server = ParameterServer(endpoint, 0)
    job = JobSpec(SyncSpec("async").resolved(1), 10, 1).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD(lr=0.1).to_json(), "names": ["w"]}, [np.ones(SIZE, np.float32)]
    )
    server.handle(Incoming(session, init))
    server.handle(Incoming(session, Message("attach", {"worker": 0, **offer}, rid=2)))
    return server, endpoint


def test_a_late_answer_to_an_earlier_process_of_the_worker_is_not_written_into_the_new_ones_memory() -> None:
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer(bell=False), session=b"wNEW")
    assert endpoint.sent[-1][1].op == "attached"
    server.shard.reply_params(b"wOLD", 2, "applied", 0)  # e.g. a parked push of the worker's previous process
    assert endpoint.sent[-1][1].arrays and not endpoint.sent[-1][1].fields.get("shm")
    with pytest.raises(PsdkError, match="belong to request 0"):
        worker.read_params(np.zeros(SIZE, np.float32), rid=2)
    server.shard.reply_params(b"wNEW", 3, "applied", 0)
    assert endpoint.sent[-1][1].fields["shm"] and not endpoint.sent[-1][1].arrays
    into = np.zeros(SIZE, np.float32)
    worker.read_params(into, rid=3)
    assert (into == 1.0).all()
    worker.close()


def test_a_reply_through_shared_memory_rings_the_doorbell_instead_of_sending_a_message() -> None:
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer())
    assert endpoint.sent[-1][1].op == "attached" and endpoint.sent[-1][1].fields["bell"] is True
    assert worker.take_reply() is None  # nothing written yet
    sent = len(endpoint.sent)
    server.shard.reply_params(b"w", 3, "applied", 0)
    assert len(endpoint.sent) == sent  # no message: the doorbell rang
    reply = worker.take_reply()
    assert reply is not None and reply.rid == 3 and reply.op == "params"
    assert reply.fields == {"version": 0, "done": False, "outcome": "applied", "shm": True, "slowest": 0}
    into = np.zeros(SIZE, np.float32)
    worker.read_params(into, rid=3)
    assert (into == 1.0).all()
    with pytest.raises(BlockingIOError):  # take_reply drained the doorbell
        os.read(worker.bell, 1)
    server.handle(Incoming(b"w", Message("finish", {"worker": 0}, rid=4)))
    assert not server.shared.by_worker  # the finished worker's doorbell is closed with its mapping
    worker.close()


def test_an_outcome_the_header_cannot_hold_goes_as_a_message() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    assert ps.write_params(np.ones(SIZE, np.float32), 5, {"version": 1, "outcome": "applied"})
    assert not ps.write_params(np.ones(SIZE, np.float32), 6, {"version": 1, "outcome": "surprise"})
    assert not ps.write_params(np.ones(SIZE, np.float32), 7)
    # Only request 5 rang; its ring must not come back as the reply to request 7, which carries no fields.
    assert worker.take_reply() is None
    ps.close()
    worker.close()


def test_a_torn_reply_header_is_not_taken() -> None:
    worker = shm.WorkerBuffers(SIZE)
    ps = shm.AttachedBuffers(worker.offer(), SIZE)
    ps.write_params(np.ones(SIZE, np.float32), 5, {"version": 1, "outcome": "applied"})
    ps._seq[0] = 6  # the ps began writing the reply to request 6
    assert worker.take_reply() is None
    ps.close()
    worker.close()


def test_a_doorbell_that_is_not_a_pipe_is_never_written() -> None:
    worker = shm.WorkerBuffers(SIZE)
    with tempfile.TemporaryFile() as plain:
        server, endpoint = _attached_ps({**worker.offer(), "bell": plain.fileno()})
        assert endpoint.sent[-1][1].op == "attached" and endpoint.sent[-1][1].fields["bell"] is False
        server.shard.reply_params(b"w", 3, "applied", 0)
        assert endpoint.sent[-1][1].fields["shm"]  # replied with a message instead
        assert os.fstat(plain.fileno()).st_size == 0
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


def test_a_worker_that_pushes_in_frames_is_answered_in_frames_not_through_its_doorbell() -> None:
    # E.g. a worker whose offer another shard refused with an error, and that gave up sharing with every shard.
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer())
    push = Message("push_pull", {"worker": 0, "version": 0, "seq": 1, "epoch": 0}, [np.ones(SIZE, np.float32)], rid=3)
    server.handle(Incoming(b"w", push))
    reply = endpoint.sent[-1][1]
    assert reply.op == "params" and reply.rid == 3 and len(reply.arrays) == 1 and not reply.fields.get("shm")
    assert not server.shared.by_worker and worker.take_reply() is None
    worker.close()


def test_a_knock_is_handled_as_the_push_it_stands_for() -> None:
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer())
    assert endpoint.sent[-1][1].fields == {"bell": True, "knock": True}
    ((knock_fd, take),) = endpoint.listening.items()
    assert take() is None  # nobody knocked yet
    worker.grads[...] = 1.0
    assert worker.knock(3, version=0, seq=1, epoch=0, slot="grads")
    incoming = take()
    assert incoming is not None and incoming.peer == b"w"  # the session that attached
    assert incoming.message is not None and incoming.message.rid == 3 and incoming.message.op == "push_pull"
    assert incoming.message.fields == {"worker": 0, "version": 0, "seq": 1, "epoch": 0, "shm": "grads"}
    sent = len(endpoint.sent)
    server.handle(incoming)
    assert len(endpoint.sent) == sent and server.store.version == 1  # applied, answered by the doorbell
    reply = worker.take_reply()
    assert reply is not None and reply.rid == 3 and reply.fields["outcome"] == "applied"
    into = np.zeros(SIZE, np.float32)
    worker.read_params(into, rid=3)
    np.testing.assert_allclose(into, 0.9)
    os.write(worker._knock_write, b"\x01")  # a second knock for request 3 is not a second push
    assert take() is None
    worker.close()  # the worker's knock pipe hangs up: the ps lets its memory go
    assert take() is None and not server.shared.by_worker and knock_fd not in endpoint.listening


def test_a_torn_or_bad_knock_is_not_applied() -> None:
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer())
    (take,) = endpoint.listening.values()
    worker.knock(3, version=0, seq=1, epoch=0, slot="grads")
    worker._views.knock_seq[0] = 4  # the worker began writing request 4
    assert take() is None
    worker.knock(4, version=0, seq=2, epoch=0, slot="grads")
    worker._views.knock[3] = 7  # no such slot
    incoming = take()
    assert incoming is not None
    server.handle(incoming)
    error = endpoint.sent[-1][1]
    assert error.op == "error" and error.rid == 4 and "unknown shared-memory slot 7" in error.fields["error"]
    assert server.store.version == 0
    worker.close()


def test_without_doorbells_a_ps_does_not_listen_for_knocks() -> None:
    worker = shm.WorkerBuffers(SIZE)
    _, endpoint = _attached_ps(worker.offer(bell=False))
    assert endpoint.sent[-1][1].fields == {"bell": False, "knock": False} and not endpoint.listening
    worker.close()


def test_after_the_ps_lets_go_a_knock_fails_and_the_push_is_refused_at_once() -> None:
    """The ps holds the only reader of a knock pipe it heard: closing it breaks the pipe, no push waits in it."""
    with ps_over_tcp(shared_memory=True) as (_, address):
        transport = ZmqTransport(ZmqOptions(heartbeat_interval_s=0.2))
        client = ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["127.0.0.1"]}), 0, FAST)
        try:
            client.initialize({"w": np.zeros(SIZE, np.float32)}, JobSpec(SyncSpec("async").resolved(1), 10, 1), SGD())
            assert client.shards[0].knocks
            client.push_pull()
            client.finish({})  # the ps lets the worker's memory go
            started = time.monotonic()
            with pytest.raises(RemoteError, match="has not offered"):
                client.push_pull()
            assert time.monotonic() - started < FAST.request_timeout_s / 2
        finally:
            client.close()
            transport.close()


def test_a_knock_an_earlier_attachment_never_read_is_not_replayed() -> None:
    worker = shm.WorkerBuffers(SIZE)
    server, endpoint = _attached_ps(worker.offer())
    worker.knock(5, version=0, seq=1, epoch=0, slot="grads")  # then the ps let go before reading it
    server.handle(Incoming(b"w", Message("attach", {"worker": 0, **worker.offer()}, rid=6)))
    (take,) = endpoint.listening.values()
    assert take() is None and server.store.version == 0
    worker.knock(7, version=0, seq=2, epoch=0, slot="grads")
    taken = take()
    assert taken is not None and taken.message is not None and taken.message.rid == 7
    worker.close()


def test_a_server_listens_to_several_knock_pipes_and_stops_cleanly() -> None:
    transport = ZmqTransport()
    server = transport.serve("127.0.0.1:0", "ps 0")
    pipes = [os.pipe2(os.O_NONBLOCK) for _ in range(2)]
    try:
        assert server.knocks
        for n, (read, _) in enumerate(pipes):
            server.listen(read, lambda n=n, read=read: os.read(read, 16) and Incoming(b"w%d" % n, None))
            server.listen(read, lambda n=n, read=read: os.read(read, 16) and Incoming(b"w%d" % n, None))  # again
        for _, write in pipes:
            os.write(write, b"\x01")
        got = [server.receive(1.0), server.receive(1.0)]
        assert sorted(i.peer for i in got if i is not None) == [b"w0", b"w1"]
        assert server.receive(0.05) is None
        for read, _ in pipes:
            server.unlisten(read)
        os.write(pipes[0][1], b"\x01")
        assert server.receive(0.05) is None  # no longer listened to: back to the socket alone
    finally:
        server.close()
        transport.close()
        for fds in pipes:
            for fd in fds:
                os.close(fd)


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
