"""A step's push names the pull whose ids it answers: the ids stay on the ps, and only a pull it holds is named.

A ctr step pushes the rows of exactly the ids it pulled a step before. The
worker then sends only the rows (``pulled`` entries, :mod:`psdk.ps.tables.requests`)
and the shard takes the ids it checked for that pull. These tests run two
real ps shards and real clients, look at what each push carried, and check
every update lands on the right rows; and that a push naming a pull the
shard does not hold for that worker's connection is refused, changing nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from psdk.client import ClientOptions, ParameterClient, recovery
from psdk.config.options import TransportOptions
from psdk.errors import PsdkError, RemoteError
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD
from psdk.transport.wire import Message
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import running_ps
from .test_recovery import Shard
from .test_tables_served import DENSE, FAST, USERS, initial, job

pytestmark = pytest.mark.timeout(60)

LR = 0.5


@contextmanager
def sent_by(client: ParameterClient) -> Iterator[list[dict[int, Message]]]:
    """Every request ``client`` starts, by shard, as it left (its arrays listed before the transport took them,
    its request id as the transport gave it)."""
    seen: list[dict[int, Message]] = []
    real = client.endpoint.start_many

    def spy(messages: dict[int, Message]):  # type: ignore[no-untyped-def]
        copies = {i: Message(m.op, dict(m.fields), list(m.arrays)) for i, m in messages.items()}
        pending = real(messages)
        for i, copy in copies.items():
            copy.rid = messages[i].rid  # the transport numbers each request as it leaves
        seen.append(copies)
        return pending

    client.endpoint.start_many = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        client.endpoint.start_many = real  # type: ignore[method-assign]


def on_each_shard(count: int) -> np.ndarray:
    """``count`` ids of USERS on each of the two shards, sorted."""
    ids = np.arange(1, 400, dtype=np.int64)
    where = shard_of_ids(USERS, ids, 2)
    return np.sort(np.concatenate([ids[where == 0][:count], ids[where == 1][:count]]))


def test_a_steps_push_names_the_pull_it_answers_and_its_rows_land_on_those_ids() -> None:
    a, b = on_each_shard(3), on_each_shard(5)[1::2]
    grads_a = np.arange(len(a) * 4, dtype=np.float32).reshape(-1, 4) / 10
    with job(rule=SGD(lr=LR)) as (client,):
        client.push_pull(pull={"users": a})
        with sent_by(client) as sent:
            client.push_pull(rows={"users": (a, grads_a)}, pull={"users": b})
            client.push_pull(rows={"users": (b, np.ones((len(b), 4), np.float32))})
        for step in sent:
            for shard, message in step.items():
                assert message.fields["tables"][0] == {"table": "users", "push": True, "pulled": True} | (
                    {"pull": True} if step is sent[0] else {}
                )
                assert isinstance(message.fields["pulled"], int)
                pushed = [array for array in message.arrays[1:] if array.dtype == np.int64]
                assert len(pushed) == (1 if step is sent[0] else 0), f"shard {shard} was sent the push's ids"
        after = client.pull_rows({"users": np.union1d(a, b)}, read=True)["users"]
        both = np.union1d(a, b)
        expected = initial(USERS, both.tolist())  # rows start from the seed and id
        expected[np.searchsorted(both, a)] -= LR * grads_a
        expected[np.searchsorted(both, b)] -= LR
        np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-6)


def test_ids_rewritten_in_place_after_their_pull_are_sent_not_named() -> None:
    """The client compares a push's ids with its own copy of the pulled ones: the caller's array may change."""
    a = on_each_shard(3)
    with job(rule=SGD(lr=LR)) as (client,):
        client.push_pull(pull={"users": a})
        original = a.copy()
        client.pull_rows({"users": a + 400})  # their rows exist (a plain pull: the step's pull stays the named one)
        a += 400  # the caller's array now holds other ids (still sorted, still spread over both shards)
        before = client.pull_rows({"users": np.concatenate([original, a])}, read=True)["users"]
        with sent_by(client) as sent:
            client.push_pull(rows={"users": (a, np.ones((len(a), 4), np.float32))})
        assert all("pulled" not in m.fields and m.fields["tables"][0] == {"table": "users", "push": True}
                   for m in sent[0].values())  # fmt: skip
        after = client.pull_rows({"users": np.concatenate([original, a])}, read=True)["users"]
        np.testing.assert_allclose(after[: len(a)], before[: len(a)], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(after[len(a) :], before[len(a) :] - LR, rtol=1e-6, atol=1e-6)


def test_a_plain_pull_or_a_read_between_two_steps_leaves_the_pull_the_next_push_names() -> None:
    a, c = on_each_shard(2), on_each_shard(6)[-3:]
    with job(rule=SGD(lr=LR)) as (client,):
        client.push_pull(pull={"users": a})
        before = client.pull_rows({"users": a}, read=True)["users"]
        client.pull_rows({"users": c})  # a training pull between: rows of c created, counted
        with sent_by(client) as sent:
            client.push_pull(rows={"users": (a, np.ones((len(a), 4), np.float32))})
        assert all(m.fields["tables"][0].get("pulled") for m in sent[0].values())
        after = client.pull_rows({"users": a}, read=True)["users"]
        np.testing.assert_allclose(after, before - LR, rtol=1e-6, atol=1e-6)


def raw_named(client: ParameterClient, shard: int, rows: np.ndarray, **fields: object) -> None:
    """A push_pull of ``rows`` naming a pull, built by hand as a hostile or buggy peer would send it."""
    grad = np.zeros(client.shards[shard].size, np.float32)
    message = client.message("push_pull", [grad, rows], version=0, seq=20_000, epoch=0, **fields)
    message.fields["tables"] = [{"table": "users", "push": True, "pulled": True}]
    reply = client.request({shard: message}, "a raw push")[shard]
    raise AssertionError(f"accepted: {reply.op}")


def test_a_push_naming_a_pull_the_shard_does_not_hold_for_it_is_refused_and_changes_nothing() -> None:
    a = on_each_shard(2)
    mine = a[shard_of_ids(USERS, a, 2) == 0]
    ones = np.ones((len(mine), 4), np.float32)
    with job(rule=SGD(lr=LR), workers=2) as (chief, other):
        with sent_by(chief) as sent:
            chief.push_pull(pull={"users": a})
        rid = sent[0][0].rid
        before, version = chief.pull_rows({"users": a}, read=True)["users"], chief.pull()
        with pytest.raises(RemoteError, match="does not hold"):
            raw_named(other, 0, ones, pulled=rid)  # another worker naming the chief's pull
        with pytest.raises(RemoteError, match="does not hold"):
            raw_named(chief, 0, ones, pulled=rid + 1000)  # a pull it never made
        with pytest.raises(RemoteError, match="no pulled field"):
            raw_named(chief, 0, ones)
        with pytest.raises(RemoteError, match="expected float32"):
            raw_named(chief, 0, ones[:1], pulled=rid)  # rows for fewer ids than it pulled
        np.testing.assert_array_equal(chief.pull_rows({"users": a}, read=True)["users"], before)
        assert chief.pull() == version  # nothing applied


def test_over_inproc_frames_the_ps_keeps_the_clients_own_copy_of_pulled_ids_not_the_callers_array() -> None:
    """inproc ZeroMQ hands big frames over without a copy: the ids a shard keeps for a push to name must be
    the client's own copy, or a caller rewriting its array after the pull moves the rows of other ids."""
    big = TableSpec("big", dim=4, capacity=100_000, seed=7, sharding="range")
    with running_ps(1, scheme="inproc", shared_memory=False) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            assert client.initialize(DENSE, JobSpec(SyncSpec("async").resolved(1), 1000, 1), SGD(lr=1.0),
                                     tables=(big,))  # fmt: skip
            client.pull()
            ids = np.arange(0, 20_000, dtype=np.int64) * 2  # 160 KB: a frame ZeroMQ does not copy
            client.push_pull(pull={"big": ids})
            pulled = ids.copy()
            ids += 1  # the caller reuses its array for the next batch's ids
            client.pull_rows({"big": ids})  # their rows exist
            both = np.concatenate([pulled, ids])
            before = client.pull_rows({"big": both}, read=True)["big"]
            client.push_pull(rows={"big": (pulled, np.ones((len(pulled), 4), np.float32))})
            moved = client.pull_rows({"big": both}, read=True)["big"] - before
            np.testing.assert_allclose(moved[: len(pulled)], -1.0, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(moved[len(pulled) :], 0.0, rtol=1e-6, atol=1e-6)
        finally:
            client.close()


def test_a_recovery_outside_a_step_forgets_the_pull_the_next_push_would_have_named() -> None:
    """The chief recovers from a lost ps while checkpointing (not in a step): the restarted shard never saw
    the last step's pull, so the next push sends its ids, and every shard applies it."""
    options = ClientOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5,
                            request_timeout_s=10.0, init_timeout_s=10.0), recovery_timeout_s=20.0)  # fmt: skip
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5)), context=zmq.Context()
    )
    shards = [Shard(transport, 0), Shard(transport, 1)]
    client = ParameterClient(transport, ClusterSpec({"ps": [s.address for s in shards], "worker": ["localhost"]}), 0,
                             options)  # fmt: skip
    try:
        assert client.initialize(DENSE, JobSpec(SyncSpec("async").resolved(1), 1000, 1), SGD(lr=LR), tables=(USERS,))
        client.pull()
        a = on_each_shard(3)
        client.push_pull(pull={"users": a})
        address = shards[1].address
        shards[1].kill()
        shards[1] = Shard(transport, 1, address)  # lost and started again, empty
        assert shards[0].server.shard.named_pulls.kept  # the live shard holds the step's pull ...
        client.recover("ps 1 was lost during a checkpoint")  # as the chief's save_checkpoint does
        assert not shards[0].server.shard.named_pulls.kept  # ... and forgets it when the chief restores it
        before = client.pull_rows({"users": a})["users"]  # the restored job's rows of a (a plain pull)
        with sent_by(client) as sent:
            client.push_pull(rows={"users": (a, np.ones((len(a), 4), np.float32))})
        assert all("pulled" not in m.fields for m in sent[0].values())
        after = client.pull_rows({"users": a}, read=True)["users"]
        np.testing.assert_allclose(after, before - LR, rtol=1e-6, atol=1e-6)
    finally:
        client.close()
        for shard in shards:
            shard.kill()
        transport.context.destroy(linger=0)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_dead_processs_push_answered_late_leaves_its_replacements_named_pull() -> None:
    """Sync mode: a worker's push waits in the round, its process dies, a new one steps (dropped: that version
    waits already) and pulls; the round closes and answers the dead process's push. The shard keeps the new
    process's pull, so the new process's next push, naming it, is applied."""
    a = on_each_shard(3)
    with running_ps(2, heartbeat_timeout_s=1.0) as ps:
        chief = ParameterClient(ps.transport, ps.cluster(2), 0, FAST)
        old = ParameterClient(ps.transport, ps.cluster(2), 1, FAST)
        new: ParameterClient | None = None
        try:
            assert chief.initialize(DENSE, JobSpec(SyncSpec("sync").resolved(2), 1000, 2), SGD(lr=LR), tables=(USERS,))
            old.wait_initialized()
            old.pull()
            chief.pull()
            old.start_push_pull(pull={"users": a})  # version 0's push of worker 1: it waits in the round
            wait_for(lambda: all(s.shard._pushes_waiting(1) == 1 for s in ps.servers), "the push to wait")
            old.close()  # ... and its process dies
            wait_for(lambda: all(s.membership.gone(1, time.monotonic()) for s in ps.servers), "worker 1 gone")
            new = ParameterClient(ps.transport, ps.cluster(2), 1, FAST)
            new.wait_initialized()
            new.pull()
            assert new.push_pull(pull={"users": a}).outcome == "dropped"  # version 0 waits already; rows pulled
            chief.push_pull(pull={"users": a})  # closes the round: the dead process's push is answered too
            with sent_by(new) as sent:
                new.push_pull(rows={"users": (a, np.ones((len(a), 4), np.float32))})
            assert all(m.fields["tables"][0].get("pulled") for m in sent[0].values())
        finally:
            chief.close()
            if new is not None:
                new.close()


