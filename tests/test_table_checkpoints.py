"""Embedding tables in checkpoints: read in chunks while paused, streamed into the file, restored and re-sharded.

Real ps threads over ZeroMQ, real clients. Each table's state is compared
row by row, slot by slot, against what the ps held when the checkpoint was
taken (read from the ps threads' own tables), on the same number of ps and
on others; each refused chunk is shown to leave the table as it was.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from psdk.client import ClientOptions, ParameterClient
from psdk.client import checkpoint as ckpt
from psdk.client.cut import checkpoint_cut
from psdk.client.layout import init_requests
from psdk.config.options import TransportOptions
from psdk.errors import CheckpointAbandoned, ConfigError, DataError, PeerTimeoutError, PsdkError, RemoteError
from psdk.protocol.chunks import SKETCH_PIECE_MIN
from psdk.protocol.cluster import ClusterSpec
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec, shard_of_ids
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import Adagrad
from psdk.ps.server import ParameterServer
from psdk.transport.wire import MAX_HEADER_BYTES, Message
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import PsCluster, running_ps
from .test_recovery import Shard

pytestmark = pytest.mark.timeout(90)

FAST = ClientOptions(
    transport=TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0, request_timeout_s=20.0, init_timeout_s=20.0
    ),
    table_chunk_rows=64,
)
DENSE = {"w": np.zeros((2, 3), np.float32)}
RULE = Adagrad(lr=0.2, initial_accumulator_value=0.1, eps=0.0)
USERS = TableSpec("users", dim=4, capacity=20_000, seed=7, max_ids=2048)
ITEMS = TableSpec("items/v1", dim=3, capacity=600, admit_after=2, seed=3, sharding="range", max_ids=64)
TABLES = (USERS, ITEMS)
Held = dict[int, tuple[np.ndarray, np.ndarray, int]]
"""id -> (row, Adagrad sum, the shard holding it)."""
Original = tuple[Path, dict[str, Held]]


def job_spec(workers: int = 1) -> JobSpec:
    return JobSpec(SyncSpec("async").resolved(workers), 10_000, workers)


@contextmanager
def chief(
    num_ps: int, restore: ckpt.Checkpoint | None = None, options: ClientOptions = FAST, workers: int = 1
) -> Iterator[tuple[PsCluster, ParameterClient]]:
    with running_ps(num_ps) as ps:
        client = ParameterClient(ps.transport, ps.cluster(workers), 0, options)
        try:
            assert client.initialize(DENSE, job_spec(workers), RULE, restore=restore, tables=TABLES)
            client.pull()
            yield ps, client
        finally:
            client.close()


def held_state(servers: list[ParameterServer], name: str) -> Held:
    """Every row the ps threads hold of table ``name``: id -> (row, accumulator, stamp shard)."""
    found: Held = {}
    for server in servers:
        state = server.store.tables[name].rows.state()
        for i, row_id in enumerate(state["ids"].tolist()):
            assert row_id not in found, f"id {row_id} is on two shards"
            found[row_id] = (state["rows"][i], state["slot.sum"][i], server.task_index)
    return found


def train(client: ParameterClient, steps: int, rng: np.random.Generator) -> None:
    """Pushes of rows of both tables: each step pulls its ids (creating rows), then pushes their gradients."""
    for _ in range(steps):
        users = rng.integers(0, 1 << 40, 2000)
        items = rng.integers(0, 600, 50)
        client.pull_rows({"users": users, "items/v1": items})
        grads = {
            "users": (users, rng.normal(size=(2000, 4)).astype(np.float32)),
            "items/v1": (items, rng.normal(size=(50, 3)).astype(np.float32)),
        }
        client.push_pull(rows=grads)


def saved(client: ParameterClient, folder: Path) -> Path:
    state = client.checkpoint_state(folder=folder)
    return ckpt.save(state, ckpt.path_for(folder, state.global_step, "run"))


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Original:
    """A checkpoint of a trained job on 2 ps, and what the ps held of each table when it was taken."""
    folder = tmp_path_factory.mktemp("ckpt")
    with chief(2) as (ps, client):
        train(client, 4, np.random.default_rng(0))
        path = saved(client, folder)
        held = {spec.name: held_state(ps.servers, spec.name) for spec in TABLES}
        assert not list(folder.glob(".*.tmp")), "the temporary file was renamed into place"
    return path, held


def test_a_checkpoint_holds_every_row_and_slot_in_chunks_no_bigger_than_asked(original: Original) -> None:
    path, held = original
    loaded = ckpt.load(path)
    assert loaded.tables is not None and sorted(loaded.tables.names) == ["items/v1", "users"]
    assert loaded.global_step == 4
    assert len(held["users"]) > 10 * FAST.table_chunk_rows and len(held["items/v1"]) > 0
    for name, rows in held.items():
        seen: Held = {}
        for shard, chunk in loaded.tables.rows(name):
            assert len(chunk["ids"]) <= FAST.table_chunk_rows  # no chunk (so no message) holds a whole table
            for i, row_id in enumerate(chunk["ids"].tolist()):
                seen[row_id] = (chunk["rows"][i], chunk["slot.sum"][i], shard)
        assert seen.keys() == rows.keys()
        for row_id, (row, accum, shard) in rows.items():
            np.testing.assert_array_equal(seen[row_id][0], row)
            np.testing.assert_array_equal(seen[row_id][1], accum)
            assert seen[row_id][2] == shard
    with zipfile.ZipFile(path) as archive:  # framework-neutral: plain .npy entries by table name
        assert "tables/users/0/ids.npy" in archive.namelist() and "params/w.npy" in archive.namelist()
    with np.load(path) as data:
        assert data["params/w"].shape == (2, 3)


@pytest.mark.parametrize("num_ps", [2, 3, 1])
def test_resume_gives_every_id_its_row_and_slots_on_any_number_of_ps(original: Original, num_ps: int) -> None:
    path, held = original
    with chief(num_ps, restore=ckpt.load(path)) as (ps, client):
        assert client.global_step == 4
        for spec in TABLES:
            now = held_state(ps.servers, spec.name)
            assert now.keys() == held[spec.name].keys()
            ids = np.array(sorted(now), np.int64)
            where = shard_of_ids(spec, ids, num_ps)
            for row_id, shard in zip(ids.tolist(), where.tolist(), strict=True):
                row, accum, on = now[row_id]
                assert on == shard, "each row went to its shard under the new placement"
                np.testing.assert_array_equal(row, held[spec.name][row_id][0])
                np.testing.assert_array_equal(accum, held[spec.name][row_id][1])
            parts = [client.pull_rows({spec.name: ids[i : i + 1000]}, read=True) for i in range(0, len(ids), 1000)]
            pulled = np.concatenate([part[spec.name] for part in parts])
            np.testing.assert_array_equal(pulled, np.stack([held[spec.name][i][0] for i in ids.tolist()]))
        stats = [s["tables"]["users"] for s in client.stats()]
        assert sum(s["rows"] for s in stats) == len(held["users"])
        train(client, 1, np.random.default_rng(1))  # and the job trains on


def test_admission_counts_survive_a_resume_on_another_number_of_ps(tmp_path: Path) -> None:
    with chief(2) as (ps, client):
        client.pull_rows({"items/v1": [5, 77, 300]})  # seen once: admit_after=2, no rows yet
        path = saved(client, tmp_path)
    for num_ps in (2, 3):
        with chief(num_ps, restore=ckpt.load(path)) as (ps, client):
            assert held_state(ps.servers, "items/v1") == {}
            client.pull_rows({"items/v1": [5, 77, 301]})  # the second time for 5 and 77
            assert sorted(held_state(ps.servers, "items/v1")) == [5, 77]


def test_the_ps_takes_restore_messages_of_a_chunk_not_of_a_table(original: Original) -> None:
    path, held = original
    options = dataclasses.replace(FAST, table_chunk_rows=16)
    with chief(3, restore=ckpt.load(path), options=options) as (ps, _):
        table_bytes = len(held["users"]) * 4 * (4 + 4 + 3)  # rows, accumulators, ids and stamps
        for server in ps.servers:  # restored: back to what a push needs
            assert server.endpoint.max_message_bytes == server.shard.largest_message_bytes() < table_bytes / 2
        assert held_state(ps.servers, "users").keys() == held["users"].keys()  # saved in chunks of 64, sent in 16s


def announce(
    client: ParameterClient, names: tuple[str, ...] = ("users",), chunk_rows: int = 8, workers: int = 1
) -> None:
    """The chief's init of a resume that restores ``names``, without the chunks: the restore waits for them."""
    start = ckpt.Checkpoint(0, dict(DENSE), {"sum": {"w": np.full((2, 3), 0.1, np.float32)}}, RULE.to_json())
    messages = init_requests(client.message, DENSE, job_spec(workers), RULE, 2, "round_robin", start, 0, TABLES)
    for message in messages.values():
        message.fields["restore"].update(tables=list(names), chunk_rows=chunk_rows)
    client._set_layout(client.request(messages, "init"))


