"""What a hostile peer sends cannot end a ps, poison its store, or make it hold without bound.

Each test here reproduces an attack that worked before it was closed: one
message that ended a ps before any authentication, pushes that drove the
store to -inf, a gradient rewritten in shared memory between the ps's check
and its apply, and requests that made the ps hold more and more.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from psdk.client import ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import NonFiniteError, RemoteError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.numerics import all_finite, magnitude
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, floor_key
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.ps.stats import STALENESS_CAP
from psdk.ps.store import FlatStore, RestoreState
from psdk.transport import Incoming, shm
from psdk.transport.wire import Message, decode, encode
from psdk.transport.zeromq import ZmqOptions, ZmqTransport
from tests.conftest import running_ps
from tests.helpers import FAST
from tests.test_shm import lender, ps_endpoint
from tests.test_shm_training import CapturingEndpoint

pytestmark = pytest.mark.timeout(60)

SIZE = 64


class Stranger:
    """A raw ZeroMQ connection that sends whatever frames it is given."""

    def __init__(self, context: zmq.Context[Any], address: str):
        self.sock = context.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address if "://" in address else f"tcp://{address}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout_s: float = 5.0) -> Message | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(linger=0)


def _init(client: ParameterClient, rule: Any = None, sync: str = "async", workers: int = 1) -> None:
    job = JobSpec(SyncSpec(sync).resolved(workers), 10_000, workers)
    client.initialize({"w": np.zeros(SIZE, np.float32)}, job, rule or SGD(lr=1.0))


def _client(transport: ZmqTransport, address: str, task: int = 0, workers: int = 1) -> ParameterClient:
    return ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["127.0.0.1"] * workers}), task, FAST)


NESTED = b'{"op":"pull","rid":7,"a":[],"f":{"x":' + b"[" * 30_000 + b"]" * 30_000 + b"}}"
HUGE_ZERO_SHAPE = json.dumps({"op": "push_pull", "rid": 8, "f": {"worker": 0}, "a": [["<f4", [0, 2**70]]]}).encode()


@pytest.mark.parametrize(
    "frames, answered",
    [
        ([NESTED], False),  # RecursionError in the parser: no rid can be read, so it is dropped and counted
        ([HUGE_ZERO_SHAPE, b""], True),  # passed the byte-count check (0 bytes), then reshape raised
        ([json.dumps({"op": "x" * 60_000, "rid": 9, "f": {}, "a": []}).encode()], True),
        ([json.dumps({"op": "ping", "rid": 10, "f": {"worker": "w" * 8000}, "a": []}).encode()], True),
        ([b'{"op":"ping","rid":11,"f":{"worker":1e999},"a":[]}'], True),
    ],
    ids=["nested-30000", "shape-0x2^70", "op-60k", "echoed-id", "float-overflow"],
)
def test_one_message_never_ends_the_ps(frames: list[bytes], answered: bool) -> None:
    with running_ps(scheme="tcp") as ps:
        server = ps.servers[0]
        stranger = Stranger(ps.transport.context, ps.addresses[0])
        try:
            stranger.send(frames)
            reply = stranger.reply(timeout_s=2.0 if not answered else 5.0)
            if answered:
                assert reply is not None and reply.op == "error" and len(reply.fields["error"]) <= 1001
            else:
                assert reply is None
            # The same connection is still served (it may claim a worker's id: this ps runs without CURVE).
            stranger.send(encode(Message("ping", {"worker": 1}, rid=99)))
            pong = stranger.reply()
            assert pong is not None and pong.op == "pong" and pong.rid == 99
            assert ps.threads[0].is_alive() and server.exit_code is None
            stats = server.stats
            deadline = time.monotonic() + 5
            while stats.handled < stats.requests:  # the reply leaves before its handling ends
                assert time.monotonic() < deadline
                time.sleep(0.005)
            assert stats.requests == 2 and sum(stats.replies.values()) + stats.unanswerable == 2
        finally:
            stranger.close()


def test_two_finite_pushes_that_overflow_are_refused_and_the_store_stays_finite() -> None:
    with running_ps(scheme="tcp") as ps:
        transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2, shared_memory=False)))
        client = _client(transport, ps.addresses[0])
        try:
            _init(client)
            client.grads["w"][...] = -3e38  # lr 1: w = 3e38, then 6e38 would be +inf
            client.push_pull()
            with pytest.raises(RemoteError, match="NaN or Inf"):
                client.push_pull()
            server = ps.servers[0]
            assert all_finite(server.store.params()) and server.store.version == 1
            assert server.stats.workers[0].refused == 1 and server.stats.refused == 1
            client.grads["w"][...] = 1e38  # a finite step back is applied as usual
            assert client.push_pull().outcome == "applied" and server.store.version == 2
        finally:
            client.close()
            transport.close()


def test_adam_slots_that_would_overflow_are_refused_with_the_parameters() -> None:
    store = FlatStore()
    store.initialize({"w": np.zeros(SIZE, np.float32)}, Adam(lr=0.1))
    store.apply(np.full(SIZE, 1.0, np.float32))
    before = store.digest(), {k: v.copy() for k, v in store.slots().items()}, store.rule_step
    with pytest.raises(Exception, match="NaN or Inf"):
        store.apply(np.full(SIZE, 3e38, np.float32))  # g*g overflows v
    assert store.digest() == before[0] and store.rule_step == before[2]
    for name, value in store.slots().items():
        np.testing.assert_array_equal(value, before[1][name])


def test_a_sync_round_whose_sum_would_overflow_refuses_the_push_that_overflows_it() -> None:
    with running_ps(scheme="tcp") as ps:
        transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2, shared_memory=False)))
        chief, other = _client(transport, ps.addresses[0], 0, 2), _client(transport, ps.addresses[0], 1, 2)
        try:
            _init(chief, sync="sync", workers=2)
            other.wait_initialized()
            chief.grads["w"][...] = 3e38
            pending = chief.start_push_pull()  # parked: the round needs both
            server = ps.servers[0]
            deadline = time.monotonic() + 10
            while len(server.policy.parked()) < 1:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the chief's push never reached the ps"
                time.sleep(0.005)
            other.grads["w"][...] = 3e38
            with pytest.raises(RemoteError, match="overflow"):
                other.push_pull()
            other.grads["w"][...] = -1e38
            other_pending = other.start_push_pull()
            assert chief.finish_push_pull(pending).outcome == "applied"
            assert other.finish_push_pull(other_pending).outcome == "applied"
            assert all_finite(server.store.params()) and server.store.version == 1
            assert server.stats.workers[1].refused == 1
        finally:
            chief.close()
            other.close()
            transport.close()


@pytest.mark.parametrize(
    "slot, message",
    [(np.full(SIZE, np.nan, np.float32), "NaN"), (np.full(SIZE, -1.0, np.float32), "negative")],
)
def test_a_restore_with_slots_the_rule_cannot_run_from_is_refused(slot: np.ndarray, message: str) -> None:
    store = FlatStore()
    with pytest.raises(Exception, match=message):
        store.initialize(
            {"w": np.zeros(SIZE, np.float32)}, Adam(), RestoreState(5, 5, {"m": {"w": slot * 0}, "v": {"w": slot}})
        )
    assert not store.initialized
    store.initialize({"w": np.zeros(SIZE, np.float32)}, Adam())
    with pytest.raises(Exception, match=message):
        store.reset({"w": np.ones(SIZE, np.float32)}, RestoreState(5, 5, {"m": {"w": slot * 0}, "v": {"w": slot}}))
    assert store.version == 0 and float(store.params().sum()) == 0.0


def test_values_beyond_float32_are_refused_at_init() -> None:
    store = FlatStore()
    with pytest.raises(Exception, match="NaN or Inf"):
        store.initialize({"w": np.full(SIZE, 1e300, np.float64)}, SGD())
    assert not store.initialized


FLIPPER = """
import mmap, os, sys
import numpy as np
pid, fd, nbytes, offset, size = map(int, sys.argv[1:])
memory = mmap.mmap(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR), nbytes)
grads = np.frombuffer(memory, np.float32, size, offset=offset)
grads[8] = 2.0  # started
while True:
    grads[7] = np.nan
    grads[7] = 1.0
