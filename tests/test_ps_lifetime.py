"""When the job ends every ps exits; a ps whose chief vanished exits after ``ps.idle_timeout_s``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zmq

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import REPO, free_port
from .jobs import env

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)
INIT = {"w": np.zeros((2, 3), np.float32)}


@dataclass
class Served:
    server: ParameterServer
    thread: threading.Thread
    transport: ZmqTransport
    result: list[int]

    def chief(self, num_workers: int = 1) -> ParameterClient:
        cluster = ClusterSpec({"ps": [self.server.endpoint.address], "worker": ["chief-host"] * num_workers})
        return ParameterClient(self.transport, cluster, 0, FAST)

    def wait_exit(self, timeout: float = 20.0) -> int:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the ps did not exit"
        return self.result[0]


@contextmanager
def serving(idle_timeout_s: float | None) -> Iterator[Served]:
    """One ps thread whose heartbeat timeout is far away, so that only the idle timeout can fire."""
    context = zmq.Context()
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0)), context=context
    )
    options = ServerOptions(
        transport=TransportOptions(heartbeat_timeout_s=30.0, startup_timeout_s=60.0),
        poll_s=0.02,
        idle_timeout_s=idle_timeout_s,
        chief_host="h0",
    )
    server = ParameterServer(transport.serve(f"inproc://ps-{id(context)}", "ps 0"), 0, options)
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(server.serve(stop)), daemon=True)
    thread.start()
    try:
        yield Served(server, thread, transport, result)
    finally:
        stop.set()
        thread.join(timeout=10)
        context.destroy(linger=0)


def start_job(chief: ParameterClient, steps: int) -> None:
    assert chief.initialize(INIT, JobSpec(SyncSpec("async").resolved(1), steps, 1), SGD(lr=0.1))
    chief.pull()


def test_a_chief_that_finished_and_vanished_before_the_end_fails_the_ps() -> None:
    with serving(idle_timeout_s=0.5) as ps:
        chief = ps.chief()
        start_job(chief, steps=100)
        chief.finish({})  # heartbeat deaths no longer watch a finished worker: only the idle timeout does
        chief.close()  # gone without a shutdown
        assert ps.wait_exit() == 1
        failure = ps.server.failure or ""
        assert "nothing heard from the chief (worker 0 at h0)" in failure and "ps.idle_timeout_s=0.5" in failure


def finished_job(ps: Served) -> ParameterClient:
    """A chief whose one-step job is done and who said it finished (it has not shut the job down)."""
    chief = ps.chief()
    start_job(chief, steps=1)
    assert chief.push_pull({"w": np.ones((2, 3), np.float32)}).done
    chief.finish({})
    return chief


def test_a_chief_lost_after_training_but_before_its_shutdown_fails_the_ps_naming_it() -> None:
    """The chief shuts the job down only once its results are written: without that, they may be lost."""
    with serving(idle_timeout_s=0.5) as ps:
        chief = finished_job(ps)
        chief.close()  # gone before writing its results
        assert ps.wait_exit() == 1
        failure = ps.server.failure or ""
        assert "the chief (worker 0 at h0) finished training" in failure
        assert "may not have been written" in failure and "ps.idle_timeout_s=0.5" in failure


def test_a_done_job_the_chief_shuts_down_ends_cleanly() -> None:
    with serving(idle_timeout_s=0.5) as ps:
        chief = finished_job(ps)
        chief.shutdown()
        chief.close()
        assert ps.wait_exit() == 0 and ps.server.failure is None


def test_a_quiet_chief_that_still_heartbeats_keeps_the_ps() -> None:
    # 20 heartbeats per idle timeout: a stalled thread on a busy machine does not make the chief look gone.
    with serving(idle_timeout_s=1.0) as ps:
        chief = ps.chief()
        start_job(chief, steps=100)
        chief.finish({})
        began = time.monotonic()
        # No request for several idle timeouts, but heartbeats keep coming: the ps stays.
        while time.monotonic() - began < 3 * 1.0:
            assert ps.thread.is_alive() and ps.server.exit_code is None
            time.sleep(0.02)
        silent = ps.server.membership.silent_for(0, time.monotonic())
        assert silent is not None and silent < 1.0
        chief.shutdown()
        chief.close()
        assert ps.wait_exit() == 0


def test_without_an_idle_timeout_only_the_heartbeat_rules_apply() -> None:
    with serving(idle_timeout_s=None) as ps:
        chief = ps.chief()
        start_job(chief, steps=100)
        chief.finish({})
        chief.close()
        # Silent for longer than any idle timeout above, on the ps's own clock: nothing may happen.
        while (ps.server.membership.silent_for(0, time.monotonic()) or 0.0) < 1.0:
            assert ps.thread.is_alive() and ps.server.exit_code is None
            time.sleep(0.02)
        assert ps.thread.is_alive() and ps.server.exit_code is None


@pytest.mark.slow
def test_a_ps_process_exits_after_its_idle_timeout_naming_the_chief(tmp_path: Path) -> None:
    port = free_port()
    ps = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psdk",
            "ps",
            f"ps_hosts=127.0.0.1:{port}",
            "worker_hosts=127.0.0.1",
            "ps.idle_timeout_s=1",
            "transport.heartbeat_timeout_s=60",
            "transport.secure=false",
            f"hydra.run.dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=REPO,
    )
    transport = ZmqTransport(ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.05)))
    try:
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1"]})
        chief = ParameterClient(transport, cluster, 0, FAST)
        start_job(chief, steps=100)
        chief.finish({})
        chief.close()
        output = ps.communicate(timeout=60)[0]
    finally:
        ps.kill()
        transport.close()
    assert ps.returncode == 1, output
    assert "nothing heard from the chief (worker 0 at 127.0.0.1) for" in output and "ps.idle_timeout_s=1" in output