def rows_chunk(client: ParameterClient, ids: list[int], number: int, dtype: type = np.float32) -> RemoteError | dict:
    arrays = [
        np.array(ids, np.int64),
        np.ones((len(ids), 4), dtype),
        np.zeros(len(ids), np.int32),  # uint32 stamps travel as int32 bits
        np.full((len(ids), 4), 0.5, np.float32),
    ]
    message = client.message("table_restore", arrays, table="users", part="rows", chunk=number, slots=["sum"])
    try:
        return client.request({1: message}, "a chunk")[1].fields
    except RemoteError as exc:
        return exc


def commit(client: ParameterClient, rows: int) -> RemoteError | dict:
    message = client.message("table_restore", table="users", part="commit", chunk=99, counters=[5, 0, rows, rows])
    try:
        return client.request({1: message}, "a commit")[1].fields
    except RemoteError as exc:
        return exc


def test_bad_chunks_are_refused_retries_are_safe_and_nothing_changes_before_the_commit() -> None:
    ids = [int(i) for i in range(1000) if shard_of_ids(USERS, np.array([i]), 2)[0] == 1][:12]
    with running_ps(2) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            announce(client, ("users", "items/v1"))
            table = ps.servers[1].store.tables["users"].rows
            # The cap follows the chunk (here a sketch piece of items), not the table (880 kB at capacity).
            assert ps.servers[1].endpoint.max_message_bytes == 4 * SKETCH_PIECE_MIN + MAX_HEADER_BYTES
            refused = [
                rows_chunk(client, ids[:3], 0, np.float64),  # rows of another dtype
                rows_chunk(client, [ids[1], ids[0]], 0),  # not strictly increasing
                rows_chunk(client, [ids[0], ids[0]], 0),  # repeated in the chunk
                rows_chunk(client, ids[:9], 0),  # more than chunk_rows=8
                rows_chunk(client, [i for i in range(40) if i not in ids][:2], 0),  # ids of shard 0
            ]
            assert all(isinstance(r, RemoteError) and r.kind == "rejected" for r in refused), refused
            assert "float32" in str(refused[0]) and "strictly increasing" in str(refused[1])
            first = rows_chunk(client, ids[:4], 0)
            assert first == {"table": "users", "chunk": 0, "again": False, "committed": False, "rows": 4}
            again = rows_chunk(client, ids[:4], 0)  # a retry: acknowledged, not loaded twice
            assert isinstance(again, dict) and again["again"] and again["rows"] == 4
            repeat = rows_chunk(client, ids[2:6], 1)  # ids 2 and 3 came in chunk 0
            assert isinstance(repeat, RemoteError) and "repeats ids" in str(repeat)
            assert len(table) == 0, "nothing changes before the commit"
            assert client.pull_rows({"users": ids[:4]}, read=True)["users"].tolist() == [[0.0] * 4] * 4
            short = commit(client, 5)  # 4 rows were sent
            assert isinstance(short, RemoteError) and "has 5 rows, the restore got 4" in str(short)
            assert len(table) == 0
            done = commit(client, 4)
            assert isinstance(done, dict) and done["committed"] and len(table) == 4
            np.testing.assert_array_equal(client.pull_rows({"users": ids[:4]}, read=True)["users"], np.ones((4, 4)))
            late = rows_chunk(client, ids[6:8], 2)
            assert isinstance(late, RemoteError) and "not being restored" in str(late)
        finally:
            client.close()


