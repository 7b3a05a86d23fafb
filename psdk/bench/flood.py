"""A ps's peak memory under a flood, against the bound its settings give (``python -m psdk bench``'s ``flood``).

A real ps task (``python -m psdk ps``, its own process) serves a job the
bench process initialises as the chief: the MLP's 79,510 floats with
momentum (one slot), two workers. Then ``connections`` raw TCP peers flood
it for ``seconds``, each reconnecting whenever the ps shuts it out, in four
ways: messages of the largest size the job allows sent without end and
never read back, one message of 64 KiB frames that never ends, one message
of empty frames that never ends (libzmq's worst case: 64 bytes held per 2
bytes on the wire), and requests that each get a reply nobody reads. The
ps's VmHWM is read from ``/proc`` before and after, and the ps must still
answer the chief. docs/security.md derives the bound; :func:`bound`
computes it from the same settings.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psdk.bench.zmtp import RawZmtpPeer
from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.transport.wire import MAX_HEADER_BYTES
from psdk.transport.zeromq import FRAMING_SLACK_BYTES, REPLY_QUEUE_MESSAGES, ZmqOptions, ZmqTransport
from psdk.transport.zmq_guard import CHECK_EVERY_S

MiB = 1 << 20
SIZE = 79_510
WORKERS = 2
SLOTS = 1  # momentum
PATTERNS = ("largest-messages", "endless-64k-frames", "endless-empty-frames", "unread-replies")
ZMQ_BYTES_PER_WIRE_BYTE = 32
"""An empty frame is 2 bytes on the wire and a 64-byte structure in libzmq's queue."""
REPLY_BYTES = 1_200
"""The largest reply a peer can make a ps queue without a session: an error of at most 1,000 characters."""


@dataclass
class Bound:
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def bound(
    base: int,
    size: int,
    slots: int,
    workers: int,
    max_connections: int,
    intake_bytes_per_s: float,
    per_connection_overhead: int,
    pushes_in_flight: int = 2,
    check_period_s: float = CHECK_EVERY_S,
) -> Bound:
    """The ps's peak memory by docs/security.md, term by term, in bytes."""
    shard = 4 * size
    largest = (1 + slots) * shard + MAX_HEADER_BYTES
    held = largest + workers * (shard + MAX_HEADER_BYTES) + FRAMING_SLACK_BYTES
    overshoot = intake_bytes_per_s * check_period_s
    return Bound(
        {
            "base (an idle ps)": base,
            "store: parameters, slots, their backup, 3 scratch": shard * (2 * (1 + slots) + 3),
            "per worker: reply buffer, mapped memory, held pushes": workers * shard * (1 + 3 + pushes_in_flight),
            "the message being handled": largest,
            "libzmq's queues (guarded total + one check's intake, ×32)": int(
                ZMQ_BYTES_PER_WIRE_BYTE * (held + overshoot)
            ),
            "replies queued for peers that do not read": max_connections * REPLY_QUEUE_MESSAGES * REPLY_BYTES
            + (1 + slots) * shard,
            "connections (libzmq's buffers per connection)": max_connections * per_connection_overhead,
        }
    )


@dataclass
class FloodReport:
    connections: int
    seconds: float
    before_kb: int = 0
    peak_kb: int = 0
    base_kb: int = 0
    sent_bytes: int = 0
    reconnects: int = 0
    answered_after: bool = False
    bound: Bound = field(default_factory=lambda: Bound({}))
    intake_bytes_per_s: float = 0.0

    @property
    def within(self) -> bool:
        return self.peak_kb * 1024 <= self.bound.total and self.answered_after

    def lines(self) -> list[str]:
        lines = [
            f"{self.connections} connections flooded a ps for {self.seconds:.0f} s ({', '.join(PATTERNS)}): "
            f"{self.sent_bytes / MiB:,.0f} MiB sent, {self.reconnects} times shut out and back",
            f"ps VmHWM: {self.base_kb / 1024:.0f} MB idle, {self.before_kb / 1024:.0f} MB with the job initialised, "
            f"{self.peak_kb / 1024:.0f} MB after the flood; the ps still answered the chief: {self.answered_after}",
            f"bound: {self.bound.total / MiB:.0f} MiB (intake measured at {self.intake_bytes_per_s / MiB:,.0f} MiB/s):",
        ]
        lines += [f"  {value / MiB:8.1f} MiB  {name}" for name, value in self.bound.terms.items()]
        lines.append(
            f"peak / bound = {self.peak_kb * 1024 / max(self.bound.total, 1):.2f}: "
            + ("WITHIN THE BOUND" if self.within else "OVER THE BOUND")
        )
        return lines