@pytest.mark.parametrize("scheme", ["inproc", "tcp"])
def test_a_shard_that_no_longer_holds_the_named_pull_is_sent_the_push_again_with_its_ids(scheme: str) -> None:
    """Shard 1 loses what it kept of the step's pull (as no known path does): it refuses the named push,
    applying nothing, while shard 0 applies its part; the client sends shard 1 the same push (same seq) with
    its ids, and every row moves once."""
    a = on_each_shard(3)
    grads = np.arange(len(a) * 4, dtype=np.float32).reshape(-1, 4) / 10
    with running_ps(2, scheme=scheme) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            assert client.initialize(DENSE, JobSpec(SyncSpec("async").resolved(1), 1000, 1), SGD(lr=LR),
                                     tables=(USERS,))  # fmt: skip
            client.pull()
            client.push_pull(pull={"users": a})
            before, version = client.pull_rows({"users": a}, read=True)["users"], client.pull()
            ps.servers[1].shard.named_pulls.kept.clear()  # the ps is idle: the client waits for nothing
            with sent_by(client) as sent:
                client.push_pull(rows={"users": (a, grads)})
            assert [sorted(step) for step in sent] == [[0, 1], [1]]  # shard 1 was sent the push again
            first, again = sent[0][1], sent[1][1]
            assert first.fields["tables"][0].get("pulled") and "pulled" not in again.fields
            assert again.fields["tables"] == [{"table": "users", "push": True}]
            assert again.fields["seq"] == first.fields["seq"] and again.fields["version"] == first.fields["version"]
            np.testing.assert_array_equal(again.arrays[1], a[shard_of_ids(USERS, a, 2) == 1])  # its ids
            after = client.pull_rows({"users": a}, read=True)["users"]
            np.testing.assert_allclose(after, before - LR * grads, rtol=1e-6, atol=1e-6)  # each row moved once
            assert client.pull() == version + 1
        finally:
            client.close()