def test_workers_wait_for_the_tables_restore() -> None:
    with running_ps(2) as ps:
        chief_client = ParameterClient(ps.transport, ps.cluster(2), 0, FAST)
        worker = ParameterClient(ps.transport, ps.cluster(2), 1, FAST)
        try:
            announce(chief_client, workers=2)
            with pytest.raises(PeerTimeoutError):  # held: users is not restored yet
                worker.request(worker.to_all("wait_init"), "the layout", timeout_s=0.5, watch=False)
            for shard in (0, 1):
                message = chief_client.message(
                    "table_restore", table="users", part="commit", chunk=0, counters=[0, 0, 0, 0]
                )
                chief_client.request({shard: message}, "a commit")
            worker.wait_initialized()
            assert worker.tables["users"] == USERS
        finally:
            worker.close()
            chief_client.close()


def test_table_state_needs_the_pause() -> None:
    with chief(2) as (_, client):
        message = client.message("table_state", table="users", part="rows", cursor=0, rows=16)
        with pytest.raises(RemoteError) as refused:
            client.request({0: message}, "a chunk")
        assert refused.value.kind == "not_paused"


def test_a_damaged_chunk_makes_the_checkpoint_invalid_and_a_resume_without_its_tables_is_refused(
    original: Original, tmp_path: Path
) -> None:
    path, _ = original
    damaged = tmp_path / path.name
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("tables/users/1/rows.npy")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    data[at] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"CRC|damaged|cannot be read"):  # every table entry's CRC is read
        ckpt.load(damaged)
    assert not ckpt.is_valid(damaged) and ckpt.is_valid(path)  # resume and recovery pass over it
    with running_ps(2) as ps:
        client = ParameterClient(ps.transport, ps.cluster(1), 0, FAST)
        try:
            with pytest.raises(PsdkError, match="does not declare"):
                client.initialize(DENSE, job_spec(), RULE, restore=ckpt.load(path), tables=(USERS,))
            wider = (dataclasses.replace(USERS, dim=8), ITEMS)
            with pytest.raises(PsdkError, match="has dim 4 in the checkpoint but 8 in this job"):
                client.initialize(DENSE, job_spec(), RULE, restore=ckpt.load(path), tables=wider)
            assert not ps.servers[0].store.initialized  # refused before anything was sent
        finally:
            client.close()