def _vm(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flood(port: int, pattern: str, until: float, largest: int, report: FloodReport, lock: threading.Lock) -> None:
    frame = bytes(64 * 1024)
    push = json.dumps({"op": "push_pull", "rid": 1, "f": {}, "a": [["|u1", [largest - 200]]]}).encode()
    ping = json.dumps({"op": "ping", "rid": 1, "f": {}, "a": []}).encode()
    payload = bytes(largest - 200)
    sent = reconnects = 0
    while time.monotonic() < until:
        try:
            peer = RawZmtpPeer("127.0.0.1", port, timeout_s=2.0)
        except OSError:
            reconnects += 1
            continue
        try:
            peer.sock.settimeout(1.0)
            while time.monotonic() < until:
                if pattern == "largest-messages":
                    peer.send_message([push, payload])
                    sent += len(payload)
                elif pattern == "endless-64k-frames":
                    peer.send_frame(frame, more=True)
                    sent += len(frame)
                elif pattern == "endless-empty-frames":
                    peer.sock.sendall(b"\x01\x00" * 4096)
                    sent += 8192
                else:
                    peer.send_message([ping])
                    sent += len(ping)
        except OSError:
            reconnects += 1
        finally:
            peer.close()
    with lock:
        report.sent_bytes += sent
        report.reconnects += reconnects


def run(connections: int = 16, seconds: float = 10.0) -> FloodReport:
    """Start a ps task, initialise it, flood it, and read its peak memory against the bound."""
    report = FloodReport(connections, seconds)
    port = _free_port()
    hosts = ",".join(["127.0.0.1"] * WORKERS)
    with tempfile.TemporaryDirectory(prefix="psdk-flood-") as tmp:
        announce = Path(tmp) / "ps.json"
        command = [
            sys.executable, "-m", "psdk", "ps", "task_index=0", f"ps_hosts=127.0.0.1:{port}",
            f"worker_hosts={hosts}", "transport.secure=false", f"ps.announce_file={announce}",
            f"hydra.run.dir={tmp}/ps", "ps.idle_timeout_s=null",
        ]  # fmt: skip
        ps = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        transport = ZmqTransport(
            ZmqOptions(
                transport=TransportOptions(heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0, shared_memory=False)
            )
        )
        cluster = ClusterSpec({"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1"] * WORKERS})
        chief: ParameterClient | None = None
        try:
            deadline = time.monotonic() + 60
            while not announce.exists():
                if ps.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the ps did not start: {ps.stderr.read() if ps.stderr else ''}")
                time.sleep(0.05)
            report.base_kb = _vm(ps.pid, "VmHWM")
            options = ClientOptions(
                transport=TransportOptions(heartbeat_interval_s=1.0, heartbeat_timeout_s=60.0, request_timeout_s=60.0)
            )
            chief = ParameterClient(transport, cluster, 0, options)
            job = JobSpec(SyncSpec("async").resolved(WORKERS), 10**9, WORKERS)
            chief.initialize({"w": np.zeros(SIZE, np.float32)}, job, SGD(lr=0.01, momentum=0.9))
            chief.grads["w"][...] = 0.001
            chief.push_pull()
            report.before_kb = _vm(ps.pid, "VmHWM")
            largest = (1 + SLOTS) * 4 * SIZE + MAX_HEADER_BYTES
            lock = threading.Lock()
            until = time.monotonic() + seconds
            floods = [
                threading.Thread(target=_flood, args=(port, PATTERNS[i % len(PATTERNS)], until, largest, report, lock))
                for i in range(connections)
            ]
            for thread in floods:
                thread.start()
            for thread in floods:
                thread.join(timeout=seconds + 30)
            report.intake_bytes_per_s = report.sent_bytes / seconds
            report.peak_kb = _vm(ps.pid, "VmHWM")
            chief.grads["w"][...] = 0.001
            report.answered_after = chief.push_pull().outcome == "applied"
            chief.shutdown()
            ps.wait(timeout=30)
        finally:
            if chief is not None:
                chief.close()
            transport.close()
            if ps.poll() is None:
                ps.kill()
                ps.wait(timeout=10)
    report.bound = bound(
        base=report.base_kb * 1024,
        size=SIZE,
        slots=SLOTS,
        workers=WORKERS,
        max_connections=4 * WORKERS + 16,
        intake_bytes_per_s=report.intake_bytes_per_s,
        per_connection_overhead=PER_CONNECTION_BYTES,
    )
    return report


PER_CONNECTION_BYTES = 64 * 1024
"""libzmq's fixed cost of one connection: an 8 KiB input and output batch, the engine, session and pipes."""


def summary(report: FloodReport) -> dict[str, Any]:
    return {
        "lines": report.lines(),
        "within": report.within,
        "peak_kb": report.peak_kb,
        "bound_bytes": report.bound.total,
        "terms": report.bound.terms,
        "pid_env": os.getpid(),
    }
