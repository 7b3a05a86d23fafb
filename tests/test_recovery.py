"""A ps lost mid-training comes back and the chief restores the job from its last checkpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import zmq

import psdk
from psdk.client import ClientOptions, checkpoint
from psdk.config.options import TransportOptions
from psdk.errors import PortInUseError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.ps.rules import SGD
from psdk.ps.server import ParameterServer, ServerOptions
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .helpers import forward_backward

SPEC = ModelSpec(hidden=(16,), input_dim=32, num_classes=10)
RNG = np.random.default_rng(3)
X, Y = RNG.random((50, 10, 32), dtype=np.float32), RNG.integers(0, 10, (50, 10))
OPTIONS = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5, request_timeout_s=30.0, init_timeout_s=30.0
    ),
    recovery_timeout_s=30.0,
)
SERVER = ServerOptions(transport=TransportOptions(heartbeat_timeout_s=5.0), poll_s=0.02, recovery=True)
STEPS, EVERY, KILL_AT = 300, 40, 120


class Shard:
    """One ps task as a thread that can be killed and started again on the same address."""

    def __init__(self, transport: ZmqTransport, index: int, address: str = "127.0.0.1:0"):
        deadline = time.monotonic() + 10
        while True:  # ZeroMQ releases a closed listener in the background: retry the same port briefly
            try:
                self.endpoint = transport.serve(address, f"ps {index}")
                break
            except PortInUseError:
                assert time.monotonic() < deadline, f"{address} stayed busy"
                time.sleep(0.05)
        self.address = self.endpoint.address.split("://", 1)[1]
        self.server = ParameterServer(self.endpoint, index, SERVER)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def kill(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_a_lost_ps_is_restored_from_the_last_checkpoint_and_training_goes_on(tmp_path: Path) -> None:
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5)), context=zmq.Context()
    )
    shards = [Shard(transport, 0), Shard(transport, 1)]
    cluster = psdk.ClusterSpec({"ps": [s.address for s in shards], "worker": ["localhost"] * 2})
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    killed = threading.Event()

    def work(task: int) -> None:
        try:
            backend = NumpyBackend()
            model = backend.build_model(SPEC, init_weights(SPEC, 0))
            with psdk.connect(
                cluster,
                task,
                steps=STEPS,
                options=OPTIONS,
                transport=transport,
                checkpoint_dir=tmp_path if task == 0 else None,
            ) as session:
                opt = psdk.DistributedOptimizer(SGD(lr=0.2), model, session, backend=backend)
                opt.broadcast_parameters()
                step, next_checkpoint, outcomes = 0, EVERY, []
                while not session.should_stop():
                    forward_backward(model, X[step % 50], Y[step % 50])
                    result = opt.step()
                    outcomes.append(result.outcome)
                    step += 1
                    if task == 0 and session.global_step >= next_checkpoint:
                        saved = session.save_checkpoint(tmp_path)
                        next_checkpoint += EVERY
                        if saved is not None and (checkpoint.step_of(saved) or 0) >= KILL_AT:
                            killed.wait(timeout=30)  # the one the test sees is the latest: none half-written
                session.finish(wait_s=30)
                results[task] = {
                    "outcomes": outcomes,
                    "recoveries": list(session.client.recoveries),
                    "step": session.global_step,
                }
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        # Measured progress, not a sleep: kill ps 1 as soon as a checkpoint at KILL_AT or later exists.
        while not any((checkpoint.step_of(p) or 0) >= KILL_AT for p in tmp_path.glob("ckpt-*.npz")):
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.002)
        killed.set()
        shards[1].kill()
        # Once ps 1 is gone no push can complete, so progress stops (but for pushes in flight).
        reached = shards[0].server.store.version
        latest = max((checkpoint.step_of(p) or 0) for p in tmp_path.glob("ckpt-*.npz"))
        address = shards[1].address
        shards[1] = Shard(transport, 1, address)  # restarted, empty, on the same address
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        assert not errors, errors
    finally:
        for s in shards:
            s.kill()
        transport.context.destroy(linger=0)
    assert shards[0].server.store.version == shards[1].server.store.version == STEPS
    chief = results[0]["recoveries"]
    # Restored to the last checkpoint written before the loss: only the steps since then are lost,
    # plus what ps 0 applied after `reached` was read: per worker, the push ps 1 had answered
    # before it died but ps 0 had not applied yet, and the worker's next push.
    assert len(chief) == 1 and chief[0]["global_step"] == latest >= KILL_AT
    assert chief[0]["lost_steps"] <= reached - latest + 2 * 2
    assert "resync" in results[1]["outcomes"]
    assert shards[0].server.epoch == shards[1].server.epoch == 1
