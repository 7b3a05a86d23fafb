"""Transport micro-benchmark: psdk's push-and-pull against raw pyzmq, same sizes, same machine.

Each round trip sends a gradient of ``size`` float32 and receives as many
parameters, between two processes over TCP loopback. Raw pyzmq is the floor
of what any Python parameter server can do here: a DEALER/ROUTER pair
exchanging zero-copy frames (reused, as a careful hand-written server would),
no headers to speak of, no checks, no update. psdk runs its real ps with the
no-op update rule, so what differs is psdk's own machinery. psdk runs twice:
as it runs by default on one host (arrays in shared memory, headers over
ZeroMQ: :mod:`psdk.transport.shm`) and with ``shared_memory=False``, every array in
ZeroMQ frames as between hosts. Besides round trips per second, each side's
CPU time per round trip is reported: it varies less than wall time on a busy
machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

STOP, STATS = b"stop", b"stats"


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _usage() -> dict[str, float]:
    from psdk.ps.server import process_usage

    return process_usage()


def _raw_server(size: int, queue: Any) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    queue.put(f"127.0.0.1:{port}")
    params = np.zeros(size, np.float32)
    frame = zmq.Frame(params)
    while True:
        parts = sock.recv_multipart(copy=False)
        if len(parts) == 2 and parts[1].bytes == STOP:
            break
        if len(parts) == 2 and parts[1].bytes == STATS:
            sock.send_multipart([parts[0], json.dumps(_usage()).encode()])
            continue
        grad = np.frombuffer(parts[2].buffer, np.float32)
        assert grad.size == size
        sock.send_multipart([parts[0], b"h", frame], copy=False)
    context.destroy(linger=0)


def _psdk_server(size: int, queue: Any, keys: str | None = None, shared_memory: bool = True) -> None:
    from psdk.config.options import TransportOptions
    from psdk.ps.server import ParameterServer
    from psdk.transport import security
    from psdk.transport.zeromq import ZmqOptions, ZmqTransport

    curve = security.load_server(Path(keys)) if keys else None
    transport = ZmqTransport(ZmqOptions(TransportOptions(shared_memory=shared_memory), curve=curve))
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    queue.put(endpoint.address.split("://", 1)[1])
    ParameterServer(endpoint, 0).serve()
    transport.close()


@dataclass
class RoundTrips:
    kind: str
    size: int
    round_trips_per_s: float
    client_cpu_us: float
    server_cpu_us: float
    server_max_rss_mb: float

    @property
    def megabytes_per_s(self) -> float:
        return 2 * self.size * 4 * self.round_trips_per_s / 1e6


def _raw_client(address: str, size: int, count: int, warmup: int) -> tuple[float, float, float, float]:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://{address}")
    grad = np.ones(size, np.float32)
    frame = zmq.Frame(grad)

    def server_usage() -> dict[str, float]:
        sock.send(STATS)
        return dict(json.loads(sock.recv()))

    def step() -> None:
        sock.send_multipart([b"h", frame], copy=False)
        parts = sock.recv_multipart(copy=False)
        np.frombuffer(parts[1].buffer, np.float32)

    for _ in range(warmup):
        step()
    s0, c0, t0 = server_usage(), _cpu_s(), time.perf_counter()
    for _ in range(count):
        step()
    elapsed, client = time.perf_counter() - t0, _cpu_s() - c0
    s1 = server_usage()
    sock.send(STOP)
    context.destroy(linger=0)
    return elapsed, client, s1["cpu_s"] - s0["cpu_s"], s1["max_rss_mb"]


def _psdk_client(
    address: str, size: int, count: int, warmup: int, keys: str | None = None, shared_memory: bool = True
) -> tuple[float, float, float, float]:
    from psdk.client import ParameterClient
    from psdk.config.options import TransportOptions
    from psdk.protocol.cluster import ClusterSpec
    from psdk.protocol.jobspec import JobSpec
    from psdk.ps.consistency import SyncSpec
    from psdk.ps.rules import NoOp
    from psdk.transport import security
    from psdk.transport.zeromq import ZmqOptions, ZmqTransport

    curve = security.load_worker(Path(keys), 0) if keys else None
    transport = ZmqTransport(ZmqOptions(TransportOptions(shared_memory=shared_memory), curve=curve))
    client = ParameterClient(transport, ClusterSpec({"ps": [address], "worker": ["localhost"]}), 0)
    try:
        job = JobSpec(SyncSpec("async").resolved(1), 10**12, 1)
        client.initialize({"w": np.zeros(size, np.float32)}, job, NoOp())
        client.pull()
        client.status()  # a reply over the socket: the ps's answer to the offer of memory, sent before, is in
        if (client.endpoint.sharing(0) != "frames") != shared_memory:
            raise RuntimeError(f"asked for shared_memory={shared_memory}, the ps and worker settled otherwise")
        client.grads["w"][...] = 1.0
        for _ in range(warmup):
            client.push_pull()

        def server_usage() -> dict[str, float]:
            return dict(client.stats()[0]["process"])

        s0, c0, t0 = server_usage(), _cpu_s(), time.perf_counter()
        for _ in range(count):
            client.push_pull()
        elapsed, cpu = time.perf_counter() - t0, _cpu_s() - c0
        s1 = server_usage()
        client.shutdown()  # the ps exits quietly (an abort would log an error per measurement)
    finally:
        client.close()
        transport.close()
    return elapsed, cpu, s1["cpu_s"] - s0["cpu_s"], s1["max_rss_mb"]


KINDS = ("raw", "psdk", "psdk-frames")


def measure(kind: str, size: int, count: int, warmup: int = 50, keys: str | None = None) -> RoundTrips:
    """Round trips of ``size`` floats with ``kind`` (one of :data:`KINDS`), server in its own process.

    ``psdk`` is psdk as it runs on one host (shared memory), ``psdk-frames``
    with every array in ZeroMQ frames. ``keys`` (a folder from
    :func:`psdk.transport.security.generate`) turns CURVE on for psdk.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (one of {KINDS})")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    shared = kind == "psdk"
    if kind == "raw":
        server = ctx.Process(target=_raw_server, args=(size, queue), daemon=True)
    else:
        server = ctx.Process(target=_psdk_server, args=(size, queue, keys, shared), daemon=True)
    server.start()
    try:
        address = queue.get(timeout=60)
        if kind == "raw":
            elapsed, client_cpu, server_cpu, server_rss = _raw_client(address, size, count, warmup)
        else:
            elapsed, client_cpu, server_cpu, server_rss = _psdk_client(address, size, count, warmup, keys, shared)
    finally:
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    return RoundTrips(kind, size, count / elapsed, client_cpu / count * 1e6, server_cpu / count * 1e6, server_rss)


