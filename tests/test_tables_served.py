"""Embedding tables served by real ps shards: pulls by id, pushes of rows, every mode's arithmetic, refusals.

Two ps threads over real ZeroMQ (shared memory on, so the dense part and
the rows travel in the workers' lent memory), real clients. Each
expected value is computed here in numpy from the rule's formula; each
refusal is shown to leave the rows as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from psdk.client import ClientOptions, ParameterClient
from psdk.config.options import TransportOptions
from psdk.errors import NonFiniteError, PsdkError, RemoteError
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adagrad, Adam, UpdateRule
from psdk.ps.tables.hashing import initial_rows, table_key
from psdk.ps.tables.served import ServedTable

from .conftest import running_ps

pytestmark = pytest.mark.timeout(60)

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0, request_timeout_s=20.0, init_timeout_s=20.0
    )
)
DENSE = {"w": np.zeros((2, 3), np.float32)}
"""One dense variable: it lives on ps 0, so ps 1 holds nothing but rows."""
USERS = TableSpec("users", dim=4, capacity=1000, seed=7)


def initial(spec: TableSpec, ids: list[int]) -> np.ndarray:
    return initial_rows(np.array(ids, np.int64), spec.dim, table_key(spec.seed, spec.name), "normal", spec.init_scale)


@contextmanager
def job(
    mode: str = "async", rule: UpdateRule | None = None, tables: tuple[TableSpec, ...] = (USERS,), workers: int = 1
) -> Iterator[list[ParameterClient]]:
    with running_ps(2) as ps:
        clients = [ParameterClient(ps.transport, ps.cluster(workers), i, FAST) for i in range(workers)]
        try:
            spec = JobSpec(SyncSpec(mode).resolved(workers), 1000, workers)
            assert clients[0].initialize(DENSE, spec, rule or SGD(lr=0.5), tables=tables)
            for client in clients[1:]:
                client.wait_initialized()
            for client in clients:
                client.pull()
            yield clients
        finally:
            for client in clients:
                client.close()


def test_rows_start_from_the_seed_and_id_on_whichever_shard_holds_them() -> None:
    ids = [5, 3_000_000_000, 17, 5, 42]
    with job() as (client,):
        assert client.tables == {"users": USERS}
        rows = client.pull_rows({"users": ids})["users"]
        np.testing.assert_array_equal(rows, initial(USERS, ids))
        assert set(shard_of_ids(USERS, np.array(ids, np.int64), 2).tolist()) == {0, 1}  # both shards serve
        stats = [s["tables"]["users"] for s in client.stats()]
        assert sum(s["rows"] for s in stats) == 4 and all(s["rows"] for s in stats)


def test_a_push_sums_duplicate_ids_and_sgd_moves_only_those_rows() -> None:
    ids = np.array([9, 2, 9, 11], np.int64)
    grads = np.arange(16, dtype=np.float32).reshape(4, 4)
    with job(rule=SGD(lr=0.5)) as (client,):
        before = client.pull_rows({"users": [2, 9, 11, 12]})["users"]
        result = client.push_pull(rows={"users": (ids, grads)}, pull={"users": [2, 9, 11, 12]})
        expected = before.copy()
        expected[0] -= 0.5 * grads[1]
        expected[1] -= 0.5 * (grads[0] + grads[2])
        expected[2] -= 0.5 * grads[3]
        np.testing.assert_allclose(result.rows["users"], expected, rtol=1e-6, atol=1e-7)
        assert result.global_step == 1


def test_sync_rounds_average_rows_over_replicas_to_aggregate() -> None:
    lr = 0.5
    with job("sync", SGD(lr=lr), workers=2) as clients, ThreadPoolExecutor(2) as pool:
        before = clients[0].pull_rows({"users": [1, 2, 3]})["users"]
        g = [np.ones((2, 4), np.float32), np.full((2, 4), 3.0, np.float32)]
        pushes = [{"users": (np.array([1, 2]), g[0])}, {"users": (np.array([2, 3]), g[1])}]
        futures = [
            pool.submit(c.push_pull, None, p, {"users": [1, 2, 3]}) for c, p in zip(clients, pushes, strict=True)
        ]
        results = [f.result(timeout=20) for f in futures]
        expected = before - lr * np.array([[1.0] * 4, [4.0] * 4, [3.0] * 4], np.float32) / 2
        for result in results:
            assert result.outcome == "applied"
            np.testing.assert_allclose(result.rows["users"], expected, rtol=1e-6, atol=1e-7)


def test_adagrad_rows_follow_tf1_with_an_initial_accumulator_and_no_epsilon() -> None:
    rule = Adagrad(lr=0.3, initial_accumulator_value=0.1, eps=0.0)
    with job(rule=rule) as (client,):
        p = client.pull_rows({"users": [4, 8]})["users"].astype(np.float64)
        acc = np.full_like(p, 0.1)
        for step in range(3):
            g = np.full((2, 4), 0.5 + step, np.float32)
            rows = client.push_pull(rows={"users": ([4, 8], g)}, pull={"users": [4, 8]}).rows["users"]
            acc += g.astype(np.float64) ** 2
            p -= 0.3 * g / np.sqrt(acc)  # tf.compat.v1.train.AdagradOptimizer's sparse apply
            np.testing.assert_allclose(rows, p, rtol=1e-5, atol=1e-6)


def test_adam_on_rows_is_lazy_and_counts_the_shards_steps() -> None:
    rule = Adam(lr=0.1)
    with job(rule=rule) as (client,):
        p = client.pull_rows({"users": [1, 2]})["users"].astype(np.float64)
        m, v = np.zeros_like(p), np.zeros_like(p)
        pushes = [[1, 2], [1], [1, 2]]  # row 2 skips the second step: its moments must not decay then
        for t, touched in enumerate(pushes, start=1):
            g = np.full((len(touched), 4), 0.25 * t, np.float32)
            rows = client.push_pull(rows={"users": (touched, g)}, pull={"users": [1, 2]}).rows["users"]
            for k, row in enumerate(touched):
                i = row - 1
                m[i] = 0.9 * m[i] + 0.1 * g[k]
                v[i] = 0.999 * v[i] + 0.001 * g[k].astype(np.float64) ** 2
                p[i] -= 0.1 / (1 - 0.9**t) * m[i] / (np.sqrt(v[i]) / np.sqrt(1 - 0.999**t) + 1e-8)
            np.testing.assert_allclose(rows, p, rtol=1e-5, atol=1e-6)


def test_weight_decay_with_tables_is_refused_at_init() -> None:
    with running_ps(1) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            with pytest.raises(RemoteError, match="weight_decay"):
                client.initialize(DENSE, JobSpec(SyncSpec().resolved(1), 10, 1), SGD(lr=0.1, weight_decay=0.01),
                                  tables=(USERS,))  # fmt: skip
        finally:
            client.close()


def test_a_preallocated_range_table_holds_its_block_on_each_shard() -> None:
    spec = TableSpec("items", dim=2, capacity=11, sharding="range", preallocate=True, seed=1)
    with job(tables=(spec,)) as (client,):
        assert [s["tables"]["items"]["rows"] for s in client.stats()] == [6, 5]
        rows = client.pull_rows({"items": list(range(11))}, read=True)["items"]
        np.testing.assert_array_equal(rows, initial(spec, list(range(11))))
        with pytest.raises(Exception, match=r"0 \.\. 10"):
            client.pull_rows({"items": [11]})


def raw(client: ParameterClient, shard: int, entries: list[dict[str, object]], arrays: list[np.ndarray]) -> None:
    """A push_pull built by hand, as a hostile or buggy peer would send it."""
    grad = np.zeros(client.shards[shard].size, np.float32)
    message = client.message("push_pull", [grad, *arrays], version=0, seq=10_000 + len(arrays), epoch=0)
    message.fields["tables"] = entries
    reply = client.request({shard: message}, "a raw push")[shard]
    raise AssertionError(f"accepted: {reply.op}")


ZEROS = np.zeros((2, 4), np.float32)
BAD_PUSHES: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    "int64": lambda mine: (mine.astype(np.int32), ZEROS),
    "strictly increasing": lambda mine: (mine[::-1].copy(), ZEROS),
    "strictly increasing (a duplicate)": lambda mine: (mine[[0, 0]], ZEROS),
    "non-negative": lambda mine: (np.array([-1, mine[0]], np.int64), ZEROS),
    "expected float32": lambda mine: (mine, np.zeros((2, 3), np.float32)),
    "NaN": lambda mine: (mine, np.array([[np.nan] * 4, [0.0] * 4], np.float32)),
    "max_ids": lambda mine: (np.arange(70_000, dtype=np.int64), np.zeros((70_000, 4), np.float32)),
}


@pytest.mark.parametrize("problem", list(BAD_PUSHES))
def test_bad_row_pushes_are_refused_and_change_nothing(problem: str) -> None:
    with job() as (client,):
        mine = np.array([i for i in range(200) if shard_of_ids(USERS, np.array([i]), 2)[0] == 0][:2], np.int64)
        before = client.pull_rows({"users": mine})["users"]
        ids, rows = BAD_PUSHES[problem](mine)
        with pytest.raises(RemoteError, match=problem.split(" (")[0]):
            raw(client, 0, [{"table": "users", "push": True}], [ids, rows])
        np.testing.assert_array_equal(client.pull_rows({"users": mine})["users"], before)
        assert client.pull() == 0


def test_ids_of_another_shard_and_unknown_tables_are_refused() -> None:
    with job() as (client,):
        theirs = np.array([i for i in range(200) if shard_of_ids(USERS, np.array([i]), 2)[0] == 1][:3], np.int64)
        with pytest.raises(RemoteError, match="another shard"):
            raw(client, 0, [{"table": "users", "pull": True}], [theirs])
        with pytest.raises(RemoteError, match="no table 'items'"):
            raw(client, 0, [{"table": "items", "pull": True}], [theirs])
        with pytest.raises(RemoteError, match="array frames more than"):
            raw(client, 0, [], [theirs])


def test_admission_counts_pulls_and_drops_updates_of_rows_not_admitted() -> None:
    spec = TableSpec("users", dim=4, capacity=1000, seed=7, admit_after=2)
    with job(rule=SGD(lr=0.5), tables=(spec,)) as (client,):
        assert not client.pull_rows({"users": [8]})["users"].any()  # pulled once: reads zeros, no row
        result = client.push_pull(rows={"users": ([8], np.ones((1, 4), np.float32))}, pull={"users": [8]})
        np.testing.assert_array_equal(result.rows["users"], initial(spec, [8]))  # second pull: admitted, untouched
        stats = {k: sum(s["tables"]["users"][k] for s in client.stats()) for k in ("rows", "dropped_rows")}
        assert stats == {"rows": 1, "dropped_rows": 1}


def test_a_capped_table_evicts_the_least_recently_pulled_rows() -> None:
    spec = TableSpec("users", dim=2, capacity=4, seed=7, sharding="range")  # 2 rows per shard: ids 0-1 and 2-3
    with job(tables=(spec,)) as (client,):
        client.pull_rows({"users": [0, 1]})
        client.push_pull(rows={"users": ([0, 1], np.ones((2, 2), np.float32))})
        client.pull_rows({"users": [1]})
        assert [s["tables"]["users"]["evicted"] for s in client.stats()] == [0, 0]
        rows = client.pull_rows({"users": [0, 1]}, read=True)["users"]
        np.testing.assert_allclose(rows, initial(spec, [0, 1]) - 0.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_two_workers_train_rows_in_async_and_ssp_modes(mode: str) -> None:
    lr = 0.5
    with job(mode, SGD(lr=lr), workers=2) as clients, ThreadPoolExecutor(2) as pool:
        before = clients[0].pull_rows({"users": [1, 2]})["users"]
        ones = np.ones((1, 4), np.float32)
        for _ in range(3):  # ssp with staleness 0 holds each reply until the other worker pushed too
            futures = [pool.submit(c.push_pull, None, {"users": ([1 + k], ones)}) for k, c in enumerate(clients)]
            for future in futures:
                future.result(timeout=20)
        rows = clients[1].pull_rows({"users": [1, 2]}, read=True)["users"]
        np.testing.assert_allclose(rows, before - lr * 3, rtol=1e-6, atol=1e-6)
        assert clients[0].pull() == 6


def test_a_round_keeps_its_own_copy_of_rows_the_worker_lent_in_shared_memory() -> None:
    """Rows pushed through a worker's memory are read in place; a sync round that holds them past the
    push copies them first, so whatever that memory holds later (an abandoned request's retry) is not summed."""
    lr = 0.5
    with running_ps(2) as ps, ThreadPoolExecutor(1) as pool:
        clients = [ParameterClient(ps.transport, ps.cluster(2), i, FAST) for i in range(2)]
        try:
            assert clients[0].initialize(DENSE, JobSpec(SyncSpec("sync").resolved(2), 1000, 2), SGD(lr=lr),
                                         tables=(USERS,))  # fmt: skip
            clients[1].wait_initialized()
            for client in clients:
                client.pull()
            before = clients[0].pull_rows({"users": [1, 2, 3]})["users"]
            first = pool.submit(clients[0].push_pull, None, {"users": ([1, 2], np.ones((2, 4), np.float32))})
            deadline = time.monotonic() + 20
            while not all(server.policy and server.policy.parked() for server in ps.servers):  # both rounds wait
                assert time.monotonic() < deadline and not first.done()
                time.sleep(0.01)
            heaps = [lent.memory._views.up for lent in clients[0].endpoint.links.by_index.values()]
            assert heaps and all(heap is not None for heap in heaps)  # the rows did cross its memory
            for heap in heaps:
                heap._data.view(np.float32)[:] = 1000.0  # what the worker's memory holds from now on
            second = clients[1].push_pull(rows={"users": ([2, 3], np.full((2, 4), 3.0, np.float32))})
            assert first.result(timeout=20).outcome == second.outcome == "applied"
            after = clients[0].pull_rows({"users": [1, 2, 3]})["users"]
            expected = before - lr * np.array([[1.0] * 4, [4.0] * 4, [3.0] * 4], np.float32) / 2
            np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-7)
        finally:
            for client in clients:
                client.close()


