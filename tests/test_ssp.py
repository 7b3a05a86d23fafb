"""Bounded staleness: with one slow worker, no worker runs more than s iterations ahead."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD

from .conftest import running_ps

OPTIONS = ClientOptions(
    transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0, request_timeout_s=30.0)
)
STALENESS, STEPS, SLOW_S = 2, 60, 0.01


def race(mode: str) -> list[tuple[int, int]]:
    """Three workers, worker 2 slowed down; (iteration started, slowest finished) at every start."""
    starts: list[tuple[int, int]] = []
    lock = threading.Lock()
    with running_ps(1) as ps:
        cluster = ps.cluster(3)
        clients = [ParameterClient(ps.transport, cluster, i, OPTIONS) for i in range(3)]
        try:
            job = JobSpec(SyncSpec(mode, staleness=STALENESS).resolved(3), 10**6, 3)
            clients[0].initialize({"w": np.zeros(16, np.float32)}, job, SGD(lr=0.1))
            for c in clients[1:]:
                c.wait_initialized()

            def work(client: ParameterClient) -> None:
                client.pull()
                for iteration in range(1, STEPS + 1):
                    if client.task_index == 2:
                        time.sleep(SLOW_S)  # the artificially slow worker
                    result = client.push_pull({"w": np.ones(16, np.float32)})
                    assert result.slowest is not None
                    with lock:
                        starts.append((iteration + 1, result.slowest))
                client.finish({})

            threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads)
        finally:
            for c in clients:
                c.close()
    return starts


def test_ssp_keeps_every_worker_within_s_iterations_of_the_slowest() -> None:
    starts = race("ssp")
    assert len(starts) == 3 * STEPS
    # Starting iteration c needs every live worker to have finished c - s - 1.
    assert all(slowest >= c - STALENESS - 1 for c, slowest in starts)


def test_the_same_race_in_async_mode_breaks_the_bound() -> None:
    starts = race("async")
    assert max(c - 1 - slowest for c, slowest in starts) > STALENESS + 1


def test_ssp_is_a_sync_option_with_the_same_keys() -> None:
    assert SyncSpec("ssp", staleness=3).resolved(4) == SyncSpec("ssp", 4, 3)
    with pytest.raises(Exception, match=r"sync\.staleness"):
        SyncSpec("ssp", staleness=-1)
