"""Single-message fuzzing: mutated copies of real messages from a stranger (the second stage of ``psdk fuzz``).

A session starts a ps and two real workers, records the messages they
really send (init, pulls, pushes, checkpoints, ...), then sends mutated
copies from a connection of its own, which is not one of the job's
registered workers: bad headers, wrong dtypes and shapes, missing, extra and
truncated frames, NaN and Inf, versions from the future, huge declared
sizes, frames over the size limit, replays. Whatever it sends, afterwards
the number of applied gradients and a hash of the store must be unchanged,
the ps must still be running, and a real worker must still train.
"""

from __future__ import annotations

import copy
import json
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from psdk import protocol
from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import ProtocolError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import Adam
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport import ClientEndpoint, Pending
from psdk.transport.wire import ALLOWED_DTYPES, Message, decode, encode
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

OPS = tuple(protocol.OPS)
"""Every op the protocol declares, so a new op is mutated here without editing this module."""
ODD_VALUES: list[Any] = [
    -1,
    0,
    1,
    2,
    7,
    2**31,
    2**63 - 1,
    10**30,
    -(10**30),
    1.5,
    math.nan,
    math.inf,
    True,
    False,
    None,
    "",
    "x" * 1000,
    "0",
    [],
    [1, 2],
    {},
    {"a": 1},
    "push_pull",
    "worker",
]
DTYPES = [*sorted(ALLOWED_DTYPES), "|O", ">f4", "<c8", "<U4", "float32", "", "<f16"]
Frames = list[bytes]


@dataclass
class FuzzReport:
    sent: int = 0
    parsed: int = 0
    oversized: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    applied_before: int = 0
    applied_after: int = 0
    digest_before: str = ""
    digest_after: str = ""
    ps_running: bool = False
    worker_trains_after: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.applied_before == self.applied_after
            and self.digest_before == self.digest_after
            and self.ps_running
            and self.worker_trains_after
        )

    def lines(self) -> list[str]:
        replies = ", ".join(f"{op} {n}" for op, n in self.replies.most_common())
        return [
            f"sent {self.sent} mutated messages in {self.seconds:.1f} s ({self.sent / max(self.seconds, 1e-9):.0f}/s), "
            f"{self.parsed} ({self.parsed / max(self.sent, 1):.0%}) past header parsing, {self.oversized} over the "
            "size limit",
            f"replies: {replies or 'none'}; unanswered {self.sent - sum(self.replies.values())}",
            f"gradients applied before/after: {self.applied_before}/{self.applied_after}; store hash unchanged: "
            f"{self.digest_before == self.digest_after}; ps still running: {self.ps_running}; a real worker still "
            f"trains: {self.worker_trains_after}",
            "PASS" if self.ok else "FAIL",
        ]


class RecordingEndpoint(ClientEndpoint):
    """Passes every request through and keeps its frames: the fuzzer's corpus."""

    def __init__(self, inner: ClientEndpoint, corpus: list[Frames]):
        super().__init__()
        self.inner, self.corpus, self.peers = inner, corpus, inner.peers

    def new_rid(self) -> int:
        return self.inner.new_rid()

    def send(self, index: int, message: Message, wait_s: float | None = None) -> None:
        self.corpus.append([bytes(memoryview(f)) for f in encode(message)])
        self.inner.send(index, message, wait_s)

    def receive(self, timeout_s: float) -> list[tuple[int, Message]]:
        return self.inner.receive(timeout_s)

    def start_many(self, requests: Any) -> Pending:
        return super().start_many(requests)

    def close(self) -> None:
        self.inner.close()