"""


@pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc")
def test_a_gradient_rewritten_in_shared_memory_during_the_push_never_reaches_the_store() -> None:
    """Another process flips one element of the shared gradient between NaN and 1.0 while the worker knocks.

    Before, the ps checked the gradient in the worker's memory and then applied
    it from there: NaN reached the store within a second. Now the store checks
    what the apply made of it, whatever the apply read, and refuses NaN there.
    """
    with ps_endpoint() as endpoint, lender(endpoint, size=SIZE) as worker:
        server = ParameterServer(endpoint, 0)
        job = JobSpec(SyncSpec("async").resolved(1), 10**9, 1).to_json()
        rule = SGD(lr=0.01).to_json()
        worker.send(
            Message("init", {"worker": 0, "job": job, "rule": rule, "names": ["w"]}, [np.zeros(SIZE, np.float32)])
        )
        incoming = endpoint.receive(10.0)
        assert incoming is not None
        server.handle(incoming)
        worker.attach(rid=2)
        worker.memory.knocks_heard()
        worker.memory.grads[...] = 1.0
        args = [str(v) for v in (os.getpid(), worker.memory.fd, shm.total_bytes(SIZE), shm.HEADER_BYTES, SIZE)]
        flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, *args])
        try:
            deadline = time.monotonic() + 30
            while worker.memory.grads[8] != 2.0:
                assert time.monotonic() < deadline and flipper.poll() is None, "the flipping process did not start"
                time.sleep(0.01)
            rid = 10
            while rid < 3000:
                rid += 1
                assert worker.knock(rid, worker=0, version=server.store.version, seq=rid, epoch=0)
                incoming = endpoint.receive(1.0)
                if incoming is not None:
                    server.handle(incoming)
                assert all_finite(server.store.params()), f"NaN reached the store after {rid - 10} pushes"
        finally:
            flipper.kill()
            flipper.wait(timeout=10)
    counters = server.stats.workers[0]
    assert counters.applied > 100 and counters.refused > 0  # the race was really run, both ways


def _handler_ps(options: ServerOptions | None = None) -> tuple[ParameterServer, CapturingEndpoint]:
    endpoint = CapturingEndpoint()
    return ParameterServer(endpoint, 0, options or ServerOptions()), endpoint


def test_worker_ids_beyond_the_limit_are_refused_before_and_after_init() -> None:
    server, endpoint = _handler_ps(ServerOptions(max_workers=4))
    for worker in (4, 10**12):
        server.handle(Incoming(b"s", Message("wait_init", {"worker": worker}, rid=1)))
        assert endpoint.sent[-1][1].op == "error" and "beyond the 4 workers" in endpoint.sent[-1][1].fields["error"]
    assert not server.sessions.by_worker and not server.membership.workers
    job = JobSpec(SyncSpec("async").resolved(5), 10, 5).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD().to_json(), "names": ["w"]}, [np.zeros(4, np.float32)], 2
    )
    server.handle(Incoming(b"c", init))
    assert endpoint.sent[-1][1].op == "error" and "at most 4" in endpoint.sent[-1][1].fields["error"]
    assert not server.store.initialized


def test_a_bad_epoch_in_init_leaves_the_store_uninitialised() -> None:
    server, endpoint = _handler_ps()
    job = JobSpec(SyncSpec("async").resolved(1), 10, 1).to_json()
    fields = {"worker": 0, "job": job, "rule": SGD().to_json(), "names": ["w"], "epoch": -3}
    server.handle(Incoming(b"c", Message("init", fields, [np.zeros(4, np.float32)], 2)))
    assert endpoint.sent[-1][1].op == "error" and not server.store.initialized and server.job is None


def test_pushes_a_worker_does_not_wait_for_are_refused_beyond_the_limit() -> None:
    server, endpoint = _handler_ps(ServerOptions(max_pushes_in_flight=2))
    job = JobSpec(SyncSpec("ssp", staleness=0).resolved(2), 10**6, 2).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD().to_json(), "names": ["w"]}, [np.zeros(4, np.float32)], 1
    )
    server.handle(Incoming(b"c", init))
    outcomes = []
    for seq in range(1, 6):  # worker 0 never waits, and worker 1 never pushes: ssp holds every answer
        push = Message(
            "push_pull", {"worker": 0, "version": server.store.version, "seq": seq}, [np.ones(4, np.float32)], 10 + seq
        )
        server.handle(Incoming(b"c", push))
        outcomes.append(endpoint.sent[-1][1].op if endpoint.sent[-1][1].rid == 10 + seq else "held")
    assert outcomes == ["held", "held", "error", "error", "error"]
    assert server.store.version == 2 and len(server.policy.parked()) == 2  # type: ignore[union-attr]


def test_staleness_a_worker_claims_cannot_grow_the_histogram() -> None:
    server, _endpoint = _handler_ps()
    job = JobSpec(SyncSpec("async").resolved(1), 10**6, 1).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD(lr=1e-9).to_json(), "names": ["w"]}, [np.zeros(4, np.float32)], 1
    )
    server.handle(Incoming(b"c", init))
    for seq in range(1, 2 * STALENESS_CAP):  # always from version 0: one more staleness each time
        server.handle(
            Incoming(b"c", Message("push_pull", {"worker": 0, "version": 0, "seq": seq}, [np.ones(4, np.float32)], seq))
        )
    assert len(server.stats.workers[0].staleness) == STALENESS_CAP + 1


def test_a_stranger_gets_no_parameters() -> None:
    server, endpoint = _handler_ps()
    job = JobSpec(SyncSpec("async").resolved(1), 10, 1).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD().to_json(), "names": ["w"]}, [np.ones(4, np.float32)], 1
    )
    server.handle(Incoming(b"c", init))
    server.handle(Incoming(b"s", Message("pull", {}, rid=2)))
    reply = endpoint.sent[-1][1]
    assert reply.op == "error" and "needs the id of one of the job's workers" in reply.fields["error"]
    assert not reply.arrays


BOUNDED_RULES = [
    SGD(lr=0.5),
    SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    Adam(lr=0.01, weight_decay=0.1),
    Adam(lr=0.01, epsilon_mode="tf"),
    Adagrad(lr=0.1, initial_accumulator_value=0.1),
    Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=0.0),  # TensorFlow 1.x's: bounded by its smallest sum
    RMSProp(lr=0.01, momentum=0.5),
    RMSProp(lr=0.01, centered=True),  # gives no bounds: always the backup and check
]


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    rule_index=st.integers(0, len(BOUNDED_RULES) - 1),
    start=st.floats(-1e3, 1e3),
    scales=st.lists(st.sampled_from([1e-3, 1.0, 1e3, 1e12, 1e20, 1e30, 1e36, 3e38]), min_size=1, max_size=12),
    signs=st.lists(st.sampled_from([1.0, -1.0]), min_size=12, max_size=12),
)
def test_the_bounds_that_skip_the_check_are_never_wrong(
    rule_index: int, start: float, scales: list[float], signs: list[float]
) -> None:
    """Whatever the gradients, the store stays finite and its bounds hold for what it really holds."""
    store = FlatStore()
    store.initialize({"w": np.linspace(-start, start, SIZE, dtype=np.float32)}, BOUNDED_RULES[rule_index])
    for scale, sign in zip(scales, signs, strict=False):
        grad = (np.linspace(-1, 1, SIZE) * scale * sign).astype(np.float32)
        with contextlib.suppress(NonFiniteError):
            store.apply(grad, magnitude(grad))
        params_bound, slot_bounds = store._bounds  # type: ignore[misc]
        assert all_finite(store.params()) and float(np.abs(store.params()).max()) <= params_bound
        for name, slot in store.slots().items():
            assert all_finite(slot) and float(np.abs(slot).max()) <= slot_bounds[name]
            assert float(slot.min()) >= slot_bounds.get(floor_key(name), -np.inf)


def test_ordinary_updates_are_proven_finite_without_a_backup_and_huge_ones_are_checked() -> None:
    store = FlatStore()
    store.initialize({"w": np.zeros(SIZE, np.float32)}, SGD(lr=0.1, momentum=0.9))
    rng = np.random.default_rng(0)
    for _ in range(1000):
        grad = rng.standard_normal(SIZE).astype(np.float32)
        store.apply(grad, magnitude(grad))
    assert store.checked_applies == 0 and store.version == 1000
    huge = np.full(SIZE, 1e35, np.float32)
    store.apply(huge, magnitude(huge))  # finite, but too close to the limit to be proven: checked
    assert store.checked_applies == 1 and store.version == 1001
    store.apply(grad)  # no bound given (a gradient that may change): checked too
    assert store.checked_applies == 2


def test_full_queues_from_peers_that_reset_never_abort_the_ps_process(tmp_path: Path) -> None:
    """libzmq asserts (and aborts the process) when a ZeroMQ heartbeat falls due on a connection whose queue is
    full and whose peer has gone. 16 raw connections that each sent 5,000 requests and reset did it to a ps at
    the first try; a ps now sends no ZeroMQ heartbeats (TCP keepalive drops dead links instead)."""
    import socket
    import struct
    import threading

    from psdk.bench.zmtp import RawZmtpPeer
    from tests.conftest import REPO, free_port
    from tests.jobs import env

    port = free_port()
    command = [
        sys.executable, "-m", "psdk", "ps", f"ps_hosts=127.0.0.1:{port}", "worker_hosts=localhost",
        "transport.secure=false", "transport.heartbeat_interval_s=0.2", f"hydra.run.dir={tmp_path}",
        f"ps.announce_file={tmp_path / 'ps.json'}",
    ]  # fmt: skip
    ps = subprocess.Popen(command, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ps.json").exists():
            assert ps.poll() is None and time.monotonic() < deadline, "the ps did not start"
            time.sleep(0.05)
        request = json.dumps({"op": "stats", "rid": 1, "f": {"worker": 0}, "a": []}).encode()
        burst = b"".join(bytes([0, len(request)]) + request for _ in range(5000))

        def flood_and_reset() -> None:
            try:
                peer = RawZmtpPeer("127.0.0.1", port, timeout_s=2.0)
                peer.sock.sendall(burst)
                peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                peer.close()  # a reset, with the ps's queue for it full
            except OSError:
                pass

        for _ in range(3):
            floods = [threading.Thread(target=flood_and_reset) for _ in range(16)]
            for thread in floods:
                thread.start()
            for thread in floods:
                thread.join(timeout=30)
            time.sleep(1.0)  # several of the old heartbeat intervals
            assert ps.poll() is None, ps.communicate(timeout=10)[0][-2000:]
        transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2, shared_memory=False)))
        client = _client(transport, f"127.0.0.1:{port}")
        try:
            _init(client)
            assert client.push_pull().global_step == 1
            client.shutdown()
        finally:
            client.close()
            transport.close()
        assert ps.wait(timeout=30) == 0
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait(timeout=10)


def test_a_ps_socket_sends_no_zeromq_heartbeats_and_keeps_tcp_alive() -> None:
    """The process-level test above needs libzmq's queue to fill; this one pins down the setting itself."""
    transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)))
    try:
        endpoint = transport.serve("127.0.0.1:0", "ps 0")
        sock = endpoint.sock  # type: ignore[attr-defined]
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
        assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1 and sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 2
        endpoint.close()
    finally:
        transport.close()


def test_a_worker_socket_sends_no_zeromq_heartbeats_either() -> None:
    """The ps's I/O thread answers a worker's PING: one queued on a full connection when the worker went aborted a
    ps slowed to 1 s per update at the end of the job, 4 runs of 4. A worker's own pings find a dead ps."""
    transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)))
    try:
        endpoint = transport.connect(["127.0.0.1:1"], ["ps 0"])  # connecting is asynchronous: nothing need listen
        for sock in endpoint.socks:  # type: ignore[attr-defined]
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0 and sock.getsockopt(zmq.HEARTBEAT_TTL) == 0
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1 and sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 2
        endpoint.close()
    finally:
        transport.close()
