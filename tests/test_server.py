"""The ps task's rules, driven by real clients over real ZeroMQ sockets."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient, StepResult
from psdk.config.options import TransportOptions
from psdk.errors import PeerTimeoutError, RemoteError
from psdk.protocol import ID_HELD, ID_IN_USE
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.ps.server import process_usage
from psdk.transport.wire import Message

from .conftest import PsCluster, running_ps

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)
INIT = {"w": np.zeros((2, 3), np.float32), "b": np.ones(3, np.float32)}


def clients(ps: PsCluster, n: int, options: ClientOptions = FAST) -> list[ParameterClient]:
    cluster = ps.cluster(n)
    return [ParameterClient(ps.transport, cluster, i, options) for i in range(n)]


def start(
    ps: PsCluster, n: int, mode: str = "sync", replicas: int | None = None, steps: int = 100, lr: float = 1.0
) -> list[ParameterClient]:
    cs = clients(ps, n)
    job = JobSpec(SyncSpec(mode, replicas).resolved(n), steps, n)
    assert cs[0].initialize(INIT, job, SGD(lr=lr))
    for c in cs[1:]:
        c.wait_initialized()
    for c in cs:
        c.pull()
    return cs


def grads(value: float) -> dict[str, np.ndarray]:
    """Whole-number gradients: with rates 1.0 and 0.5 every parameter below is exact in float32 (no atol needed)."""
    return {"w": np.full((2, 3), value, np.float32), "b": np.full(3, value, np.float32)}


def close_all(cs: list[ParameterClient]) -> None:
    for c in cs:
        c.close()


def in_thread(fn: Callable[[], StepResult]) -> Future[StepResult]:
    return ThreadPoolExecutor(max_workers=1).submit(fn)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def stats(ps: PsCluster) -> dict[str, Any]:
    return ps.servers[0].stats.to_json()


def test_sync_applies_the_mean_of_replicas_to_aggregate_and_drops_the_stale(ps_cluster: PsCluster) -> None:
    c0, c1, c2 = cs = start(ps_cluster, 3, replicas=2)
    try:
        first = in_thread(lambda: c0.push_pull(grads(1.0)))
        wait_until(lambda: stats(ps_cluster)["workers"].get("0", {}).get("pushed") == 1)
        assert not first.done()  # the barrier: one gradient of two
        second = c1.push_pull(grads(3.0))
        assert first.result(5).global_step == second.global_step == 1
        np.testing.assert_allclose(c0.params["w"], -2.0)  # 0 - 1.0 * mean(1, 3)
        late = c2.push_pull(grads(100.0))  # computed from version 0: a backup worker, too late
        assert (late.outcome, late.global_step) == ("dropped", 1)
        np.testing.assert_allclose(c2.params["w"], -2.0)  # it got the fresh parameters back
        s = stats(ps_cluster)
        assert (s["applied"], s["updates"], s["dropped"]) == (2, 1, 1)
    finally:
        close_all(cs)


def test_sync_aggregates_exactly_replicas_per_step(ps_cluster: PsCluster) -> None:
    cs = start(ps_cluster, 2)
    try:
        for step in range(1, 6):
            futures = [in_thread(lambda c=c: c.push_pull(grads(1.0))) for c in cs]
            assert all(f.result(5).global_step == step for f in futures)
        s = stats(ps_cluster)
        assert (s["applied"], s["updates"], s["dropped"]) == (10, 5, 0)
        np.testing.assert_allclose(cs[0].params["b"], 1.0 - 5.0)
    finally:
        close_all(cs)


def test_async_applies_every_gradient_on_arrival_and_records_staleness(ps_cluster: PsCluster) -> None:
    c0, c1 = cs = start(ps_cluster, 2, mode="async", lr=0.5)
    try:
        assert c0.push_pull(grads(1.0)).global_step == 1
        assert c0.push_pull(grads(1.0)).global_step == 2
        assert c1.push_pull(grads(1.0)).global_step == 3  # computed from version 0: staleness 2
        np.testing.assert_allclose(c1.params["b"], 1.0 - 1.5)
        workers = stats(ps_cluster)["workers"]
        assert workers["0"]["staleness"] == {"0": 2} and workers["1"]["staleness"] == {"2": 1}
    finally:
        close_all(cs)


def test_reaching_the_target_answers_every_waiting_and_later_push_with_done(ps_cluster: PsCluster) -> None:
    c0, c1, c2 = cs = start(ps_cluster, 3, replicas=2, steps=1)
    try:
        parked = in_thread(lambda: c2.push_pull(grads(1.0)))
        wait_until(lambda: stats(ps_cluster)["workers"].get("2", {}).get("pushed") == 1)
        c0.push_pull(grads(1.0))  # closes the only round: the job is done
        assert parked.result(5).done or parked.result(5).global_step == 1
        later = c1.push_pull(grads(1.0))
        assert later.done and later.outcome == "done"
        assert c1.pull() == 1  # plain pulls still work, for the chief's final evaluation
    finally:
        close_all(cs)


def raw(ps: PsCluster, op: str, fields: dict[str, Any], arrays: list[np.ndarray] | None = None) -> Message:
    """A request from a connection of its own (not a registered worker's)."""
    endpoint = ps.transport.connect(ps.addresses, ["ps 0"])
    try:
        return endpoint.request(0, Message(op, fields, arrays or []), 5.0, op)
    finally:
        endpoint.close()


@pytest.mark.parametrize(
    "op, fields, arrays, fragment",
    [
        (
            "push_pull",
            {"worker": 1, "version": 0, "seq": 9},
            [np.zeros(5, np.float32)],
            "expected float32[9]",
        ),
        (
            "push_pull",
            {"worker": 1, "version": 0, "seq": 9},
            [np.zeros(9, np.float64)],
            "expected float32[9]",
        ),
        ("push_pull", {"worker": 1, "version": 7, "seq": 9}, [np.zeros(9, np.float32)], "version 7"),
        ("push_pull", {"worker": 1, "version": 0, "seq": 9}, [np.full(9, np.nan, np.float32)], "NaN"),
        ("push_pull", {"worker": 1, "version": 0, "seq": 0}, [np.zeros(9, np.float32)], "duplicate"),
        ("push_pull", {"worker": 5, "version": 0, "seq": 9}, [np.zeros(9, np.float32)], "not in this job"),
        ("push_pull", {"worker": -1, "version": 0, "seq": 9}, [np.zeros(9, np.float32)], "bad worker"),
        ("push_pull", {"worker": 1, "version": "0", "seq": 9}, [np.zeros(9, np.float32)], "bad version"),
        ("push_pull", {"worker": 1, "version": 0, "seq": 9}, [], "one flat gradient"),
        ("init", {"worker": 1, "names": []}, [], "only the chief"),
        ("shutdown", {"worker": 1}, [], "only the chief"),
        ("format_disk", {}, [], "unknown op"),
    ],
)
def test_bad_requests_get_an_error_and_leave_the_store_as_it_was(
    ps_cluster: PsCluster, op: str, fields: dict[str, Any], arrays: list[np.ndarray], fragment: str
) -> None:
    c0, c1 = cs = start(ps_cluster, 2, mode="async")
    try:
        c1.push_pull(grads(0.5))  # seq 1 from worker 1 is now taken
        c1._seq = 0
        store = ps_cluster.servers[0].store
        before = store.digest()
        if fields.get("seq") == 0:
            fields = dict(fields, seq=1)
        # Sent on worker 1's own connection, so only the content can be wrong.
        reply = c1.endpoint.request(0, Message(op, fields, arrays), 5.0, op)
        assert reply.op == "error" and fragment in reply.fields["error"]
        assert store.digest() == before
        assert c0.push_pull(grads(0.5)).global_step == 2  # the job goes on
    finally:
        close_all(cs)


def test_a_push_forged_on_another_connection_is_refused(ps_cluster: PsCluster) -> None:
    cs = start(ps_cluster, 2, mode="async")
    c1 = cs[1]
    try:
        before = ps_cluster.servers[0].store.digest()
        for worker in (0, 1):
            fields = {"worker": worker, "version": 0, "seq": 10**6}
            reply = raw(ps_cluster, "push_pull", fields, [np.ones(9, np.float32)])
            assert reply.op == "error" and "another session" in reply.fields["error"]
            assert reply.fields["kind"] in (ID_IN_USE, ID_HELD)  # what the worker reads: in use, or retry
        assert raw(ps_cluster, "shutdown", {"worker": 0}).op == "error"
        assert ps_cluster.servers[0].store.digest() == before and ps_cluster.servers[0].stats.applied == 0
        assert c1.push_pull(grads(0.5)).global_step == 1
    finally:
        close_all(cs)


def test_the_chief_can_end_the_job_early(ps_cluster: PsCluster) -> None:
    c0, c1, c2 = cs = start(ps_cluster, 3, replicas=2)
    try:
        parked = in_thread(lambda: c2.push_pull(grads(1.0)))
        wait_until(lambda: stats(ps_cluster)["workers"].get("2", {}).get("pushed") == 1)
        assert c0.stop_at(0) == 0  # now: version 0 is already reached
        assert parked.result(5).done
        assert c1.push_pull(grads(1.0)).outcome == "done"
        assert ps_cluster.servers[0].store.version == 0
    finally:
        close_all(cs)


def test_a_second_initialisation_never_overwrites_the_store(ps_cluster: PsCluster) -> None:
    cs = start(ps_cluster, 1, mode="async")
    try:
        cs[0].push_pull(grads(1.0))
        job = JobSpec(SyncSpec("async").resolved(1), 100, 1)
        assert cs[0].initialize({k: v + 5 for k, v in INIT.items()}, job, SGD(lr=1.0)) is False
        cs[0].pull()
        np.testing.assert_allclose(cs[0].params["b"], 0.0)
    finally:
        close_all(cs)


def test_workers_wait_for_the_chief_with_a_bounded_wait(ps_cluster: PsCluster) -> None:
    impatient = ClientOptions(
        transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, init_timeout_s=0.3)
    )
    c1 = ParameterClient(ps_cluster.transport, ps_cluster.cluster(2), 1, impatient)
    try:
        with pytest.raises(PeerTimeoutError) as info:
            c1.wait_initialized()
        assert "chief (worker 0)" in str(info.value) and "ps 0" in str(info.value)
        # Now a patient wait, parked at the ps (measured, not slept for) when the chief initialises.
        c1.options = dataclasses.replace(
            impatient, transport=dataclasses.replace(impatient.transport, init_timeout_s=20.0)
        )
        parked = len(ps_cluster.servers[0].shard.init_waiters)
        waiting = in_thread(lambda: c1.wait_initialized() or StepResult(0, False, ""))
        wait_until(lambda: len(ps_cluster.servers[0].shard.init_waiters) > parked)
        c0 = ParameterClient(ps_cluster.transport, ps_cluster.cluster(2), 0, FAST)
        try:
            c0.initialize(INIT, JobSpec(SyncSpec().resolved(2), 10, 2), SGD(lr=1.0))
            waiting.result(5)
            assert c1.variable_shapes() == {"w": (2, 3), "b": (3,)}
        finally:
            c0.close()
    finally:
        c1.close()