def test_a_push_held_by_a_checkpoint_pause_keeps_its_own_copy_of_lent_rows() -> None:
    """A pause holds a push past the moment its rows were read in place: they are copied, as its gradient is."""
    lr = 0.5
    with running_ps(2) as ps, ThreadPoolExecutor(1) as pool:
        clients = [ParameterClient(ps.transport, ps.cluster(2), i, FAST) for i in range(2)]
        try:
            chief, worker = clients
            assert chief.initialize(DENSE, JobSpec(SyncSpec("async").resolved(2), 1000, 2), SGD(lr=lr),
                                    tables=(USERS,))  # fmt: skip
            worker.wait_initialized()
            for client in clients:
                client.pull()
            before = chief.pull_rows({"users": [1, 2]})["users"]
            version = int(chief.status()["version"])
            assert all(
                r.op == "paused" for r in chief.request(chief.to_all("pause_at", version=version), "a pause").values()
            )
            push = pool.submit(worker.push_pull, None, {"users": ([1, 2], np.ones((2, 4), np.float32))})
            deadline = time.monotonic() + 20
            while not all(server.pause.pushes for server in ps.servers):
                assert time.monotonic() < deadline and not push.done()
                time.sleep(0.01)
            heaps = [lent.memory._views.up for lent in worker.endpoint.links.by_index.values()]
            assert heaps and all(heap is not None for heap in heaps)
            for heap in heaps:
                heap._data.view(np.float32)[:] = 1000.0
            chief.request(chief.to_all("resume"), "the end of the pause")
            assert push.result(timeout=20).outcome == "applied"
            after = chief.pull_rows({"users": [1, 2]})["users"]
            np.testing.assert_allclose(after, before - lr, rtol=1e-6, atol=1e-7)
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize("rule", [SGD(lr=0.5), Adagrad(lr=0.3, initial_accumulator_value=0.1, eps=0.0)], ids=str)
def test_rows_that_turn_non_finite_after_their_check_are_refused_by_the_update(rule: UpdateRule) -> None:
    """The ps reads lent row gradients in place: a worker may rewrite them between the check and the update,
    which refuses whatever would leave NaN or Inf in the rows or slots, and changes nothing."""
    table = ServedTable(USERS, 0, 1, rule)
    ids = np.array([1, 2], np.int64)
    before = table.pull(ids).copy()
    rows = np.ones((2, 4), np.float32)
    grad = table.check_grad(ids, rows)
    rows[1, 3] = np.inf  # rewritten in the worker's memory after the check
    with pytest.raises(NonFiniteError, match="would leave NaN or Inf"):
        table.stage_update(grad, rule, 1)
    np.testing.assert_array_equal(table.pull(ids, create=False), before)


