"""SyncReplicasOptimizer's standard setup on several ps: backup workers, frequent checkpoints, the wrap-up.

Every shard runs its own sync rounds; with ``replicas_to_aggregate`` below
the worker count the first pushes to arrive differ from shard to shard. The
shards must still advance in lockstep, or the last round of a lagging shard
(and a checkpoint pause at the leading shard's version) waits for pushes
that never come. These tests repeat the setup many times, because the
failure depends on the order in which pushes arrive.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psdk
from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import PsdkError, RemoteError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD

from .conftest import PsCluster, running_ps
from .helpers import forward_backward
from .jobs import FAST_FLAGS
from .jobs import psdk as run_psdk

REPEATS = int(os.environ.get("PSDK_SYNC_REPEATS", "10"))
"""Runs of each setup; raise it (``PSDK_SYNC_REPEATS=50``) to hunt for a rare order."""

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)
SPEC = ModelSpec(hidden=(8,), input_dim=6, num_classes=3)
RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 64)


def train_script(ps: PsCluster, steps: int, checkpoint_every: int, folder: Path) -> dict[str, Any]:
    """The user's script: 3 worker threads, ``replicas_to_aggregate=2``, the chief checkpointing as it goes,
    then ``session.finish()`` and a final ``save_checkpoint``, as a TensorFlow 1.x script's chief did."""
    results: dict[str, Any] = {"errors": [], "local_steps": {}}
    lock = threading.Lock()

    def work(task: int) -> None:
        try:
            backend = NumpyBackend()
            model = backend.build_model(SPEC, init_weights(SPEC, 0))
            with psdk.connect(
                ps.cluster(3), task, steps=steps, sync="sync", replicas_to_aggregate=2, options=FAST,
                transport=ps.transport,
            ) as session:  # fmt: skip
                optimizer = psdk.DistributedOptimizer(SGD(lr=0.05), model, session, backend=backend)
                optimizer.broadcast_parameters()
                local, next_checkpoint = 0, checkpoint_every
                rows = np.random.default_rng(task)
                while not session.should_stop():
                    batch = rows.integers(0, len(X), 16)
                    forward_backward(model, X[batch], Y[batch])
                    optimizer.step()
                    local += 1
                    if session.is_chief and session.global_step >= next_checkpoint and not session.should_stop():
                        session.save_checkpoint(folder)
                        next_checkpoint = session.global_step + checkpoint_every
                session.finish(wait_s=20)
                if session.is_chief:
                    results["final"] = session.save_checkpoint(folder)
                with lock:
                    results["local_steps"][task] = local
        except BaseException as exc:  # surfaced by the test
            with lock:
                results["errors"].append(exc)

    threads = [threading.Thread(target=work, args=(task,), daemon=True) for task in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    return results


@pytest.mark.timeout(60 + 15 * REPEATS)
@pytest.mark.parametrize("num_ps", [2, 3])
def test_a_script_with_backup_workers_on_several_ps_finishes_every_time(num_ps: int, tmp_path: Path) -> None:
    steps = 200
    for run in range(2 * REPEATS):
        with running_ps(num_ps) as ps:
            folder = tmp_path / f"run{run}"
            results = train_script(ps, steps, checkpoint_every=20, folder=folder)
            assert not results["errors"], f"run {run}: {results['errors'][0]!r}"
            assert [server.store.version for server in ps.servers if server.store.size] == [steps] * sum(
                1 for server in ps.servers if server.store.size
            ), f"run {run}: the shards ended at different versions"
            assert not any(server.failure for server in ps.servers)
        assert results["final"] is not None and results["final"].name.endswith(f"-{steps}.npz")
        assert len(list(folder.glob("ckpt-*.npz"))) >= 5  # the pauses every 20 steps were taken, not skipped


@pytest.mark.timeout(60 + 40 * REPEATS)
@pytest.mark.parametrize("num_ps", [2, 3])
def test_the_built_in_job_with_backup_workers_on_several_ps_finishes_every_time(num_ps: int, tmp_path: Path) -> None:
    """``python -m psdk run sync=sync sync.replicas_to_aggregate=2 topology.num_workers=3`` on 2 and 3 ps.

    Softmax regression has two variables, so on 3 ps one shard holds none:
    a checkpoint must not wait for its version, which never moves.
    """
    seeds = ",".join(str(seed) for seed in range(REPEATS))
    result = run_psdk(
        "run", "-m", f"seed={seeds}", "backend=numpy", "model=softmax", "sync=sync", "sync.replicas_to_aggregate=2",
        "topology.num_workers=3", f"topology.num_ps={num_ps}", "train.steps=300", "train.validate_every=0",
        "checkpoint.every_steps=20", "checkpoint.every_seconds=0", "progress.mode=off",
        "transport.request_timeout_s=20", "recovery.enabled=false", *FAST_FLAGS, f"hydra.sweep.dir={tmp_path}",
        timeout=30 + 40 * REPEATS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("*/summary.json"))]
    assert len(summaries) == REPEATS
    for summary in summaries:
        assert summary["global_step"] == 300
    for run in tmp_path.iterdir():
        if run.is_dir() and (run / "summary.json").exists():
            assert list((run / "checkpoints").glob("ckpt-*-300.npz")), run