def test_sync_round_that_cannot_fill_after_a_death_fails_naming_the_dead() -> None:
    with running_ps(1, heartbeat_timeout_s=1.0) as ps:
        c0, c1 = cs = start(ps, 2)
        try:
            c1.close()  # worker 1 stops heartbeating: it is dead to the ps after 1 s
            with pytest.raises(RemoteError) as info:
                c0.push_pull(grads(1.0))
            text = str(info.value)
            assert "replicas_to_aggregate=2" in text and "worker 1" in text
        finally:
            close_all(cs)


def test_sync_with_a_backup_worker_goes_on_when_one_dies() -> None:
    with running_ps(1, heartbeat_timeout_s=1.0) as ps:
        c0, c1, c2 = cs = start(ps, 3, replicas=2)
        try:
            c2.close()
            for step in range(1, 4):
                futures = [in_thread(lambda c=c: c.push_pull(grads(1.0))) for c in (c0, c1)]
                assert all(f.result(5).global_step == step for f in futures)
            wait_until(lambda: ps.servers[0].membership.status(2) == "dead")
            futures = [in_thread(lambda c=c: c.push_pull(grads(1.0))) for c in (c0, c1)]
            assert all(f.result(5).global_step == 4 for f in futures)
        finally:
            close_all(cs)