def test_rows_written_in_their_room_are_pushed_from_the_memory_lent_to_the_ps_that_holds_them() -> None:
    """``row_room``: ids one ps holds get room in the memory lent to it (the push copies no row); ids of two
    shards a private array. Either way the push applies just what was written."""
    items = TableSpec("items", dim=4, capacity=1000, seed=7, sharding="range")  # ps 0: ids 0..499, ps 1: 500..
    one, two = np.array([3, 7, 40], np.int64), np.array([3, 700], np.int64)
    with job(rule=SGD(lr=0.5), tables=(items,)) as (client,):
        before = client.pull_rows({"items": [3, 7, 40, 700]})["items"]
        client.status()  # the ps's answer to the offer of shared memory is in
        heap = client.endpoint.links.by_index[0].memory._views.up  # type: ignore[attr-defined]
        room = client.row_room("items", one)
        assert room.shape == (3, 4) and room.dtype == np.float32 and np.shares_memory(room, heap._data)
        room[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
        client.push_pull(rows={"items": (one, room)}, pull={"items": two})
        spread = client.row_room("items", two)
        assert spread.flags.owndata and spread.shape == (2, 4)
        spread[...] = 1.0
        after = client.push_pull(rows={"items": (two, spread)}, pull={"items": [3, 7, 40, 700]}).rows["items"]
        expected = before - 0.5 * np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0] * 4], np.float32)
        expected[[0, 3]] -= 0.5
        np.testing.assert_allclose(after, expected, rtol=1e-6, atol=1e-6)
        with pytest.raises(PsdkError, match="no table 'users'"):
            client.row_room("users", one)


