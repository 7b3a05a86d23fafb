"""Load test: many light clients pushing and pulling against one ps in sync mode.

Sixteen clients (threads, each with its own sockets and heartbeats, as many
workers would have) push gradients of a model's size as fast as the ps lets
them, with ``replicas_to_aggregate`` below the number of clients so that
some gradients are dropped as stale. After ``seconds`` the coordinator ends
the job at the next global step; every push is then answered. The books must
balance exactly: every gradient a client sent was applied, dropped or
answered "done", and the ps counts the same applied and dropped gradients.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport


@dataclass
class LoadReport:
    clients: int
    replicas: int
    size: int
    seconds: float = 0.0
    global_steps: int = 0
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    ps_applied: int = 0
    ps_dropped: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def balanced(self) -> bool:
        return (
            not self.errors
            and self.sent == sum(self.outcomes.values())
            and self.outcomes["applied"] == self.ps_applied
            and self.outcomes["dropped"] == self.ps_dropped
            and self.ps_applied == self.global_steps * self.replicas
        )

    def lines(self) -> list[str]:
        return [
            f"{self.clients} clients, replicas_to_aggregate={self.replicas}, {self.size:,} floats per gradient, "
            f"{self.seconds:.1f} s",
            f"sent {self.sent}: applied {self.outcomes['applied']}, dropped {self.outcomes['dropped']}, "
            f"answered done {self.outcomes['done']}; the ps applied {self.ps_applied} and dropped {self.ps_dropped} "
            f"in {self.global_steps} global steps",
            f"throughput {self.global_steps / max(self.seconds, 1e-9):.0f} global steps/s, "
            f"{self.sent / max(self.seconds, 1e-9):.0f} gradients/s, "
            f"{self.sent * self.size * 4 * 2 / max(self.seconds, 1e-9) / 1e6:.0f} MB/s through the ps",
            "BALANCED" if self.balanced else f"NOT BALANCED {self.errors}",
        ]


def run(clients: int = 16, replicas: int = 12, seconds: float = 5.0, size: int = 79_510) -> LoadReport:
    report = LoadReport(clients, replicas, size)
    transport = ZmqTransport(ZmqOptions(transport=TransportOptions(io_threads=2)))
    endpoint = transport.serve("127.0.0.1:0", "ps 0")
    address = endpoint.address.split("://", 1)[1]
    server = ParameterServer(
        endpoint, 0, ServerOptions(transport=TransportOptions(heartbeat_timeout_s=30.0), poll_s=0.02)
    )
    stop = threading.Event()
    serving = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    serving.start()
    cluster = ClusterSpec({"ps": [address], "worker": ["localhost"] * clients})
    options = ClientOptions(
        transport=TransportOptions(heartbeat_interval_s=0.5, heartbeat_timeout_s=30.0, request_timeout_s=60.0)
    )
    workers = [ParameterClient(transport, cluster, i, options) for i in range(clients)]
    lock = threading.Lock()
    try:
        job = JobSpec(SyncSpec("sync", replicas).resolved(clients), 10**12, clients)
        workers[0].initialize({"w": np.zeros(size, np.float32)}, job, SGD(lr=1e-6))
        for w in workers[1:]:
            w.wait_initialized()

        times_up = threading.Event()

        def push(client: ParameterClient) -> None:
            local: Counter[str] = Counter()
            sent = 0
            stopping = False
            try:
                client.pull()
                client.grads["w"][...] = 1.0
                while True:
                    if client.task_index == 0 and times_up.is_set() and not stopping:
                        client.stop_at(client.global_step + 1)  # the chief ends the job at the next step
                        stopping = True
                    sent += 1
                    result = client.push_pull()
                    local[result.outcome] += 1
                    if result.done:
                        break
            except Exception as exc:  # reported, and the books will not balance
                with lock:
                    report.errors.append(f"worker {client.task_index}: {exc}")
            with lock:
                report.sent += sent
                report.outcomes.update(local)

        threads = [threading.Thread(target=push, args=(w,), daemon=True) for w in workers]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)  # the measured window; the chief then ends the job at the next step
        times_up.set()
        for t in threads:
            t.join(timeout=60)
        report.seconds = time.monotonic() - started
        if any(t.is_alive() for t in threads):
            report.errors.append("a client did not finish")
        report.global_steps = server.store.version
        report.ps_applied, report.ps_dropped = server.stats.applied, server.stats.dropped
        return report
    finally:
        for w in workers:
            w.close()
        stop.set()
        serving.join(timeout=10)
        transport.close()


def summary(report: LoadReport) -> dict[str, Any]:
    return {
        "lines": report.lines(),
        "balanced": report.balanced,
        "global_steps": report.global_steps,
        "sent": report.sent,
        "outcomes": dict(report.outcomes),
        "seconds": report.seconds,
    }
