"""A real ps and real workers over the in-process transport: the Transport interface is the boundary.

Nothing here is ZeroMQ: two :class:`ParameterServer` shards serve from
threads and two :class:`ParameterClient` workers (with their heartbeat
threads) train through :class:`~psdk.transport.inproc.InprocTransport`,
unchanged. The parameters after each step are checked against the update
rule's arithmetic, in sync and in async mode.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient, StepResult
from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.inproc import InprocHub, InprocServer, InprocTransport

pytestmark = pytest.mark.timeout(60)

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)
INIT = {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.float32)}
"""Two variables, so round-robin sharding puts one on each of the two shards."""


@contextmanager
def inproc_ps(num_ps: int = 2) -> Iterator[tuple[InprocTransport, ClusterSpec, list[ParameterServer]]]:
    """``num_ps`` ps threads on a private hub; stopped and joined afterwards, whatever happens."""
    transport = InprocTransport(InprocHub())
    stop = threading.Event()
    servers: list[ParameterServer] = []
    threads: list[threading.Thread] = []
    options = ServerOptions(transport=TransportOptions(heartbeat_timeout_s=5.0, startup_timeout_s=60), poll_s=0.02)
    try:
        for index in range(num_ps):
            endpoint = transport.serve("127.0.0.1:0", f"ps {index}")
            assert isinstance(endpoint, InprocServer)
            servers.append(ParameterServer(endpoint, index, options))
            threads.append(threading.Thread(target=servers[-1].serve, args=(stop,), daemon=True))
            threads[-1].start()
        addresses = [s.endpoint.address for s in servers]
        yield transport, ClusterSpec({"ps": addresses, "worker": ["localhost", "localhost"]}), servers
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        transport.close()
    assert not any(t.is_alive() for t in threads), "a ps did not stop"


@contextmanager
def workers(mode: str, lr: float) -> Iterator[tuple[list[ParameterClient], list[ParameterServer]]]:
    """Two workers of a job initialised by the chief, holding the initial parameters."""
    with inproc_ps() as (transport, cluster, servers):
        clients = [ParameterClient(transport, cluster, i, FAST) for i in range(2)]
        try:
            job = JobSpec(SyncSpec(mode).resolved(2), 100, 2)
            assert clients[0].initialize(INIT, job, SGD(lr=lr))
            clients[1].wait_initialized()
            for client in clients:
                client.pull()
            yield clients, servers
        finally:
            for client in clients:
                client.close()


def grads(value: float) -> dict[str, np.ndarray]:
    """Whole-number gradients: with rates 0.5 and 0.25 every parameter below is exact in float32 (no atol needed)."""
    return {"w": np.full((2, 3), value, np.float32), "b": np.full(3, value, np.float32)}


def test_the_variables_are_spread_over_both_shards() -> None:
    with workers("sync", 1.0) as (clients, servers):
        assert [len(s.specs) for s in clients[0].shards] == [1, 1]
        assert sorted(s.store.size for s in servers) == [3, 6]  # each ps holds one of them
        for client in clients:
            np.testing.assert_array_equal(client.params["w"], INIT["w"])
            np.testing.assert_array_equal(client.params["b"], INIT["b"])


def test_sync_steps_apply_the_mean_of_both_workers_gradients() -> None:
    lr = 0.5
    with workers("sync", lr) as (clients, servers), ThreadPoolExecutor(max_workers=2) as pool:
        w, b = INIT["w"].copy(), INIT["b"].copy()
        for step in range(1, 4):
            pushed = (float(step), 3.0 * step)
            futures = [pool.submit(c.push_pull, grads(g)) for c, g in zip(clients, pushed, strict=True)]
            results: list[StepResult] = [f.result(timeout=20) for f in futures]
            w -= lr * np.mean(pushed, dtype=np.float32)
            b -= lr * np.mean(pushed, dtype=np.float32)
            assert [r.global_step for r in results] == [step, step]
            for client in clients:
                np.testing.assert_allclose(client.params["w"], w, rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(client.params["b"], b, rtol=1e-6, atol=1e-6)
        stats = servers[0].stats.to_json()
        assert (stats["applied"], stats["updates"], stats["dropped"]) == (6, 3, 0)


def test_async_steps_apply_each_gradient_as_it_arrives() -> None:
    lr = 0.25
    with workers("async", lr) as (clients, servers):
        c0, c1 = clients
        assert c0.push_pull(grads(1.0)).global_step == 1
        np.testing.assert_allclose(c0.params["w"], -lr * 1.0)
        assert c0.push_pull(grads(2.0)).global_step == 2
        np.testing.assert_allclose(c0.params["b"], 1.0 - lr * 3.0)
        assert c1.push_pull(grads(4.0)).global_step == 3  # computed from version 0: stale by 2, still applied
        np.testing.assert_allclose(c1.params["w"], -lr * 7.0)
        np.testing.assert_allclose(c1.params["b"], 1.0 - lr * 7.0)
        assert c0.push_pull(grads(0.0)).global_step == 4
        np.testing.assert_allclose(c0.params["w"], -lr * 7.0)
        workers_stats = servers[0].stats.to_json()["workers"]
        assert workers_stats["0"]["pushed"] == 3 and workers_stats["1"]["pushed"] == 1
        assert workers_stats["1"]["staleness"] == {"2": 1}