def test_rooms_a_push_did_not_send_end_with_it_and_never_lie_under_the_next_pushs() -> None:
    """Rows of unsorted ids are pushed from a sorted copy, not from their room: the next push's two rooms must
    still be apart, each table's rows its own."""
    a = TableSpec("a", dim=32, capacity=1000, seed=1, sharding="range", max_ids=64)
    b = TableSpec("b", dim=64, capacity=1000, seed=2, sharding="range", max_ids=64)
    ids = np.arange(3, 3 + 3 * 64, 3, dtype=np.int64)  # 64 ids, all on ps 0
    with job(rule=SGD(lr=1.0), tables=(a, b)) as (client,):
        before = client.pull_rows({"a": ids, "b": ids})
        client.status()  # the ps's answer to the offer of shared memory is in
        room = client.row_room("a", ids[::-1])  # lent (its ends are ps 0's), then pushed from a sorted copy
        room[...] = 0.5
        client.push_pull(rows={"a": (ids[::-1], room)})
        rows_a, rows_b = client.row_room("a", ids), client.row_room("b", ids)
        heap = client.endpoint.links.by_index[0].memory._views.up  # type: ignore[attr-defined]
        assert np.shares_memory(rows_a, heap._data) and np.shares_memory(rows_b, heap._data)
        assert not np.shares_memory(rows_a, rows_b)
        rows_a[...], rows_b[...] = 1.0, 0.0
        after = client.push_pull(rows={"a": (ids, rows_a), "b": (ids, rows_b)}, pull={"a": ids, "b": ids}).rows
        np.testing.assert_allclose(after["a"], before["a"] - 1.5, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(after["b"], before["b"], rtol=1e-6, atol=1e-6)