def test_one_push_and_pull_at_a_time_each_finished_once() -> None:
    """Two in flight would take each other's row plans (the next push names the wrong pulls): refused."""
    with job(rule=SGD(lr=LR)) as (client,):
        pending = client.start_push_pull(pull={"users": on_each_shard(2)})
        with pytest.raises(PsdkError, match="in flight"):
            client.start_push_pull()
        client.finish_push_pull(pending)
        with pytest.raises(PsdkError, match="started last, once"):
            client.finish_push_pull(pending)
        client.finish_push_pull(client.start_push_pull())  # and the next one goes


def test_rows_written_in_the_lent_room_go_again_with_their_ids_after_a_refused_name() -> None:
    """One shard holds every id (a range table): the rows lie in the room lent to it (shared memory), and the
    push sent again carries them with the ids laid beside them, not over them."""
    big = TableSpec("big", dim=4, capacity=100_000, seed=7, sharding="range")
    with running_ps(1, scheme="tcp") as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            assert client.initialize(DENSE, JobSpec(SyncSpec("async").resolved(1), 1000, 1), SGD(lr=1.0),
                                     tables=(big,))  # fmt: skip
            client.pull()
            ids = np.arange(0, 20_000, dtype=np.int64) * 2
            client.push_pull(pull={"big": ids})
            before = client.pull_rows({"big": ids}, read=True)["big"]
            room = client.row_room("big", ids)
            assert room.base is not None  # lent memory, not a private array
            room[:] = np.arange(len(ids) * 4, dtype=np.float32).reshape(-1, 4) / 1000
            expected = before - room
            ps.servers[0].shard.named_pulls.kept.clear()
            with sent_by(client) as sent:
                client.push_pull(rows={"big": (ids, room)})
            assert len(sent) == 2 and sent[1][0].fields["tables"] == [{"table": "big", "push": True}]
            after = client.pull_rows({"big": ids}, read=True)["big"]
            np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-6)
        finally:
            client.close()