def test_a_dead_chief_stops_the_ps_with_an_error() -> None:
    with running_ps(1, heartbeat_timeout_s=0.5) as ps:
        cs = start(ps, 2, mode="async")
        cs[0].close()
        ps.threads[0].join(timeout=10)
        close_all(cs[1:])
        assert ps.servers[0].exit_code == 1
        assert "chief (worker 0)" in (ps.servers[0].failure or "")


def test_shutdown_by_the_chief_ends_the_ps_cleanly(ps_cluster: PsCluster) -> None:
    cs = start(ps_cluster, 2, mode="async")
    try:
        for c in cs:
            c.finish({"local_steps": 0})
        early = "at version 0, before the job's end"  # finished before the target step: said, not hidden
        assert cs[0].wait_for_workers(5) == {
            "0": {"status": "finished", "reason": early},
            "1": {"status": "finished", "reason": early},
        }
        cs[0].shutdown()
        ps_cluster.threads[0].join(timeout=5)
        assert ps_cluster.servers[0].exit_code == 0
    finally:
        close_all(cs)


def test_two_ps_shards_each_hold_their_variables() -> None:
    with running_ps(2) as ps:
        cs = start(ps, 1, mode="async")
        try:
            assert [s.name for s in ps.servers[0].store.specs] == ["w"]
            assert [s.name for s in ps.servers[1].store.specs] == ["b"]
            assert cs[0].push_pull(grads(1.0)).global_step == 1
            assert ps.servers[1].store.version == 1
        finally:
            close_all(cs)


