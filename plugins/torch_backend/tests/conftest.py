"""Fixtures of the torch plugin's tests (a pytest process of their own: no TensorFlow here)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqTransport

REPO = Path(__file__).resolve().parents[3]
MNIST_DIR = Path(os.environ.get("PSDK_TEST_DATA_DIR", REPO.parent / "shared" / "data" / "mnist"))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"MNIST is expected in {MNIST_DIR} (../shared/data/mnist beside the repo)")
    return MNIST_DIR


@pytest.fixture
def ps_thread() -> Iterator[tuple[ZmqTransport, str]]:
    """One ps task as a thread, over inproc ZeroMQ."""
    context = zmq.Context()
    transport = ZmqTransport(context=context)
    endpoint = transport.serve("inproc://torch-ps", "ps 0")
    server = ParameterServer(endpoint, 0, ServerOptions(poll_s=0.02))
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield transport, endpoint.address
    finally:
        stop.set()
        thread.join(timeout=10)
        context.destroy(linger=0)