# ------------------------------------------------------------------ finish
def start(ps: PsCluster, n: int, replicas: int, steps: int = 100) -> list[ParameterClient]:
    cluster = ps.cluster(n)
    clients = [ParameterClient(ps.transport, cluster, i, FAST) for i in range(n)]
    job = JobSpec(SyncSpec("sync", replicas).resolved(n), steps, n)
    assert clients[0].initialize({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, job, SGD(lr=1.0))
    for client in clients[1:]:
        client.wait_initialized()
    for client in clients:
        client.pull()
    return clients


def push_together(clients: list[ParameterClient]) -> list[Any]:
    pending = [c.start_push_pull({"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}) for c in clients]
    return [c.finish_push_pull(p) for c, p in zip(clients, pending, strict=True)]


@pytest.mark.timeout(30)
def test_a_backup_workers_early_finish_is_covered_and_its_later_pushes_refused() -> None:
    with running_ps(2) as ps:
        clients = start(ps, 3, replicas=2)
        try:
            clients[2].finish({})  # worker 2 leaves at step 0: the two others make every round
            for step in range(1, 4):
                assert [r.global_step for r in push_together(clients[:2])] == [step, step]
            with pytest.raises(RemoteError, match="worker 2 has finished: its pushes are refused"):
                clients[2].push_pull({"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
            assert not any(server.failure for server in ps.servers)
            assert [server.store.version for server in ps.servers] == [3, 3]
        finally:
            for client in clients:
                client.close()


@pytest.mark.timeout(30)
def test_an_early_finish_that_leaves_a_round_unfillable_fails_at_once_without_recovery() -> None:
    with running_ps(2) as ps:
        clients = start(ps, 2, replicas=2)
        try:
            clients[1].finish({})
            began = time.monotonic()
            with pytest.raises(PsdkError, match=r"failed the job: .*worker 1 finished \(at version 0"):
                clients[0].wait_for_workers(20)  # reported at once, not waited out
            assert time.monotonic() - began < 5
            with pytest.raises(RemoteError, match="worker 1 finished"):
                clients[0].push_pull({"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
        finally:
            for client in clients:
                client.close()


@pytest.mark.timeout(30)
def test_with_recovery_an_early_finish_fails_the_job_after_recovery_timeout_naming_the_worker() -> None:
    with running_ps(2, recovery=True, recovery_timeout_s=1.0) as ps:
        clients = start(ps, 2, replicas=2)
        try:
            clients[1].finish({})
            assert not any(server.failure for server in ps.servers)  # it may still come back
            began = time.monotonic()
            named = r"worker 1 finished .* none came back in \d+ s \(recovery.timeout_s=1\)"
            with pytest.raises(RemoteError, match=named):
                clients[0].push_pull({"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
            assert 0.5 < time.monotonic() - began < 10
        finally:
            for client in clients:
                client.close()


@pytest.mark.timeout(30)
def test_with_recovery_a_new_process_of_a_worker_that_finished_early_trains_again() -> None:
    with running_ps(1, recovery=True, recovery_timeout_s=20.0, heartbeat_timeout_s=1.0) as ps:
        clients = start(ps, 2, replicas=2)
        try:
            clients[1].finish({})
            clients[1].close()  # the process is gone; a new one takes its place once the ps saw it go silent
            deadline = time.monotonic() + 10
            while True:
                again = ParameterClient(ps.transport, ps.cluster(2), 1, FAST)
                try:
                    again.wait_initialized()
                    break
                except RemoteError:
                    again.close()
                    assert time.monotonic() < deadline, "the new process never got in"
                    time.sleep(0.2)
            clients[1] = again
            again.pull()
            assert [r.global_step for r in push_together(clients)] == [1, 1]
            assert ps.servers[0].failure is None
        finally:
            for client in clients:
                client.close()


@pytest.mark.timeout(30)
def test_a_failed_shard_refuses_a_checkpoint_pause_at_once() -> None:
    with running_ps(2) as ps:
        clients = start(ps, 2, replicas=2)
        try:
            clients[1].finish({})  # fails the job on both shards (no recovery)
            began = time.monotonic()
            with pytest.raises(RemoteError, match="worker 1 finished") as refused:
                clients[0].checkpoint_state()
            assert refused.value.kind == "failed" and time.monotonic() - began < 5
        finally:
            for client in clients:
                client.close()


@pytest.mark.timeout(30)
def test_the_chief_sees_a_failure_on_any_shard_while_it_waits_for_the_workers() -> None:
    with running_ps(2) as ps:
        clients = start(ps, 2, replicas=2)
        try:
            # Nothing waits on ps 1 (no request is parked there), so failing it from this thread answers no one.
            ps.servers[1].fail("a stand-in for a failure on the second shard only")
            with pytest.raises(PsdkError, match=r"ps 1 .* failed the job: a stand-in"):
                clients[0].wait_for_workers(20)
        finally:
            for client in clients:
                client.close()
