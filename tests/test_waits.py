"""Waits that speak: what a wait is for, where, how long, and the likely cause, at least every 10 s.

Real sockets on 127.0.0.1 (ps threads of this process, and one worker
process), with the lines every fraction of a second (``PSDK_WAIT_LOG_S``)
except where the default itself is what is tested.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from psdk import protocol
from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import ConfigError, PeerTimeoutError, ProtocolError, PsdkError, RefusedError, TransportError
from psdk.launch import announce
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps import sessions
from psdk.ps.consistency import SyncSpec
from psdk.ps.membership import Membership
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.runtime import waits
from psdk.transport import security
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import REPO, free_port, running_ps
from .jobs import env

QUICK = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, request_timeout_s=5.0, init_timeout_s=2.0
    )
)
INIT = {"w": np.zeros(4, np.float32)}
JOB = JobSpec(SyncSpec("async").resolved(2), 10, 2)


@pytest.fixture
def lines_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(waits.LOG_EVERY_ENV, "0.3")


def cluster_of(address: str) -> ClusterSpec:
    return ClusterSpec({"ps": [address], "worker": ["localhost", "localhost"]})


@contextmanager
def ps_at(curve: security.CurveKeys | None) -> Iterator[str]:
    """A ps thread on a free TCP port, secure with ``curve`` (or not); yields its ``host:port``."""
    transport = ZmqTransport(ZmqOptions(curve=curve))
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    server = ParameterServer(endpoint, 0, ServerOptions(poll_s=0.02))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield endpoint.address.split("://", 1)[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        transport.close()


def test_a_wait_speaks_every_10_s_at_most() -> None:
    assert waits.LOG_EVERY_S <= 10.0
    clock = waits.WaitLog(every_s=2.0)
    assert clock.due(1.9) is None and clock.due(2.0) == 2.0 and clock.due(3.9) is None and clock.due(4.1) == 4.1


def test_a_shorter_interval_may_be_asked_for_never_a_longer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, every in (("0.5", 0.5), ("60", 10.0), ("-1", 10.0), ("soon", 10.0), ("", 10.0)):
        monkeypatch.setenv(waits.LOG_EVERY_ENV, raw)
        assert waits.log_every_s() == every


@pytest.mark.parametrize(
    ("connected", "silent_s", "kind"),
    [(True, 0.1, protocol.ID_IN_USE), (False, 0.1, protocol.ID_HELD), (True, 3.0, protocol.ID_HELD)],
)
def test_the_ps_says_by_kind_whether_an_index_is_in_use_or_held(connected: bool, silent_s: float, kind: str) -> None:
    """A worker gives up or retries on the refusal's kind (psdk.client.waiting), never on its words."""
    membership = Membership(heartbeat_timeout_s=5.0, startup_timeout_s=60.0, now=0.0)
    held = sessions.Sessions("ps 0", membership, max_workers=2, connected=lambda peer: connected)
    membership.seen(1, 0.0)
    assert held.bind(1, b"old", 0.0) is None
    with pytest.raises(RefusedError) as refused:
        held.bind(1, b"new", silent_s)
    assert refused.value.kind == kind and kind in protocol.ERROR_KINDS
    assert not isinstance(refused.value, ProtocolError)  # nothing was malformed


