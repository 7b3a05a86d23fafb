"""CURVE: only the job's workers get in, each only as itself, and refusals are logged."""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import ConfigError, PeerTimeoutError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport import security
from psdk.transport.wire import Message
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

QUICK = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, request_timeout_s=2.0, init_timeout_s=2.0
    )
)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return security.generate(tmp_path / "keys", 2)


def test_keys_are_made_with_private_secrets_one_pair_per_task(tmp_path: Path) -> None:
    keys = security.generate(tmp_path / "keys", 2, num_ps=2)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for secret in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    servers = [security.load_server(keys, j) for j in range(2)]
    assert servers[0].public != servers[1].public  # each ps task has its own
    assert sorted(servers[0].allowed.values()) == ["worker-0", "worker-1"]
    worker = security.load_worker(keys, 1, num_ps=2)
    assert worker.servers == (servers[0].public, servers[1].public) and worker.public in servers[0].allowed
    with pytest.raises(ConfigError, match="worker-5"):
        security.load_worker(keys, 5)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o666])
def test_a_secret_key_others_can_read_is_refused_naming_the_file_and_the_fix(keys: Path, mode: int) -> None:
    secret = keys / "workers" / "worker-1.key_secret"
    secret.chmod(mode)
    with pytest.raises(ConfigError) as info:
        security.load_worker(keys, 1)
    assert str(secret) in str(info.value) and f"chmod 600 {secret}" in str(info.value)
    (keys / "ps" / "ps-0.key_secret").chmod(mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_server(keys)
    secret.chmod(0o600)
    assert security.load_worker(keys, 1).public


def test_existing_keys_are_never_overwritten_unless_asked(keys: Path) -> None:
    before = (keys / "workers" / "worker-0.key_secret").read_bytes()
    with pytest.raises(ConfigError, match="overwrite=true"):
        security.generate(keys, 2)
    assert (keys / "workers" / "worker-0.key_secret").read_bytes() == before
    security.generate(keys, 3, overwrite=True)
    assert (keys / "workers" / "worker-0.key_secret").read_bytes() != before
    assert len(security.load_server(keys).allowed) == 3


def test_every_task_needs_keys_unless_told_secure_false() -> None:
    """Nothing is decided from host names: one host or many, CURVE is on."""
    for secure in (None, True):
        with pytest.raises(ConfigError) as info:
            security.require_keys(secure, None)
        assert "python -m psdk keys" in str(info.value) and "transport.secure=false" in str(info.value)
    assert security.require_keys(True, "keys") is True
    assert security.require_keys(False, None) is False


def test_each_task_needs_only_its_own_secret() -> None:
    assert security.files_for("ps", 1) == ["ps/ps-1.key_secret", "workers/*.key"]
    assert security.files_for("worker", 2) == ["workers/worker-2.key_secret", "ps/*.key"]


def test_unknown_keys_cost_a_bounded_table_and_rate_limited_lines(caplog: pytest.LogCaptureFixture) -> None:
    ring = security.KeyRing({b"known": "worker-0"}, "ps 0")
    with caplog.at_level(logging.WARNING, logger="psdk.transport.security"):
        for i in range(5000):
            assert not ring.callback("*", b"stranger-%05d" % i)
    assert ring.refused == 5000 and len(ring._logged) <= security.REMEMBERED_DENIALS
    assert len([r for r in caplog.records if "unknown CURVE key" in r.message]) <= 20
    assert ring.callback("*", b"known")


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
    """A worker's client, with ``curve`` keys (or none)."""
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
    stranger = security.CurveKeys(stranger.public, stranger.secret, servers=(security.load_server(keys).public,))
    with secure_ps(keys) as (server, address), caplog.at_level(logging.WARNING, logger="psdk.transport.security"):
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
    from psdk.launch.cli import main

    assert main(["keys", f"keys_dir={tmp_path / 'k'}", "workers=3", "ps=2"]) == 0
    assert "transport.keys_dir=" in capsys.readouterr().out
    assert len(security.load_server(tmp_path / "k", 1).allowed) == 3
    assert main(["keys", "workers=none"]) == 2
    assert main(["keys", f"keys_dir={tmp_path / 'k'}", "workers=3"]) == 2  # there already: kept
    assert "overwrite=true" in capsys.readouterr().err


def test_without_curve_the_first_to_claim_an_id_gets_it() -> None:
    """What transport.secure=false exposes (docs/security.md): a stranger who speaks first is the chief."""
    transport = ZmqTransport(ZmqOptions())
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    server = ParameterServer(endpoint, 0, ServerOptions(poll_s=0.02))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    address = endpoint.address.split("://", 1)[1]
    try:
        stranger, t0 = client(address, 0, None)
        try:
            stranger.initialize(
                {"w": np.full(4, 7.0, np.float32)}, JobSpec(SyncSpec("async").resolved(2), 10, 2), SGD()
            )
            assert float(server.store.params()[0]) == 7.0  # the stranger's weights
        finally:
            stranger.close()
            t0.close()
        chief = transport.connect([address], ["ps 0"])  # the real chief, on a connection of its own
        try:
            init = Message("init", {"worker": 0, "job": {}, "names": []})
            reply = chief.request(0, init, 5.0, "init")
            assert reply.op == "error" and "already connected from another session" in reply.fields["error"]
        finally:
            chief.close()
    finally:
        stop.set()
        thread.join(timeout=10)
        transport.close()


def test_the_public_api_takes_the_keys_as_the_tasks_do(keys: Path) -> None:
    import psdk

    cluster = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["localhost", "localhost"]})
    with pytest.raises(ConfigError, match=r"psdk\.connect needs the job.s keys"):
        psdk.connect(cluster, 0, steps=10)
    with secure_ps(keys) as (server, address):
        cluster = ClusterSpec({"ps": [address], "worker": ["localhost", "localhost"]})
        session = psdk.connect(cluster, 0, steps=10, keys=keys, options=QUICK)
        try:
            session.client.initialize(INIT, JobSpec(SyncSpec("async").resolved(2), 10, 2), SGD(lr=1.0))
            assert server.store.initialized and session.is_chief
        finally:
            session.close()