class Mutator:
    """Mutations of captured messages; most keep a valid header so they reach the handlers."""

    def __init__(self, rng: random.Random, corpus: list[Frames], max_message_bytes: int):
        self.rng, self.corpus, self.max_message_bytes = rng, corpus, max_message_bytes

    def next(self) -> Frames:
        frames = [bytes(f) for f in self.rng.choice(self.corpus)]
        roll = self.rng.random()
        if roll < 0.05:
            return frames  # an exact replay
        if roll < 0.50:
            return self._mutate_header(frames, self._mutate_fields)
        if roll < 0.62:
            return self._mutate_header(frames, self._mutate_specs)
        if roll < 0.75:
            return self._mutate_frames(frames)
        if roll < 0.86:
            return self._poison(frames)
        if roll < 0.93:
            return self._mutate_header(frames, self._swap_op)
        return self._garbage(frames)

    def _mutate_header(self, frames: Frames, change: Any) -> Frames:
        header = json.loads(frames[0])
        change(header)
        frames[0] = json.dumps(header, allow_nan=True).encode()
        return frames

    def _mutate_fields(self, header: dict[str, Any]) -> None:
        fields = header["f"]
        for _ in range(self.rng.randint(1, 3)):
            action = self.rng.random()
            if action < 0.6 and fields:
                fields[self.rng.choice(list(fields))] = copy.deepcopy(self.rng.choice(ODD_VALUES))
            elif action < 0.8 and fields:
                fields.pop(self.rng.choice(list(fields)))
            elif action < 0.9:
                header["rid"] = self.rng.choice(ODD_VALUES)
            else:
                fields[self.rng.choice(["worker", "version", "seq", "names", "job", "rule", "restore", "extra"])] = (
                    copy.deepcopy(self.rng.choice(ODD_VALUES))
                )

    def _mutate_specs(self, header: dict[str, Any]) -> None:
        specs = header["a"]
        if not specs:
            header["a"] = [["<f4", [self.rng.choice([0, 1, 10**9])]]]
            return
        spec = self.rng.choice(specs)
        if self.rng.random() < 0.5:
            spec[0] = self.rng.choice(DTYPES)
        else:
            shape = spec[1]
            spec[1] = self.rng.choice(
                [[], [0], [-1], [10**12], [*shape, 1], shape[:-1], [d * 2 for d in shape], [1] * 9, ["3"], None]
            )

    def _swap_op(self, header: dict[str, Any]) -> None:
        header["op"] = self.rng.choice([*OPS, "", "PUSH_PULL", "x" * 100])

    def _mutate_frames(self, frames: Frames) -> Frames:
        action = self.rng.random()
        if action < 0.3 and len(frames) > 1:
            i = self.rng.randrange(1, len(frames))
            frames[i] = frames[i][: self.rng.randrange(len(frames[i]) + 1)]
        elif action < 0.5 and len(frames) > 1:
            frames.pop(self.rng.randrange(1, len(frames)))
        elif action < 0.8:
            frames.append(self.rng.randbytes(self.rng.choice([0, 4, 64, 4096])))
        else:
            i = self.rng.randrange(len(frames))
            frames[i] = frames[i] + self.rng.randbytes(4)
        return frames

    def _poison(self, frames: Frames) -> Frames:
        header = json.loads(frames[0])
        for i, (code, _) in enumerate(header["a"]):
            if code in ("<f4", "<f8", "<f2") and len(frames[i + 1]):
                data = np.frombuffer(frames[i + 1], np.dtype(code)).copy()
                data[self.rng.randrange(data.size)] = self.rng.choice([np.nan, np.inf, -np.inf, 3e38])
                frames[i + 1] = data.tobytes()
        return frames

    def _garbage(self, frames: Frames) -> Frames:
        head = frames[0]
        choice = self.rng.random()
        if choice < 0.4:
            frames[0] = head[: self.rng.randrange(len(head))]
        elif choice < 0.7:
            frames[0] = self.rng.randbytes(self.rng.randint(0, 200))
        else:
            frames[0] = b'{"op":"push_pull","rid":1,"f":{},"a":[["<f4",[99999999999]]]}'
        return frames

    def oversized(self) -> Frames:
        """A push over the size limit (ZeroMQ drops it and the connection that sent it)."""
        size = self.max_message_bytes // 4 + 1024
        return [b'{"op":"push_pull","rid":3,"f":{"worker":1},"a":[["<f4",[%d]]]}' % size, bytes(size * 4)]