@pytest.mark.timeout(60)
def test_a_worker_with_no_ps_says_within_12_s_that_nothing_listens_there(tmp_path: Path) -> None:
    """A real worker process, with the default interval: the line comes 10 s into the wait."""
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "psdk", "worker", f"--ps_hosts={address}", "--worker_hosts=localhost,localhost"]
    command += ["--task_index=1", "backend=numpy", "transport.secure=false", f"hydra.run.dir={tmp_path}"]
    child_env = {k: v for k, v in env().items() if k != waits.LOG_EVERY_ENV}
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                              cwd=REPO)  # fmt: skip
    lines: queue.Queue[tuple[float, str]] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put((time.monotonic(), line)) for line in worker.stdout or ()])
    reader.daemon = True
    reader.start()
    try:
        first, said = None, ""
        deadline = time.monotonic() + 50
        while "waiting for ps 0" not in said and time.monotonic() < deadline:
            at, said = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            first = first if first is not None else at
        assert "waiting for ps 0" in said, said
        assert first is not None and at - first < 12.5, f"{at - first:.1f} s after the worker's first line"
        assert f"waiting for ps 0 at {address} (the chief (worker 0) to initialise the variables)" in said
        assert "no reply for 10 s of 300 s; nothing is listening there" in said
    finally:
        worker.kill()
        worker.wait(timeout=10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("worker_keys, ps_keys, cause, ps_says", [
    (True, False, "a key mismatch: this task uses CURVE keys and the ps does not", None),
    # Which side reads the other's greeting first decides whether the worker is certain or can only guess.
    (False, True,
     ("a key mismatch: the ps wants CURVE keys (it runs with transport.secure=true) and this task has none",
      "a key mismatch, likely: the ps ended the ZeroMQ handshake; does it want CURVE keys"), None),
    ("other job", True, "a key mismatch: the ps ended the CURVE handshake; the ps public key this task holds is not",
     "ps 0: a CURVE handshake failed (a key mismatch: a task holding another job's ps key?)"),
    ("unknown", True, "a key mismatch: the ps does not know this task's key",
     "ps 0: refused a connection with an unknown CURVE key"),
])  # fmt: skip
def test_a_worker_whose_keys_do_not_match_the_ps_says_so(
    tmp_path: Path,
    lines_often: None,
    caplog: pytest.LogCaptureFixture,
    worker_keys: object,
    ps_keys: bool,
    cause: str | tuple[str, ...],
    ps_says: str | None,
) -> None:
    """The worker says so in its waiting line; the ps, as it refuses the connection, where it is certain to see
    the mismatch (a mechanism mismatch is seen by the side that reads the other's greeting first)."""
    keys = security.generate(tmp_path / "keys", 2)
    other = security.generate(tmp_path / "other", 2)
    ours, theirs = security.load_worker(keys, 0), security.load_worker(other, 0)
    unknown = dataclasses.replace(theirs, servers=ours.servers)  # the right ps key, a worker key it never saw
    curve = {True: ours, "other job": theirs, "unknown": unknown, False: None}[worker_keys]
    caplog.set_level(logging.INFO)
    with ps_at(security.load_server(keys) if ps_keys else None) as address:
        transport = ZmqTransport(ZmqOptions(curve=curve))
        chief = ParameterClient(transport, cluster_of(address), 0, QUICK)
        try:
            with pytest.raises(PeerTimeoutError) as timed_out:
                chief.initialize(INIT, JOB, SGD())
        finally:
            chief.close()
            transport.close()
    said = [r.getMessage() for r in caplog.records if "waiting for ps 0" in r.getMessage()]
    assert said and f"waiting for ps 0 at {address} (initialising the variables): no reply for" in said[0]
    assert any(c in said[-1] for c in ((cause,) if isinstance(cause, str) else cause)), said[-1]
    assert "(initialising the variables); a key mismatch" in str(timed_out.value)  # the error names it again
    assert ps_says is None or ps_says in caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records if "waiting for ps 0" in r.getMessage())