def test_unseen_workers_count_as_dead_after_the_startup_timeout() -> None:
    with running_ps(1, heartbeat_timeout_s=1.0, startup_timeout_s=2.0) as ps:
        cs = clients(ps, 1)
        try:
            job = JobSpec(SyncSpec("sync").resolved(2), 10, 2)
            cs[0].initialize(INIT, job, SGD(lr=1.0))
            cs[0].pull()
            with pytest.raises(RemoteError, match="never connected"):
                cs[0].push_pull(grads(1.0))
        finally:
            close_all(cs)


def test_membership_is_reported_per_worker(ps_cluster: PsCluster) -> None:
    cs = start(ps_cluster, 2, mode="async")
    try:
        assert {k: v["status"] for k, v in cs[0].status()["workers"].items()} == {"0": "alive", "1": "alive"}
    finally:
        close_all(cs)


def _report_peak_memory(queue: Any) -> None:
    queue.put(process_usage()["max_rss_mb"])


def test_a_spawned_ps_reports_its_own_peak_memory_not_its_parents() -> None:
    """``ru_maxrss`` survives exec: a ps spawned by a benchmark holding 200 MB reported 200 MB too much."""
    ballast = np.ones(50_000_000, np.float32)  # 200 MB, touched
    assert process_usage()["max_rss_mb"] > 200
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_report_peak_memory, args=(queue,), daemon=True)
    child.start()
    try:
        child_peak = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert 10 < child_peak < 150, child_peak
    del ballast
