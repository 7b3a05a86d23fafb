"""A push-and-pull that times out: a shard that lost its state is restored, a slow one is only waited for."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import PortInUseError, PsdkError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import PsCluster, free_port, running_ps
from .test_server import FAST, INIT, grads, in_thread, wait_until

# A request timeout of one second stands for the default 300 s; heartbeats are answered throughout.
SHORT = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0, request_timeout_s=1.0, init_timeout_s=20.0
    ),
    recovery_timeout_s=20.0,
)


def chief_and_worker(ps: PsCluster, worker_options: ClientOptions) -> tuple[ParameterClient, ParameterClient]:
    """An async job of two: the chief with the usual options, worker 1 with ``worker_options``."""
    cluster = ps.cluster(2)
    chief = ParameterClient(ps.transport, cluster, 0, FAST)
    worker = ParameterClient(ps.transport, cluster, 1, worker_options)
    assert chief.initialize(INIT, JobSpec(SyncSpec("async").resolved(2), 100, 2), SGD(lr=1.0))
    worker.wait_initialized()
    chief.pull()
    worker.pull()
    return chief, worker


def test_a_timeout_from_a_slow_shard_is_waited_out_without_a_rollback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=60.0) as ps:
        chief, worker = chief_and_worker(ps, SHORT)
        try:
            version = int(chief.status()["version"])
            chief.request(chief.to_all("pause_at", version=version), "a pause")  # the shard holds every push
            push = in_thread(lambda: worker.push_pull(grads(1.0)))
            wait_until(lambda: "slow, not lost, so nothing is rolled back" in caplog.text, timeout=20)
            chief.request(chief.to_all("resume"), "resuming")
            result = push.result(timeout=20)
            assert result.global_step == version + 1 and result.outcome != "resync"
            assert worker.recoveries == []  # no rollback
        finally:
            worker.close()
            chief.close()


def test_a_shard_slow_beyond_the_recovery_timeout_is_named_in_a_clear_error() -> None:
    with running_ps(1, heartbeat_timeout_s=30.0, pause_lease_s=60.0) as ps:
        chief, worker = chief_and_worker(ps, dataclasses.replace(SHORT, recovery_timeout_s=1.0))
        try:
            version = int(chief.status()["version"])
            chief.request(chief.to_all("pause_at", version=version), "a pause")
            with pytest.raises(PsdkError) as caught:
                worker.push_pull(grads(1.0))
            text = str(caught.value)
            assert f"ps 0 ({ps.addresses[0]}) (version {version}) did not answer worker 1's push-and-pull" in text
            assert "overloaded or stuck" in text and "nothing was rolled back" in text
            assert worker.recoveries == []
        finally:
            chief.request(chief.to_all("resume"), "resuming")
            worker.close()
            chief.close()


@contextmanager
def ps_thread(transport: ZmqTransport, port: int) -> Iterator[ParameterServer]:
    options = ServerOptions(
        transport=TransportOptions(heartbeat_timeout_s=30.0, startup_timeout_s=60.0), poll_s=0.02, recovery=True
    )
    deadline = time.monotonic() + 20.0
    while True:  # the ps this one replaces closed its socket; ZeroMQ's I/O thread lets go of the port a moment later
        try:
            endpoint = transport.serve(f"127.0.0.1:{port}", "ps 0")
            break
        except PortInUseError:
            assert time.monotonic() < deadline, f"port {port} still in use 20 s after its ps stopped"
            time.sleep(0.05)
    server = ParameterServer(endpoint, 0, options)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_timeout_from_a_shard_that_lost_its_state_restores_it(caplog: pytest.LogCaptureFixture) -> None:
    """The ps is replaced by an empty one while it holds the chief's push, and no heartbeat says so."""
    caplog.set_level(logging.WARNING)
    context = zmq.Context()
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0)), context=context
    )
    port = free_port()
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1"] * 2})
    try:
        with ps_thread(transport, port) as first:
            chief = ParameterClient(transport, cluster, 0, SHORT, heartbeat=False)
            assert chief.initialize(INIT, JobSpec(SyncSpec("sync").resolved(2), 100, 2), SGD(lr=1.0))
            chief.pull()
            push = in_thread(lambda: chief.push_pull(grads(1.0)))  # a sync round: held until worker 1 pushes
            wait_until(lambda: first.policy is not None and len(first.policy.parked()) == 1)
        # The ps that held the push is gone; an empty one now serves at the same address.
        with ps_thread(transport, port) as second:
            result = push.result(timeout=30)
            assert result.outcome == "resync" and result.global_step == 0
            assert second.store.initialized and second.epoch == chief.epoch == 1
            assert "no longer holds this job's state" in caplog.text
            assert chief.recoveries and chief.recoveries[0]["lost_steps"] == 0
            chief.close()
    finally:
        context.destroy(linger=0)