@pytest.mark.timeout(30)
def test_a_worker_waiting_for_the_chief_says_the_ps_is_up(lines_often: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with ps_at(None) as address:
        transport = ZmqTransport(ZmqOptions())
        worker = ParameterClient(transport, cluster_of(address), 1, QUICK)
        try:
            with pytest.raises(PeerTimeoutError):
                worker.wait_initialized()
        finally:
            worker.close()
            transport.close()
    said = [r.getMessage() for r in caplog.records if "waiting for ps 0" in r.getMessage()]
    assert said, caplog.text
    assert f"worker 1: waiting for ps 0 at {address} (the chief (worker 0) to initialise the variables)" in said[-1]
    assert "of 2.0 s; it answers heartbeats (the last" in said[-1]
    ps_said = [r.getMessage() for r in caplog.records if "for the chief (worker 0) to initialise" in r.getMessage()]
    assert ps_said and ps_said[-1].startswith(f"ps 0: waiting at tcp://{address} for the chief (worker 0)")
    assert "(transport.startup_timeout_s); connected: worker 1" in ps_said[-1]


@pytest.mark.timeout(30)
def test_a_second_worker_with_an_index_in_use_is_refused_at_once(caplog: pytest.LogCaptureFixture) -> None:
    with running_ps(1, scheme="tcp", heartbeat_timeout_s=5.0) as ps:
        cluster = ps.cluster(2)
        chief = ParameterClient(ps.transport, cluster, 0, QUICK)
        holder = ParameterClient(ps.transport, cluster, 1, QUICK)
        try:
            assert chief.initialize(INIT, JOB, SGD(lr=1.0))
            holder.wait_initialized()
            holder.pull()
            second = ParameterClient(ps.transport, cluster, 1, QUICK)
            started = time.monotonic()
            try:
                with pytest.raises(ConfigError) as refused:
                    second.wait_initialized()
            finally:
                second.close()
            assert time.monotonic() - started < 2.0
            message = str(refused.value)
            assert message.startswith("task_index: ps 0") and "worker index 1 is in use by a running process" in message
            assert "every worker needs its own task index" in message
            assert "retrying" not in caplog.text
            # The probe that told the holder alive did not disturb it.
            assert holder.push_pull({"w": np.ones(4, np.float32)}).global_step == 1
        finally:
            holder.close()
            chief.close()


@pytest.mark.timeout(30)
def test_a_restarted_worker_whose_old_connection_closed_still_gets_back_in(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with running_ps(1, scheme="tcp", heartbeat_timeout_s=1.0) as ps:
        cluster = ps.cluster(2)
        chief = ParameterClient(ps.transport, cluster, 0, QUICK)
        try:
            assert chief.initialize(INIT, JOB, SGD(lr=1.0))
            old = ParameterClient(ps.transport, cluster, 1, QUICK)
            old.wait_initialized()
            old.pull()
            old.close()  # its process died: the connection closes with it
            new = ParameterClient(ps.transport, cluster, 1, QUICK)
            try:
                new.wait_initialized()
                assert new.push_pull({"w": np.ones(4, np.float32)}).global_step == 1
            finally:
                new.close()
        finally:
            chief.close()
    assert "still holds this worker's old connection; retrying" in caplog.text
    assert "worker 1 is back on a new connection" in caplog.text


@pytest.mark.timeout(30)
def test_the_chief_waiting_for_a_worker_that_never_started_says_so(
    lines_often: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running_ps(1, scheme="tcp") as ps:
        chief = ParameterClient(ps.transport, ps.cluster(2), 0, QUICK)
        try:
            assert chief.initialize(INIT, JOB, SGD(lr=1.0))
            with pytest.raises(TransportError, match="waiting for worker"):
                chief.wait_for_workers(1.5)
        finally:
            chief.close()
    said = [r.getMessage() for r in caplog.records if "to finish:" in r.getMessage()]
    assert said, caplog.text
    assert said[0].startswith("worker 0: waiting for worker(s) 1 to finish: 0.3 s of 1.5 s (train.final_wait_s)")
    assert f"worker 1 has never reached ps 0 at {ps.addresses[0].split('://')[1]}" in said[0]


@pytest.mark.timeout(30)
def test_a_task_waiting_for_a_ps_address_says_which(
    tmp_path: Path, lines_often: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with pytest.raises(PsdkError, match="did not announce"):
        announce.wait_for(tmp_path, 1, 1.0)
    assert f"waiting for ps 0 to announce its address in {tmp_path}: 0.3 s of 1.0 s" in caplog.text
