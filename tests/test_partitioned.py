"""Partitioned dense variables: one variable split across ps shards, seen whole by every worker."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from hydra import compose

import psdk
from psdk.client import checkpoint
from psdk.client.partitions import Joined, join_arrays, split_arrays
from psdk.config import capacity
from psdk.config.options import TransportOptions, options_from
from psdk.errors import ConfigError, PsdkError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.protocol.cluster import Topology
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.partitions import Partitioning, expand, groups, part_rows, part_shapes
from psdk.protocol.sharding import assign_shards, largest_message_bytes, shard_sizes
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adam
from psdk.transport.zeromq import ZmqOptions, ZmqTransport

from .conftest import running_ps
from .helpers import forward_backward, train_threads
from .jobs import FAST_FLAGS, test_accuracy
from .jobs import psdk as run_psdk
from .test_recovery import OPTIONS, Shard

pytestmark = pytest.mark.timeout(120)

MLP = ModelSpec(hidden=(100,), input_dim=784, num_classes=10)
"""The MNIST MLP: hidden1/kernel (784x100) is 98.6% of it."""
SPLIT = Partitioning(min_bytes=256 * 1024)  # min_max_variable_partitioner's default min_slice_size
SMALL = ModelSpec(hidden=(16,), input_dim=32, num_classes=10)
RNG = np.random.default_rng(11)
X = RNG.random((60, 2, 10, 32), dtype=np.float32)  # global step, worker, batch, features
Y = RNG.integers(0, 10, (60, 2, 10))


def by_step(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    return X[step % 60, worker], Y[step % 60, worker]


def test_rows_are_dealt_as_tensorflow_deals_them() -> None:
    assert part_rows(10, 3) == [4, 3, 3]
    assert part_rows(5, 3) == [2, 2, 1]
    assert part_rows(6, 6) == [1] * 6
    assert part_shapes((784, 100), 2) == [(392, 100), (392, 100)]
    assert part_shapes((7,), 2) == [(4,), (3,)]  # a 1-D variable splits along its only axis
    with pytest.raises(ConfigError, match=r"topology\.partitions.*3 parts of a variable of 2 rows"):
        part_rows(2, 3)
    value = np.arange(70, dtype=np.float32).reshape(10, 7)
    assert [p.shape[0] for p in split_arrays({"w": value}, {"w": 3}).values()] == [4, 3, 3]


def test_the_plan_splits_only_what_is_big_enough_and_caps_parts_by_rows() -> None:
    variables = [("k", (784, 100)), ("b", (100,)), ("tiny", (3,)), ("scalar", ())]
    assert Partitioning().plan(variables, 2) == {}  # off by default
    assert Partitioning(min_bytes=0).plan(variables, 2) == {}  # 0 is off too
    assert SPLIT.plan(variables, 2) == {"k": 2}
    assert Partitioning(min_bytes=1, parts=4).plan(variables, 2) == {"k": 4, "b": 4, "tiny": 3}  # capped; scalar whole
    assert Partitioning(min_bytes=1, parts=1).plan(variables, 2) == {}  # one part is no split
    assert expand(variables, {"k": 2})[:2] == [("k/part_0", (392, 100)), ("k/part_1", (392, 100))]


def test_bad_settings_name_their_key() -> None:
    with pytest.raises(ConfigError, match=r"topology\.partition_min_bytes"):
        Partitioning(min_bytes=-1)
    with pytest.raises(ConfigError, match=r"topology\.partitions"):
        Topology(num_ps=2, partition_min_bytes=1, partitions=0)
    with pytest.raises(ConfigError, match=r"a part's name is also a variable.*'k/part_0'"):
        expand([("k", (4, 2)), ("k/part_0", (2, 2))], {"k": 2})


@pytest.mark.timeout(60)
def test_a_bad_setting_stops_the_run_before_any_task_starts(tmp_path: Path) -> None:
    result = run_psdk("run", "backend=numpy", "topology.partitions=0", out=tmp_path, timeout=50)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "topology.partitions: must be a whole number in [1, " in result.stdout + result.stderr


def test_parts_land_on_different_shards_with_either_strategy() -> None:
    plan = {"big": 3}
    held = expand([("small", (100, 10)), ("big", (9, 1000)), ("b", (10,))], plan)
    for strategy in ("round_robin", "greedy"):
        placement = assign_shards(held, 3, strategy, groups(plan))
        assert len({placement[f"big/part_{i}"] for i in range(3)}) == 3, strategy


def test_each_of_two_ps_holds_about_half_of_the_mnist_mlp() -> None:
    variables = MLP.variables()
    assert shard_sizes(variables, 2) == [79400, 110]  # unpartitioned: hidden1/kernel on ps 0 alone
    for strategy in ("round_robin", "greedy"):
        sizes = shard_sizes(variables, 2, strategy, SPLIT.plan(variables, 2))
        assert sum(sizes) == 79510 and max(sizes) / sum(sizes) < 0.51, (strategy, sizes)
    assert shard_sizes(variables, 2, "round_robin", SPLIT.plan(variables, 2)) == [39310, 40200]


def test_whole_buffers_gather_and_scatter_the_parts() -> None:
    shard_params = {"w/part_0": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    shard_params["w/part_1"] = np.zeros((1, 3), np.float32)
    shard_grads = {n: np.zeros_like(v) for n, v in shard_params.items()}
    joined = Joined({"w": 2}, shard_params, shard_grads)
    assert list(joined.params) == ["w", "b"] and joined.params["w"].shape == (3, 3)
    shard_params["w/part_0"][:] = 1.0
    shard_params["w/part_1"][:] = 2.0
    joined.gather()
    np.testing.assert_array_equal(joined.params["w"][:, 0], [1.0, 1.0, 2.0])
    assert joined.grads["b"] is shard_grads["b"]  # a whole variable keeps its view into the shard's buffer
    joined.grads["w"][:] = np.arange(9, dtype=np.float32).reshape(3, 3)
    joined.scatter()
    np.testing.assert_array_equal(shard_grads["w/part_1"], [[6.0, 7.0, 8.0]])
    assert joined.shapes({"w/part_0": (2, 3), "w/part_1": (1, 3), "b": (3,)}) == {"w": (3, 3), "b": (3,)}
    arrays = {"a": np.ones(2), "w": np.arange(12.0).reshape(4, 3)}
    back = join_arrays(split_arrays(arrays, {"w": 3}), {"w": 3})
    assert list(back) == ["a", "w"] and np.array_equal(back["w"], arrays["w"])


def test_the_plan_travels_in_the_job_spec() -> None:
    job = JobSpec(SyncSpec("async").resolved(2), 10, 2, "run-1", {"hidden1/kernel": 2})
    assert JobSpec.from_json(job.to_json()) == job
    plain = JobSpec(SyncSpec("async").resolved(2), 10, 2)
    assert "partitions" not in plain.to_json()  # a job without parts says what it said before


def train(num_ps: int, partitioning: Partitioning | None, **kwargs: object) -> dict[str, object]:
    with running_ps(num_ps) as ps:
        return train_threads(
            ps.cluster(2),
            ps.transport,
            SMALL,
            Adam(lr=0.01),
            40,
            by_step,
            sync="sync",
            by_global_step=True,
            partitioning=partitioning,
            **kwargs,  # type: ignore[arg-type]
        )


SMALL_SPLIT = Partitioning(min_bytes=1000)  # hidden1/kernel (32x16, 2048 bytes) only


def test_a_partitioned_job_trains_exactly_as_an_unpartitioned_one() -> None:
    whole = train(2, None)
    split = train(2, SMALL_SPLIT)
    stats = split["stats"]
    assert isinstance(stats, list)
    held = [set(s["variables"]) for s in stats]
    assert "hidden1/kernel/part_0" in held[0] and "hidden1/kernel/part_1" in held[1]
    assert [s["size"] for s in stats] == shard_sizes(SMALL.variables(), 2, "round_robin", {"hidden1/kernel": 2})
    params = split["params"]
    assert isinstance(params, dict) and sorted(params) == sorted(n for n, _ in SMALL.variables())  # whole, by name
    for name, value in whole["params"].items():  # type: ignore[attr-defined]
        assert params[name].shape == value.shape
        np.testing.assert_allclose(params[name], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("before, after", [(SMALL_SPLIT, None), (None, Partitioning(min_bytes=1, parts=3))])
def test_a_checkpoint_resumes_under_another_partitioning(
    tmp_path: Path, before: Partitioning | None, after: Partitioning | None
) -> None:
    full = train(2, before, checkpoint_at=15, checkpoint_dir=tmp_path)
    saved = checkpoint.load(full["checkpoint"])  # type: ignore[arg-type]
    assert sorted(saved.variables) == sorted(n for n, _ in SMALL.variables())  # whole variables, by their names
    assert sorted(saved.slots["m"]) == sorted(saved.variables)
    resumed = train(3 if after else 1, after, resume=saved)
    assert resumed["local_steps"] == {0: 25, 1: 25}
    for name, value in full["params"].items():  # type: ignore[attr-defined]
        np.testing.assert_allclose(resumed["params"][name], value, atol=1e-5, rtol=0)  # type: ignore[index]


@pytest.mark.timeout(300)
def test_a_real_mnist_job_on_two_ps_splits_the_load_and_learns_as_well(tmp_path: Path) -> None:
    flags = ["backend=numpy", "topology.num_ps=2", "train.steps=300", *FAST_FLAGS]
    accuracy = {}
    for name, extra in (("whole", []), ("split", ["topology.partition_min_bytes=262144"])):
        result = run_psdk("run", *flags, *extra, out=tmp_path / name, timeout=140)
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy[name] = test_accuracy(tmp_path / name / "params.npz")
    shards = json.loads((tmp_path / "split" / "summary.json").read_text())["ps"]
    assert [s["size"] for s in shards] == [39310, 40200]
    assert "hidden1/kernel/part_0" in shards[0]["variables"] and "hidden1/kernel/part_1" in shards[1]["variables"]
    with np.load(tmp_path / "split" / "params.npz") as params:
        assert params["hidden1/kernel"].shape == (784, 100)  # saved whole, by its own name
    assert accuracy["split"] > 0.85 and abs(accuracy["split"] - accuracy["whole"]) < 0.03, accuracy


@pytest.mark.timeout(120)
def test_a_lost_ps_is_restored_part_by_part_from_a_whole_checkpoint(tmp_path: Path) -> None:
    transport = ZmqTransport(
        ZmqOptions(transport=TransportOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5)), context=zmq.Context()
    )
    shards = [Shard(transport, 0), Shard(transport, 1)]
    cluster = psdk.ClusterSpec({"ps": [s.address for s in shards], "worker": ["localhost"]})
    seen: dict[str, object] = {}
    killed = threading.Event()

    def work() -> None:
        try:
            backend = NumpyBackend()
            model = backend.build_model(SMALL, init_weights(SMALL, 0))
            with psdk.connect(
                cluster,
                0,
                steps=120,
                options=OPTIONS,
                transport=transport,
                checkpoint_dir=tmp_path,
                partitioning=SMALL_SPLIT,
            ) as session:
                opt = psdk.DistributedOptimizer(SGD(lr=0.2), model, session, backend=backend)
                opt.broadcast_parameters()
                step = 0
                while not session.should_stop():
                    forward_backward(model, *by_step(0, step))
                    if opt.step().outcome == "resync":  # restored: the whole variable is the checkpoint's
                        seen["restored"] = {n: v.copy() for n, v in session.client.params.items()}
                    step += 1
                    if "saved" not in seen and session.global_step >= 40:
                        seen["saved"] = session.save_checkpoint(tmp_path)
                        killed.wait(timeout=30)
                session.finish(wait_s=30)
                seen["recoveries"] = list(session.client.recoveries)
        except BaseException as exc:
            seen["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while "saved" not in seen:  # measured progress: the chief wrote its checkpoint and waits
            assert time.monotonic() < deadline and "error" not in seen, seen.get("error")
            time.sleep(0.002)
        shards[1].kill()
        shards[1] = Shard(transport, 1, shards[1].address)  # restarted, empty, on the same address
        killed.set()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the worker hung"
        assert "error" not in seen, seen["error"]
    finally:
        for s in shards:
            s.kill()
        transport.context.destroy(linger=0)
    saved = checkpoint.load(seen["saved"])  # type: ignore[arg-type]
    assert len(seen["recoveries"]) == 1  # type: ignore[arg-type]
    assert "hidden1/kernel/part_1" in [s.name for s in shards[1].server.store.specs]
    restored = seen["restored"]
    assert isinstance(restored, dict)
    for name, value in saved.variables.items():
        np.testing.assert_allclose(restored[name], value, atol=1e-6, rtol=0)


def test_the_message_limit_follows_the_largest_part_not_the_whole_variable(hydra_context: None) -> None:
    need = largest_message_bytes(40200, 2)  # ps 1's part and logits/kernel, with Adam's m and v
    flags = ["output_dir=.", "optimizer=adam", "topology.num_ps=2", f"transport.max_message_bytes={need}"]
    fits = compose("config", overrides=[*flags, "topology.partition_min_bytes=262144"])
    capacity.check_message_limit(fits, options_from(fits), 2)
    whole = compose("config", overrides=flags)
    with pytest.raises(ConfigError, match=r"transport\.max_message_bytes: .*ps 0's 79,400 parameters"):
        capacity.check_message_limit(whole, options_from(whole), 2)


def test_a_plan_the_shards_do_not_match_is_a_clear_error() -> None:
    params = {"w/part_0": np.zeros((2, 3), np.float32), "w/part_1": np.zeros((1, 4), np.float32)}
    grads = {n: np.zeros_like(v) for n, v in params.items()}
    with pytest.raises(PsdkError, match=r"parts the shards do not hold \(w/part_2\).*restart every ps task"):
        Joined({"w": 3}, params, grads)
    with pytest.raises(PsdkError, match="parts that do not make one variable"):
        Joined({"w": 2}, params, grads)