def compare(size: int, count: int, reps: int) -> dict[str, Any]:
    """Raw, psdk and psdk over frames alternated ``reps`` times; medians and each psdk's ratio to raw."""
    runs: dict[str, list[RoundTrips]] = {kind: [] for kind in KINDS}
    for _ in range(reps):
        for kind in KINDS:
            runs[kind].append(measure(kind, size, count))

    def median(kind: str, field: str) -> float:
        return float(np.median([getattr(r, field) for r in runs[kind]]))

    out: dict[str, Any] = {"size": size, "mbytes": size * 4 / 1e6, "reps": reps, "count": count}
    for kind in runs:
        out[kind] = {
            "round_trips_per_s": median(kind, "round_trips_per_s"),
            "megabytes_per_s": median(kind, "megabytes_per_s"),
            "client_cpu_us": median(kind, "client_cpu_us"),
            "server_cpu_us": median(kind, "server_cpu_us"),
            "server_max_rss_mb": median(kind, "server_max_rss_mb"),
        }
    out["ratio"] = out["psdk"]["round_trips_per_s"] / out["raw"]["round_trips_per_s"]
    out["ratio_frames"] = out["psdk-frames"]["round_trips_per_s"] / out["raw"]["round_trips_per_s"]
    return out


def curve_cost(size: int, count: int, reps: int) -> dict[str, Any]:
    """psdk's push-and-pull with CURVE off and on, alternated ``reps`` times, on one host (shared memory) and over
    frames; medians of round trips/s and of CPU per round trip (client + server), and CURVE's ratio to off."""
    from psdk.transport import security

    out: dict[str, Any] = {"size": size, "reps": reps, "count": count}
    with tempfile.TemporaryDirectory(prefix="psdk-keys-") as tmp:
        keys = str(security.generate(Path(tmp) / "keys", 1))
        for kind in ("psdk", "psdk-frames"):
            off: list[RoundTrips] = []
            on: list[RoundTrips] = []
            for _ in range(reps):
                off.append(measure(kind, size, count))
                on.append(measure(kind, size, count, keys=keys))
            sides: dict[str, Any] = {}
            for label, runs in (("off", off), ("on", on)):
                sides[label] = {
                    "round_trips_per_s": float(np.median([r.round_trips_per_s for r in runs])),
                    "cpu_us": float(np.median([r.client_cpu_us + r.server_cpu_us for r in runs])),
                }
            sides["rate_ratio"] = sides["on"]["round_trips_per_s"] / sides["off"]["round_trips_per_s"]
            sides["cpu_ratio"] = sides["on"]["cpu_us"] / sides["off"]["cpu_us"]
            out[kind] = sides
    return out
