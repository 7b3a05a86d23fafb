"""One ps task as a thread of the test process, over in-process ZeroMQ: nothing to hang on."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

_names = itertools.count()


@dataclass(frozen=True)
class RunningPs:
    transport: ZmqTransport
    """Pass it to :func:`psdk.connect` (``transport=``): ``inproc://`` needs the ps's context."""
    address: str

    def cluster(self, num_workers: int = 1) -> ClusterSpec:
        return ClusterSpec({"ps": [self.address], "worker": ["localhost"] * num_workers})


@contextmanager
def running_ps(heartbeat_timeout_s: float = 5.0) -> Iterator[RunningPs]:
    """A ps serving until the block ends, then stopped and joined whatever happened."""
    context = zmq.Context()
    settings = TransportOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=heartbeat_timeout_s, startup_timeout_s=60)
    transport = ZmqTransport(ZmqOptions(settings), context=context)
    stop = threading.Event()
    thread = None
    try:
        endpoint = transport.serve(f"inproc://psdk-testing-ps-{next(_names)}", "ps 0")
        server = ParameterServer(
            endpoint,
            0,
            ServerOptions(transport=settings, poll_s=0.02),
        )
        thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
        thread.start()
        yield RunningPs(transport, endpoint.address)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=10)
        context.destroy(linger=0)