def test_a_push_sent_again_after_the_steps_wait_timed_out_in_a_sync_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync mode: worker 0's push waits in shard 0's round past its request timeout while shard 1 refused the pull
    it named. Worker 1 pushes once worker 0's wait gave up: the round closes and its reply reaches worker 0 while
    it asks the shards' status; it is kept for the step, and shard 1 is sent the push again with its ids, as the
    first wait would have. Both workers' steps land on both shards."""
    a = on_each_shard(3)
    options = ClientOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0,
                            request_timeout_s=1.0, init_timeout_s=20.0), recovery_timeout_s=20.0)  # fmt: skip
    ones = np.ones((len(a), 4), np.float32)
    real_after_timeout = recovery.after_timeout
    with running_ps(2) as ps:
        clients = [ParameterClient(ps.transport, ps.cluster(2), i, options) for i in range(2)]
        second: list[threading.Thread] = []

        def after_timeout(*args):  # type: ignore[no-untyped-def]
            """Worker 0's wait gave up: worker 1 pushes, and shard 0 answers both before the status check."""
            second.append(threading.Thread(target=clients[1].push_pull, kwargs={"rows": {"users": (a, ones)}}))
            second[0].start()
            wait_for(lambda: ps.servers[0].shard.store.version == version + 1, "shard 0's round to close")
            return real_after_timeout(*args)

        try:
            spec = JobSpec(SyncSpec("sync").resolved(2), 1000, 2)
            assert clients[0].initialize(DENSE, spec, SGD(lr=LR), tables=(USERS,))
            clients[1].wait_initialized()
            for client in clients:
                client.pull()
            first = [threading.Thread(target=c.push_pull, kwargs={"pull": {"users": a}}) for c in clients]
            for step in first:
                step.start()
            for step in first:
                step.join(timeout=20)
            assert not any(step.is_alive() for step in first)
            before = clients[0].pull_rows({"users": a}, read=True)["users"]
            version = clients[0].pull()
            ps.servers[1].shard.named_pulls.kept.clear()  # every shard idle: both workers' steps answered
            monkeypatch.setattr(recovery, "after_timeout", after_timeout)
            clients[0].push_pull(rows={"users": (a, ones)})
            second[0].join(timeout=30)
            assert not second[0].is_alive()
            after = clients[0].pull_rows({"users": a}, read=True)["users"]
            np.testing.assert_allclose(after, before - LR, rtol=1e-6, atol=1e-6)  # the round's mean, on each shard
            assert clients[0].pull() == version + 1
        finally:
            for client in clients:
                client.close()
