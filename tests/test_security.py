"""CURVE: only the job's workers get in, each only as itself, and refusals are logged."""

from __future__ import annotations

import logging
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from psdk import security
from psdk.client import ClientOptions, ParameterClient
from psdk.cluster import ClusterSpec
from psdk.consistency import SyncSpec
from psdk.errors import ConfigError, PeerTimeoutError
from psdk.jobspec import JobSpec
from psdk.optim import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.wire import Message
from psdk.zmq_transport import ZmqOptions, ZmqTransport

QUICK = ClientOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, request_timeout_s=2.0, init_timeout_s=2.0)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return security.generate(tmp_path / "keys", 2)


def test_keys_are_made_with_private_secrets(keys: Path) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for secret in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    server = security.load_server(keys)
    assert sorted(server.allowed.values()) == ["worker-0", "worker-1"]
    worker = security.load_worker(keys, 1)
    assert worker.server_public == server.public and worker.public in server.allowed
    with pytest.raises(ConfigError, match="worker-5"):
        security.load_worker(keys, 5)


def test_secure_is_on_by_default_only_across_hosts() -> None:
    local = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["localhost", "127.0.0.2"]})
    spread = ClusterSpec({"ps": ["10.0.0.1:1"], "worker": ["10.0.0.2", "10.0.0.3"]})
    assert not security.secure_by_default(local) and security.secure_by_default(spread)
    with pytest.raises(ConfigError) as info:
        security.is_secure(None, None, spread)
    assert "python -m psdk keys" in str(info.value) and "transport.secure=false" in str(info.value)
    assert security.is_secure(False, None, spread) is False


@contextmanager
def secure_ps(keys: Path) -> Iterator[tuple[ParameterServer, str]]:
    transport = ZmqTransport(ZmqOptions(curve=security.load_server(keys)))
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    server = ParameterServer(endpoint, 0, ServerOptions(poll_s=0.02))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server, endpoint.address.split("://", 1)[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        transport.close()


def client(address: str, task: int, curve: security.CurveKeys | None) -> tuple[ParameterClient, ZmqTransport]:
    transport = ZmqTransport(ZmqOptions(curve=curve))
    cluster = ClusterSpec({"ps": [address], "worker": ["localhost", "localhost"]})
    return ParameterClient(transport, cluster, task, QUICK), transport


INIT = {"w": np.zeros(4, np.float32)}


def test_the_workers_keys_get_in_and_train(keys: Path) -> None:
    with secure_ps(keys) as (server, address):
        chief, t0 = client(address, 0, security.load_worker(keys, 0))
        other, t1 = client(address, 1, security.load_worker(keys, 1))
        try:
            chief.initialize(INIT, JobSpec(SyncSpec("async").resolved(2), 10, 2), SGD(lr=1.0))
            other.wait_initialized()
            other.pull()
            assert other.push_pull({"w": np.ones(4, np.float32)}).global_step == 1
            assert server.stats.applied == 1
        finally:
            for c, t in ((chief, t0), (other, t1)):
                c.close()
                t.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_unknown_key_is_refused_logged_and_never_reaches_the_store(
    keys: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stranger_keys = security.generate(tmp_path / "stranger", 1)
    stranger = security.load_worker(stranger_keys, 0)
    stranger = security.CurveKeys(stranger.public, stranger.secret, server_public=security.load_server(keys).public)
    with secure_ps(keys) as (server, address), caplog.at_level(logging.WARNING, logger="psdk.security"):
        intruder, transport = client(address, 0, stranger)
        try:
            with pytest.raises(PeerTimeoutError):
                intruder.initialize(INIT, JobSpec(SyncSpec("async").resolved(2), 10, 2), SGD(lr=1.0))
        finally:
            intruder.close()
            transport.close()
        plain, transport = client(address, 0, None)  # no encryption at all
        try:
            with pytest.raises(PeerTimeoutError):
                plain.wait_initialized()
        finally:
            plain.close()
            transport.close()
        # Refused connections must not leave a heartbeat thread stuck on a closed socket.
        assert not any(c.heartbeat is not None and c.heartbeat.is_alive() for c in (intruder, plain))
        assert not server.store.initialized and server.stats.rejected == 0
    assert any("refused a connection with an unknown CURVE key" in r.message for r in caplog.records)


def test_a_workers_key_cannot_speak_for_another_worker(keys: Path) -> None:
    with secure_ps(keys) as (server, address):
        chief, t0 = client(address, 0, security.load_worker(keys, 0))
        try:
            chief.initialize(INIT, JobSpec(SyncSpec("async").resolved(2), 10, 2), SGD(lr=1.0))
            before = server.store.digest()
            # Worker 1's key, claiming to be the chief.
            impostor = ZmqTransport(ZmqOptions(curve=security.load_worker(keys, 1)))
            endpoint = impostor.connect([address], ["ps 0"])
            try:
                reply = endpoint.request(0, Message("shutdown", {"worker": 0}), 5.0, "shutdown")
            finally:
                endpoint.close()
                impostor.close()
            assert reply.op == "error" and "cannot speak for worker 0" in reply.fields["error"]
            assert server.store.digest() == before and server.exit_code is None
        finally:
            chief.close()
            t0.close()


def test_a_secure_ps_names_a_missing_key_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="python -m psdk keys"):
        security.load_server(tmp_path / "nothing")


def test_the_keys_command_makes_a_usable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from psdk.cli import main

    assert main(["keys", f"keys_dir={tmp_path / 'k'}", "workers=3"]) == 0
    assert "transport.keys_dir=" in capsys.readouterr().out
    assert len(security.load_server(tmp_path / "k").allowed) == 3
    assert main(["keys", "workers=none"]) == 2
