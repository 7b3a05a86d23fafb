"""Alongside a real job: worker 2's key in a fuzzer's hands while the chief and worker 1 train to the end.

A stranger's requests stop at the session check, and the state machine
(:mod:`psdk.fuzz.stateful`) checks the ps on its own; a holder of
one of the job's worker keys gets past the session check, so what matters
here is whether the others' job survives it. The chief and worker 1 train
a real async job (MNIST's numpy trainer on the numpy bridge, over CURVE);
worker 2's key, an :class:`Intruder`, sends random requests on its own
session (NaN, future versions, replays, tampered attaches, chief-only ops,
another worker's id, undecodable frames), and every reply to it is checked. The job must reach
its last step with every honest worker contributing, its store finite,
and the ps must exit 0.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from psdk.config.options import TransportOptions
from psdk.fuzz.harness import REPLY_OPS, WORKERS, Actor, LivePs, Mode, Sent
from psdk.protocol import ops as protocol
from psdk.protocol.numerics import all_finite
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer
from psdk.transport import security, shm
from psdk.transport.lending import ATTACH, ATTACHED, REFUSED, UNLENT
from psdk.transport.wire import Message, encode

# Who may ask what comes from the protocol's declaration.
CHIEF_ONLY = tuple(sorted(protocol.CHIEF_ONLY))


@dataclass
class AlongsideReport:
    """How a real job fared while one of its workers' keys was fuzzed."""

    intruder_requests: int = 0
    intruder_replies: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    honest_steps: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    global_step: int = 0
    target: int = 0
    store_finite: bool = False
    ps_exit: int | None = None

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and not self.errors
            and self.global_step >= self.target
            and all(steps > 0 for steps in self.honest_steps.values())
            and self.store_finite
            and self.ps_exit == 0
        )

    def line(self) -> str:
        outcome = "PASS" if self.ok else f"FAIL: {(self.violations + self.errors)[:2]}"
        replies = ", ".join(f"{op} {n}" for op, n in self.intruder_replies.most_common())
        return (
            f"alongside a real job: worker 2's key sent {self.intruder_requests} requests ({replies}); workers "
            f"{sorted(self.honest_steps)} trained {self.honest_steps} local steps to global step {self.global_step} "
            f"of {self.target}; store finite: {self.store_finite}; ps exit {self.ps_exit}: {outcome}"
        )


class Intruder:
    """Worker ``worker``'s key in the hands of a fuzzer: random requests on its own session, each reply checked."""

    OPS = (
        "push-nan", "push-inf", "push-future", "push-repeat", "push-small", "push-shape", "pull", "attach",
        "attach-tampered", "knock", "release", "pause_at", "state", "resume", "stop_at", "restore", "init",
        "shutdown", "abort", "garbage", "other-id", "stats",
    )  # fmt: skip

    def __init__(self, actor: Actor, server: ParameterServer, seed: int):
        import random

        self.actor, self.server, self.rng = actor, server, random.Random(seed)
        self.report = AlongsideReport()

    def step(self) -> None:
        op = self.rng.choice(self.OPS)
        actor, version = self.actor, self.server.store.version
        seq = actor.next_seq
        actor.next_seq += 1
        size = self.server.store.size
        if op.startswith("push"):
            kind = op.split("-", 1)[1]
            # What it pushes is refused, or too small to matter: a worker's key can always push finite nonsense
            # (the ps keeps the store finite, not the training sound), and this run is about the others' survival.
            fill = {"nan": np.nan, "inf": np.inf, "small": 1e-6}.get(kind, 1e-6)
            grad = np.full(size if kind != "shape" else size + 1, fill, np.float32)
            at = version + 10**9 if kind == "future" else version
            number = 1 if kind == "repeat" else seq
            counters = self.server.stats.workers.get(self.actor.worker or 0)
            repeated = kind == "repeat" and counters is not None and counters.last_seq >= 1
            must_fail = kind in ("nan", "inf", "future", "shape") or repeated
            self._send(Message("push_pull", actor.fields(version=at, seq=number, epoch=0), [grad]), must_fail)
        elif op in ("attach", "attach-tampered") and shm.available():
            offer = actor.offer_memory(size)
            if op == "attach-tampered":
                offer["token"] = "00" * 16
            self._send(Message(ATTACH, offer), False)
            rid, deadline = actor.next_rid - 1, time.monotonic() + 5.0
            while rid in actor.outstanding and time.monotonic() < deadline:  # its memory must outlive the offer
                self.collect(0.01)
        elif op == "knock" and actor.knocks and actor.buffers is not None:
            actor.buffers.grads[...] = 1e-6
            rid = actor.rid()
            if actor.buffers.knock(rid, actor.knock_header(rid, version=version, seq=seq, epoch=0)):
                self.report.intruder_requests += 1
                actor.outstanding[rid] = Sent("knock")
        elif op == "release":
            actor.release()
        elif op in CHIEF_ONLY:
            self._send(Message(op, actor.fields(version=version, names=["w"], job={}, reason="x")), True)
        elif op == "garbage":
            rid = actor.rid()
            frames = [b'{"op":"pull","rid":%d,"a":[],"f":{"x":' % rid + b"[" * 5000 + b"]" * 5000 + b"}}"]
            self.report.intruder_requests += 1
            actor.sock.send_multipart(frames)
        elif op == "other-id":  # the key of this worker claims the chief's id
            self._send(Message("pull", {"worker": 0}), True)
        else:
            self._send(Message(op if op in ("pull", "stats") else "ping", actor.fields()), False)
        self.collect(0.0)

    def _send(self, message: Message, must_fail: bool) -> None:
        message.rid = self.actor.rid()
        self.actor.outstanding[message.rid] = Sent(message.op, must_fail)
        self.report.intruder_requests += 1
        self.actor.sock.send_multipart(encode(message))

    def collect(self, wait_s: float) -> None:
        for reply in self.actor.replies(wait_s):
            self.report.intruder_replies[reply.op] += 1
            sent = self.actor.outstanding.pop(reply.rid, None)
            if sent is not None and sent.op == ATTACH and reply.op in (ATTACHED, REFUSED):
                self.actor.attached_as(reply)  # the transport's own answer to an offer of memory
            elif sent is not None and reply.op == UNLENT:
                self.actor.attached = self.actor.knocks = False  # memory the ps's transport holds no more
            elif reply.op not in REPLY_OPS:
                self.report.violations.append(f"an untyped reply {reply.op}")
            elif sent is None:
                self.report.violations.append(f"an unexpected reply {reply.op} to request {reply.rid}")
            elif sent.must_fail and reply.op != "error":
                self.report.violations.append(f"{sent.op} had to be refused, got {reply.op} {reply.fields}")
            elif reply.op == "error" and reply.fields.get("kind") == "internal":
                self.report.violations.append(f"an internal error: {reply.fields.get('error')}")