def test_the_chunk_size_is_checked() -> None:
    for rows in (0, 1 << 21, 2.5):
        with pytest.raises(ConfigError, match="table_chunk_rows"):
            ClientOptions(table_chunk_rows=rows)  # type: ignore[arg-type]


def test_a_lost_ps_brings_the_tables_back_from_the_last_checkpoint(tmp_path: Path) -> None:
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5)), context=zmq.Context()
    )
    shards = [Shard(transport, 0), Shard(transport, 1)]
    cluster = ClusterSpec({"ps": [s.address for s in shards], "worker": ["localhost"]})
    timeouts = TransportOptions(
        heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5, request_timeout_s=30.0, init_timeout_s=30.0
    )
    options = ClientOptions(transport=timeouts, recovery_timeout_s=30.0, table_chunk_rows=64)
    client = ParameterClient(transport, cluster, 0, options)
    rng = np.random.default_rng(2)
    try:
        assert client.initialize(DENSE, job_spec(), RULE, tables=TABLES)
        client.pull()
        train(client, 3, rng)
        path = saved(client, tmp_path)
        held = {spec.name: held_state([s.server for s in shards], spec.name) for spec in TABLES}
        client.recovery_source = lambda: ckpt.load(path)
        train(client, 2, rng)  # the rows move on past the checkpoint
        assert held_state([s.server for s in shards], "users") != held["users"]
        shards[1].kill()
        shards[1] = Shard(transport, 1, shards[1].address)  # restarted, empty, on the same address
        users = rng.integers(0, 1 << 40, 100)
        result = client.push_pull(rows={"users": (users, np.ones((100, 4), np.float32))})
        assert result.outcome == "resync" and client.recoveries[0]["global_step"] == 3
        for spec in TABLES:
            now = held_state([s.server for s in shards], spec.name)
            assert now.keys() == held[spec.name].keys()
            for row_id, (row, total, shard) in held[spec.name].items():
                np.testing.assert_array_equal(now[row_id][0], row)
                np.testing.assert_array_equal(now[row_id][1], total)
                assert now[row_id][2] == shard
        assert all(not s.server.shard.table_restores for s in shards)
        train(client, 1, rng)  # and the job goes on
    finally:
        client.close()
        for s in shards:
            s.kill()
        transport.context.destroy(linger=0)