def test_the_keys_command_never_changes_the_mode_of_a_folder_it_did_not_make(tmp_path: Path) -> None:
    from psdk.launch.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: others can write, but not replace what is this user's
    assert main(["keys", f"keys_dir={shared}", "workers=2"]) == 0
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "workers").stat().st_mode) == 0o700
    assert len(security.load_server(shared).allowed) == 2
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)  # no sticky bit: anyone could swap the key folders inside it
    assert main(["keys", f"keys_dir={open_to_all}", "workers=2"]) == 2
    assert stat.S_IMODE(open_to_all.stat().st_mode) == 0o777 and not list(open_to_all.iterdir())


def test_a_key_folder_others_can_write_is_refused_naming_it(keys: Path) -> None:
    """The ps takes a worker's identity from its key file's name: a writable workers/ lets anyone be the chief."""
    (keys / "workers").chmod(0o777)
    with pytest.raises(ConfigError, match=rf"{keys / 'workers'} can be written by its group and other users"):
        security.load_server(keys)
    (keys / "workers").chmod(0o700)
    keys.chmod(0o770)
    with pytest.raises(ConfigError, match=rf"{keys} can be written by its group \(mode 0770\); refusing the key"):
        security.load_worker(keys, 0)
    keys.chmod(0o700)
    (keys / "ps" / "ps-0.key").chmod(0o646)
    with pytest.raises(ConfigError, match=r"ps-0\.key can be written by other users"):
        security.load_worker(keys, 0)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused_naming_it(keys: Path) -> None:
    swapped = keys / "workers" / "worker-0.key"
    os.chown(swapped, 65534, 65534)
    with pytest.raises(ConfigError, match=rf"{swapped} belongs to another user \(uid 65534\)"):
        security.load_server(keys)
