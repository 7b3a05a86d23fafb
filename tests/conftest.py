"""Shared fixtures: the MNIST folder, in-process ps tasks over real ZeroMQ, free ports."""

from __future__ import annotations

import functools
import http.server
import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

REPO = Path(__file__).resolve().parent.parent
MNIST_DIR = Path(
    os.environ.get("PSDK_DATA_DIR") or os.environ.get("PSDK_TEST_DATA_DIR") or REPO.parent / "shared" / "data" / "mnist"
)  # the README's PSDK_DATA_DIR first; PSDK_TEST_DATA_DIR, the suites' old name, as an alias


@pytest.fixture(autouse=True)
def _root_log_handlers_restored() -> Iterator[None]:
    """A CLI command run in-process (``main(["fuzz", ...])``) calls ``basicConfig``, binding a handler to
    the stream pytest captured for that test; later tests' threads would log into it once it is closed."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def psdk_mnist_dir() -> Path:
    """psdk's pytest plugin's fixture, overridden with this suite's fallbacks (``PSDK_TEST_DATA_DIR``, ../shared)."""
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"MNIST is expected in {MNIST_DIR} (set PSDK_DATA_DIR; default: ../shared/data/mnist)")
    return MNIST_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PsCluster:
    """ps tasks running as threads of the test process, over real ZeroMQ sockets."""

    transport: ZmqTransport
    servers: list[ParameterServer]
    threads: list[threading.Thread]
    stop: threading.Event
    addresses: list[str]

    def cluster(self, num_workers: int) -> ClusterSpec:
        return ClusterSpec({"ps": self.addresses, "worker": ["127.0.0.1"] * num_workers})


@contextmanager
def running_ps(
    num_ps: int = 1,
    scheme: str = "inproc",
    heartbeat_timeout_s: float = 5.0,
    startup_timeout_s: float = 60.0,
    shared_memory: bool = True,
    pause_lease_s: float = 3.0,
    recovery: bool = False,
    recovery_timeout_s: float = 120.0,
) -> Iterator[PsCluster]:
    """Start ``num_ps`` ps threads; they are stopped and joined afterwards, whatever happens."""
    context = zmq.Context()
    settings = TransportOptions(  # one transport.* group for the sockets and the servers, as a ps task has
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=heartbeat_timeout_s,
        startup_timeout_s=startup_timeout_s,
        shared_memory=shared_memory,
    )
    transport = ZmqTransport(ZmqOptions(settings), context=context)
    stop = threading.Event()
    servers, threads, addresses = [], [], []
    options = ServerOptions(
        transport=settings,
        poll_s=0.02,
        pause_lease_s=pause_lease_s,
        recovery=recovery,
        recovery_timeout_s=recovery_timeout_s,
    )
    try:
        for index in range(num_ps):
            bind = f"inproc://ps{index}-{id(stop)}" if scheme == "inproc" else "127.0.0.1:0"
            endpoint = transport.serve(bind, f"ps {index}")
            addresses.append(endpoint.address)
            server = ParameterServer(endpoint, index, options)
            thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
            thread.start()
            servers.append(server)
            threads.append(thread)
        yield PsCluster(transport, servers, threads, stop, addresses)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        context.destroy(linger=0)


@pytest.fixture
def ps_cluster() -> Iterator[PsCluster]:
    with running_ps(1) as cluster:
        yield cluster


@pytest.fixture
def local_mirror(psdk_mnist_dir: Path) -> Iterator[str]:
    """An HTTP mirror of MNIST on a free local port, for downloads without the internet."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(psdk_mnist_dir))
    handler.log_message = lambda *a, **k: None  # type: ignore[assignment]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hydra_context() -> Iterator[None]:
    """psdk's config tree in Hydra's global state, as a task composes it; cleared after, whatever happened."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from psdk.config import config_dir, prepare_hydra

    prepare_hydra()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()