def run_alongside(steps: int = 400, seed: int = 0, curve: bool = True, timeout_s: float = 120.0) -> AlongsideReport:
    """A real async job (chief and worker 1 training) while worker 2's key is fuzzed, until the job ends."""
    import psdk
    from psdk.client import ClientOptions
    from psdk.plugins.backends.numpy_backend import NumpyBackend
    from psdk.plugins.batches import Batch
    from psdk.plugins.models import ModelSpec, init_weights
    from psdk.protocol.cluster import ClusterSpec
    from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier

    tmp = tempfile.TemporaryDirectory(prefix="psdk-alongside-")
    keys_dir = security.generate(Path(tmp.name), WORKERS) if curve else None
    ps = LivePs(Mode(curve=curve), keys_dir)
    spec = ModelSpec(hidden=(16,), input_dim=32, num_classes=10)
    rng = np.random.default_rng(seed)
    xs, ys = rng.random((20, 16, 32), dtype=np.float32), rng.integers(0, 10, (20, 16))
    batches = [Batch({IMAGE: x}, y) for x, y in zip(xs, ys, strict=True)]
    cluster = ClusterSpec({"ps": [ps.address.split("://", 1)[1]], "worker": ["127.0.0.1"] * WORKERS})
    options = ClientOptions(
        transport=TransportOptions(heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, request_timeout_s=60.0)
    )
    report = AlongsideReport(target=steps)
    lock = threading.Lock()

    def train(task: int) -> None:
        try:
            backend = NumpyBackend()
            trainer = NumpyClassifier(backend)
            model = backend.build_model(spec, init_weights(spec, seed))
            keys = security.load_worker(keys_dir, task) if keys_dir is not None else None
            with psdk.connect(cluster, task, steps=steps, options=options, keys=keys, secure=curve) as session:
                opt = psdk.DistributedOptimizer(SGD(lr=0.1), model, session, backend=backend)
                opt.broadcast_parameters()
                local = 0
                while not session.should_stop():
                    trainer.forward_backward(model, batches[local % 20])
                    opt.step()
                    local += 1
                with lock:
                    report.honest_steps[task] = local
                    if task == 0:
                        report.global_step = session.global_step
                        report.store_finite = all_finite(ps.server.store.params())
                session.finish(wait_s=timeout_s)
        except Exception as exc:  # reported: the test fails naming it
            with lock:
                report.errors.append(f"worker {task}: {exc!r}")

    trainers = [threading.Thread(target=train, args=(task,), daemon=True) for task in (0, 1)]
    intruder_keys = security.load_worker(keys_dir, 2) if keys_dir is not None else None
    actor = Actor(ps.transport.context, ps.address, 2, intruder_keys)
    intruder = Intruder(actor, ps.server, seed)
    try:
        for thread in trainers:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while not ps.server.store.initialized and time.monotonic() < deadline:
            time.sleep(0.01)
        while trainers[1].is_alive() and ps.serving and time.monotonic() < deadline:
            intruder.step()
        # The job is over: worker 2 says so too (the chief waits for it), and collects its last answers.
        finish = Message("finish", actor.fields(report={"fuzzed": True}))
        intruder._send(finish, False)
        while trainers[0].is_alive() and time.monotonic() < deadline:
            intruder.collect(0.05)
        for thread in trainers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in trainers):
            report.errors.append(f"the job did not end within {timeout_s:.0f} s")
        ps.thread.join(timeout=10)
        report.ps_exit = ps.exit_code
        if ps.crashed is not None:
            report.errors.append(f"the ps's serve() raised {ps.crashed!r}")
        report.intruder_requests, report.intruder_replies = (
            intruder.report.intruder_requests,
            intruder.report.intruder_replies,
        )
        report.violations = intruder.report.violations
    finally:
        actor.close()
        ps.close()
        tmp.cleanup()
    return report
