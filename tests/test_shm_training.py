"""Same-host shared memory end to end: a real ps and client training through it, and letting it go.

The memory file's checks and the lending on ZeroMQ endpoints are in
``test_shm.py``; here the whole, against the same training through frames.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from psdk.client import ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import RemoteError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer
from psdk.transport import Incoming, ServerEndpoint, shm
from psdk.transport.wire import Message
from psdk.transport.zeromq import ZmqOptions, ZmqServer, ZmqTransport
from tests.conftest import running_ps
from tests.helpers import FAST

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.available(), reason="needs Linux memfd and /proc"),
]

SIZE = 1000


# ------------------------------------------------------------- a ps and a client
@contextmanager
def ps_over_tcp(shared_memory: bool) -> Iterator[tuple[ParameterServer, str]]:
    with running_ps(scheme="tcp", shared_memory=shared_memory) as ps:
        yield ps.servers[0], ps.addresses[0]


def lent(server: ParameterServer) -> dict[bytes, shm.AttachedBuffers]:
    endpoint = server.endpoint
    assert isinstance(endpoint, ZmqServer)
    return endpoint.links.by_peer


def _train(
    address: str,
    shared_memory: bool,
    copy: bool,
    doorbells: bool = True,
    before_close: Callable[[ParameterClient], None] | None = None,
) -> tuple[np.ndarray, str]:
    """Ten SGD steps of made-up gradients from one worker; the final parameters, and how arrays travelled.

    ``before_close`` looks at the ps while the worker is still there (what it lent goes when it closes).
    """
    transport = ZmqTransport(
        ZmqOptions(
            transport=TransportOptions(heartbeat_interval_s=0.2, shared_memory=shared_memory, doorbells=doorbells)
        )
    )
    client = ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["127.0.0.1"]}), 0, FAST)
    try:
        job = JobSpec(SyncSpec("async").resolved(1), 10, 1)
        client.initialize({"w": np.linspace(-1, 1, SIZE, dtype=np.float32)}, job, SGD(lr=0.5))
        rng = np.random.default_rng(0)
        done = False
        while not done:
            client.grads["w"][...] = rng.standard_normal(SIZE).astype(np.float32)
            done = client.finish_push_pull(client.start_push_pull(copy=copy)).done
        client.pull()
        client.status()  # over the socket, after the transport's answer to the offer (a ring may overtake it)
        if before_close is not None:
            before_close(client)
        return client.params["w"].copy(), client.endpoint.sharing(0)
    finally:
        client.close()
        transport.close()


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "outbox"])
def test_training_through_shared_memory_matches_training_through_frames(copy: bool) -> None:
    def knocked_and_rung(client: ParameterClient) -> None:
        ((_, attached),) = lent(server).items()
        assert attached.bell >= 0 and attached.knock >= 0 and attached._last_knock > 0

    with ps_over_tcp(shared_memory=True) as (server, address):
        shared_params, sharing = _train(address, shared_memory=True, copy=copy, before_close=knocked_and_rung)
        assert sharing == "shared memory, doorbell and knocks"
        deadline = time.monotonic() + 10  # the closed worker's knock pipe hung up: the ps lets its memory go
        while lent(server) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not lent(server)
    with ps_over_tcp(shared_memory=True) as (server, address):
        framed_params, sharing = _train(address, shared_memory=False, copy=copy)
        assert sharing == "frames" and not lent(server)
    np.testing.assert_array_equal(shared_params, framed_params)
    assert not np.array_equal(shared_params, np.linspace(-1, 1, SIZE, dtype=np.float32))


def test_without_doorbells_the_parameters_still_come_through_shared_memory() -> None:
    def no_pipes(client: ParameterClient) -> None:  # pushes and replies were header-only ZeroMQ messages
        ((_, attached),) = lent(server).items()
        assert attached.bell == -1 and attached.knock == -1

    with ps_over_tcp(shared_memory=True) as (server, address):
        params, sharing = _train(address, shared_memory=True, copy=False, doorbells=False, before_close=no_pipes)
        assert sharing == "shared memory"
    with ps_over_tcp(shared_memory=True) as (server, address):
        rung, _ = _train(address, shared_memory=True, copy=False)
    np.testing.assert_array_equal(params, rung)


def test_a_ps_that_refuses_shared_memory_leaves_the_worker_on_frames() -> None:
    with ps_over_tcp(shared_memory=False) as (server, address):
        params, sharing = _train(address, shared_memory=True, copy=False)
        assert sharing == "frames" and not lent(server)
        assert server.stats.rejected == 0  # a refusal is not a rejected request
        assert server.store.version == 10
    assert np.isfinite(params).all()


def test_after_the_ps_lets_go_a_knock_fails_and_the_push_goes_whole_at_once() -> None:
    """The ps holds the only reader of a knock pipe it heard: letting go breaks the pipe, no push waits in it."""
    with ps_over_tcp(shared_memory=True) as (_, address):
        transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.2)))
        client = ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["127.0.0.1"]}), 0, FAST)
        try:
            client.initialize({"w": np.zeros(SIZE, np.float32)}, JobSpec(SyncSpec("async").resolved(1), 10, 1), SGD())
            client.push_pull()
            client.status()  # over the socket, after the answer to the offer (a ring may overtake that answer)
            assert client.endpoint.sharing(0) == "shared memory, doorbell and knocks"
            client.finish({})  # the ps lets what the worker lent go
            started = time.monotonic()
            with contextlib.suppress(RemoteError):  # a finished worker's push: whatever the ps answers, at once
                client.push_pull()
            assert time.monotonic() - started < FAST.transport.request_timeout_s / 2
            assert client.endpoint.sharing(0) == "frames"
        finally:
            client.close()
            transport.close()


class CapturingEndpoint(ServerEndpoint):
    """Collects the ps's replies, so a test can drive its handlers one request at a time."""

    address = "capture"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []
        self.forgotten: list[bytes] = []

    def receive(self, timeout_s: float) -> Incoming | None:
        return None

    def reply(self, peer: bytes, message: Message) -> bool:
        self.sent.append((peer, message))
        return True

    def forget(self, peer: bytes) -> None:
        self.forgotten.append(peer)

    def close(self) -> None:
        pass


def test_the_ps_tells_its_endpoint_to_let_go_of_a_finished_worker() -> None:
    endpoint = CapturingEndpoint()
    server = ParameterServer(endpoint, 0)
    job = JobSpec(SyncSpec("async").resolved(1), 10, 1).to_json()
    init = Message(
        "init", {"worker": 0, "job": job, "rule": SGD(lr=0.1).to_json(), "names": ["w"]}, [np.ones(SIZE, np.float32)]
    )
    server.handle(Incoming(b"w", init))
    assert endpoint.forgotten == []
    server.handle(Incoming(b"w", Message("finish", {"worker": 0}, rid=4)))
    assert endpoint.forgotten == [b"w"]