class ResumingMidway:
    """The chief's requests, but the shards are resumed right after the first table chunk is read (a lapsed pause)."""

    def __init__(self, client: ParameterClient) -> None:
        self.client, self.names, self.task_index, self.resumed = client, client.names, client.task_index, False

    def message(self, op: str, arrays: list[np.ndarray] | None = None, **fields: Any) -> Message:
        return self.client.message(op, arrays, **fields)

    def to_all(self, op: str, **fields: Any) -> dict[int, Message]:
        return self.client.to_all(op, **fields)

    def request(
        self, messages: Mapping[int, Message], what: str, timeout_s: float | None = None, watch: bool = True
    ) -> dict[int, Message]:
        replies = self.client.request(messages, what, timeout_s, watch)
        if not self.resumed and any(m.op == "table_state" for m in messages.values()):
            self.resumed = True
            self.client.request(self.client.to_all("resume"), "resuming behind the cut's back")
        return replies


def test_a_pause_that_ends_while_the_tables_are_read_skips_the_checkpoint_and_leaves_no_file(tmp_path: Path) -> None:
    with chief(2) as (_, client):
        train(client, 1, np.random.default_rng(3))
        asking = ResumingMidway(client)
        with pytest.raises(CheckpointAbandoned, match="pause ended"):
            checkpoint_cut(asking, client.shards, ["w"], 50, client.tables, tmp_path, 64)
        assert asking.resumed and list(tmp_path.iterdir()) == []
        path = saved(client, tmp_path)  # the next one is written
        assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_export_writes_each_tables_ids_and_rows_for_serving(original: Original, tmp_path: Path) -> None:
    path, held = original
    out = tmp_path / "served"
    run = subprocess.run(
        [sys.executable, "-m", "psdk", "export", str(path), str(out)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for name, rows in held.items():
        assert f"{name}: {len(rows)} rows" in run.stdout
        ids, values = np.load(out / name / "ids.npy"), np.load(out / name / "rows.npy")
        assert sorted(ids.tolist()) == sorted(rows)
        for row_id, row in zip(ids.tolist(), values, strict=True):
            np.testing.assert_array_equal(row, rows[row_id][0])
    refused = subprocess.run(
        [sys.executable, "-m", "psdk", "export", str(path), str(out), "table=nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "holds no table ['nope']" in refused.stderr


def test_a_chief_restarted_in_the_middle_of_a_restore_finishes_it(
    original: Original, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chief dies after some chunks (no commit); the next one's init is "already" and sends the rest."""
    from psdk.client import tablestate

    path, held = original
    sent = [0]
    real_send = tablestate.ChunkSender.send

    def dies_after_two_rounds(self: Any, pieces: Any) -> None:
        sent[0] += 1
        if sent[0] > 2:
            raise ConnectionAbortedError("the chief died in the restore")
        real_send(self, pieces)

    with running_ps(2, heartbeat_timeout_s=1.0, recovery=True) as ps:  # the ps waits for a restarted chief
        first = ParameterClient(ps.transport, ps.cluster(2), 0, FAST)
        monkeypatch.setattr(tablestate.ChunkSender, "send", dies_after_two_rounds)
        with pytest.raises(ConnectionAbortedError):
            first.initialize(DENSE, job_spec(2), RULE, restore=ckpt.load(path), tables=TABLES)
        first.close()
        assert any(server.shard.table_restores for server in ps.servers), "the shards wait for the rest"
        monkeypatch.setattr(tablestate.ChunkSender, "send", real_send)
        second = ParameterClient(ps.transport, ps.cluster(2), 0, FAST)
        try:
            assert not second.initialize(DENSE, job_spec(2), RULE, restore=ckpt.load(path), tables=TABLES)
            assert not any(server.shard.table_restores for server in ps.servers)
            for spec in TABLES:
                now = held_state(ps.servers, spec.name)
                assert now.keys() == held[spec.name].keys()
                for row_id, (row, accum, _) in held[spec.name].items():
                    np.testing.assert_array_equal(now[row_id][0], row)
                    np.testing.assert_array_equal(now[row_id][1], accum)
        finally:
            second.close()