class FuzzSession:
    """A ps with two real workers, a corpus of their messages, and a stranger's connection."""

    def __init__(self, max_message_bytes: int = 4 << 20):
        self.max_message_bytes = max_message_bytes
        self.transport = ZmqTransport(
            ZmqOptions(transport=TransportOptions(max_message_bytes=max_message_bytes, heartbeat_interval_s=0.5))
        )
        endpoint = self.transport.serve("127.0.0.1:0", "ps 0")
        self.address = endpoint.address.split("://", 1)[1]
        self.server = ParameterServer(
            endpoint, 0, ServerOptions(transport=TransportOptions(heartbeat_timeout_s=60.0), poll_s=0.02)
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.server.serve, args=(self._stop,), daemon=True)
        self._thread.start()
        self.corpus: list[Frames] = []
        self.workers = self._real_workers()
        self.report = FuzzReport(applied_before=self.server.stats.applied, digest_before=self.server.store.digest())
        self._socket = self.transport.context.socket(zmq.DEALER)
        self._socket.linger = 0
        self._socket.connect(f"tcp://{self.address}")
        self._started = time.monotonic()

    def _real_workers(self) -> list[ParameterClient]:
        cluster = ClusterSpec({"ps": [self.address], "worker": ["localhost", "localhost"]})
        options = ClientOptions(
            transport=TransportOptions(heartbeat_interval_s=0.5, heartbeat_timeout_s=60.0, request_timeout_s=30.0)
        )
        workers = [ParameterClient(self.transport, cluster, i, options) for i in range(2)]
        for w in workers:
            w.endpoint = RecordingEndpoint(w.endpoint, self.corpus)
        chief, other = workers
        variables = {"dense/kernel": np.full((8, 4), 0.5, np.float32), "dense/bias": np.zeros(4, np.float32)}
        chief.initialize(variables, JobSpec(SyncSpec("async").resolved(2), 10**9, 2), Adam(lr=0.01))
        other.wait_initialized()
        for w in workers:
            w.pull()
            for _ in range(3):
                w.grads["dense/kernel"][...] = 0.1
                w.push_pull()
        chief.status()
        chief.stats()
        chief.checkpoint_state()
        for op, fields in (
            ("ping", {}),
            ("finish", {"report": {"local_steps": 3}}),
            ("shutdown", {}),
            ("abort", {"reason": "fuzz"}),
        ):
            self.corpus.append([bytes(memoryview(f)) for f in encode(Message(op, {"worker": 0, **fields}, rid=1))])
        return workers

    def fuzz(self, rng: random.Random, count: int) -> None:
        mutator = Mutator(rng, self.corpus, self.max_message_bytes)
        if rng.random() < 0.05:
            self._send_oversized(mutator.oversized())
        for _ in range(count):
            frames = mutator.next()
            try:
                decode(frames)
                self.report.parsed += 1
            except ProtocolError:
                pass
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._drain(1.0)
                self._socket.send_multipart(frames)
            self.report.sent += 1
            self._drain(0.0)

    def _send_oversized(self, frames: Frames) -> None:
        """On a throwaway connection: the ps drops it, and the main one keeps its replies."""
        sock = self.transport.context.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(f"tcp://{self.address}")
        try:
            sock.send_multipart(frames)
            self.report.oversized += 1
            self.report.sent += 1
        finally:
            sock.close(linger=0)

    def _drain(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self._socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                reply = self._socket.recv_multipart()
                try:
                    self.report.replies[decode(reply).op] += 1
                except ProtocolError:
                    self.report.replies["malformed"] += 1
            elif time.monotonic() >= deadline:
                return

    def finish(self) -> FuzzReport:
        """Collect the stragglers, then check the store, the ps and a real worker."""
        deadline = time.monotonic() + 5.0
        while sum(self.report.replies.values()) < self.report.parsed and time.monotonic() < deadline:
            self._drain(0.2)
        self.report.seconds = time.monotonic() - self._started
        self.report.applied_after = self.server.stats.applied
        self.report.digest_after = self.server.store.digest()
        self.report.ps_running = self._thread.is_alive() and self.server.exit_code is None
        chief = self.workers[0]
        before = self.server.store.version
        self.report.worker_trains_after = chief.push_pull().global_step == before + 1
        return self.report

    def close(self) -> None:
        self._socket.close(linger=0)
        for w in self.workers:
            w.close()
        self._stop.set()
        self._thread.join(timeout=10)
        self.transport.close()


def run(count: int, seed: int, batch: int = 1000) -> FuzzReport:
    """A whole session: ``count`` mutated messages from ``seed``."""
    session = FuzzSession()
    try:
        rng = random.Random(seed)
        for start in range(0, count, batch):
            session.fuzz(rng, min(batch, count - start))
        return session.finish()
    finally:
        session.close()
