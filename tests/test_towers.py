"""Towers without a framework: the devices placement gives a worker, the config key, the batch split, the refusal.

The arithmetic of towers on each framework is its plugin's ``test_towers.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from psdk.config.options import PlacementOptions
from psdk.errors import ConfigError
from psdk.launch.placement import RankPlacement
from psdk.plugins.backends import kit
from psdk.plugins.batches import Batch
from psdk.plugins.loading import load_backend
from psdk.plugins.models import ModelSpec
from psdk.plugins.towers import describe, split
from psdk.protocol.cluster import ClusterSpec
from psdk.workloads.mnist.trainers import IMAGE, NumpyClassifier

pytestmark = pytest.mark.timeout(30)

CLUSTER = ClusterSpec({"ps": ["p:1"], "worker": ["a", "a", "b"]})


def test_a_worker_with_towers_takes_the_gpus_after_those_of_the_workers_before_it_on_its_host() -> None:
    placement = RankPlacement("auto", 2)
    gpus = ["0", "1", "2", "3"]
    assert [placement.devices(CLUSTER, i, gpus) for i in range(3)] == [
        ["cuda:0", "cuda:1"],
        ["cuda:2", "cuda:3"],
        ["cuda:0", "cuda:1"],  # host b: its own GPUs
    ]
    assert placement.isolation_env(CLUSTER, 1, gpus) == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_a_list_gives_each_worker_its_own_count_cycled() -> None:
    placement = RankPlacement("auto", [2, 1])
    gpus = ["0", "1", "2"]
    assert [placement.devices(CLUSTER, i, gpus) for i in range(3)] == [
        ["cuda:0", "cuda:1"],
        ["cuda:2"],
        ["cuda:0", "cuda:1"],
    ]
    assert placement.isolation_env(CLUSTER, 1, gpus) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_without_gpus_towers_are_cpu_replicas_and_one_tower_is_plain_cpu() -> None:
    assert RankPlacement("auto", 3).devices(CLUSTER, 0, []) == ["cpu:0", "cpu:1", "cpu:2"]
    assert RankPlacement("cpu", 2).devices(CLUSTER, 0, ["0", "1"]) == ["cpu:0", "cpu:1"]
    assert RankPlacement("auto", [2, 1]).devices(CLUSTER, 1, []) == ["cpu"]
    assert RankPlacement("auto", 1).devices(CLUSTER, 1, ["0", "1"]) == ["cuda:1"]  # as before towers


@pytest.mark.parametrize("bad", [0, -1, [], [2, 0], "2", True, 1.5])
def test_a_bad_tower_count_is_refused_by_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"placement\.towers"):
        PlacementOptions(towers=bad)


def test_the_option_reads_a_count_or_a_list_per_worker() -> None:
    assert PlacementOptions().towers_for(5) == 1
    assert PlacementOptions(towers=[2, 1]).towers_for(2) == 2
    assert PlacementOptions(towers=[2, 1]).towers_for(3) == 1


def test_cpu_replicas_and_gpus_that_fall_back_keep_distinct_names() -> None:
    assert kit.fall_back_towers(["cpu:0", "cpu:1"], 0, "x") == ["cpu:0", "cpu:1"]
    assert kit.fall_back_towers(["cuda:0", "cuda:1"], 1, "x") == ["cuda:0", "cpu:1"]
    assert kit.gpu_index("cpu:1") is None and kit.cpu_index("cpu:1") == 1 and kit.cpu_index("cuda:1") is None
    with pytest.raises(ConfigError, match="cannot place a worker on 'tpu:0'"):
        kit.gpu_index("tpu:0")


@pytest.mark.parametrize(("size", "towers"), [(100, 2), (33, 2), (10, 3), (1, 2)])
def test_a_batch_is_split_as_evenly_as_it_goes(size: int, towers: int) -> None:
    bounds = split(size, towers)
    lengths = [stop - start for start, stop in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == size and sum(lengths) == size
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(towers - 1))
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_a_backend_without_towers_refuses_them_by_key() -> None:
    backend = load_backend("numpy")
    with pytest.raises(ConfigError, match=r"placement\.towers.*drives one device per worker"):
        backend.setup_towers(["cpu:0", "cpu:1"])


def test_the_default_reduction_on_the_host_gives_the_whole_batch_gradient() -> None:
    """What a backend gets without its own ``reduce_gradients``: numpy's replicas, each on its slice."""
    backend = load_backend("numpy")
    trainer = NumpyClassifier(backend)
    spec = ModelSpec(name="small", hidden=(16,), input_dim=20, num_classes=10)
    rng = np.random.default_rng(0)
    batch = Batch({IMAGE: rng.random((33, 20), dtype=np.float32)}, rng.integers(0, 10, 33))
    weights = spec.init_weights(0)
    whole = trainer.build_model(spec, weights)
    loss = trainer.forward_backward(whole, batch)
    expected = {n: np.zeros(s, np.float32) for n, s in backend.variables(whole).items()}
    backend.read_gradients(whole, expected)
    replicas = [trainer.build_model(spec, weights) for _ in range(2)]
    bounds = split(len(batch), 2)
    losses = [trainer.forward_backward(m, batch.take(a, b)) for m, (a, b) in zip(replicas, bounds, strict=True)]
    shares = [(b - a) / len(batch) for a, b in bounds]
    got = {n: np.zeros_like(v) for n, v in expected.items()}
    backend.reduce_gradients(replicas, shares, got)
    assert abs(sum(s * v for s, v in zip(shares, losses, strict=True)) - loss) < 1e-5
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


def test_the_log_names_every_device_and_where_gradients_meet() -> None:
    assert describe(("cpu",)) == "cpu"
    assert describe(("cuda:0", "cuda:1")) == "cuda:0, cuda:1 (2 towers, gradients averaged on cuda:0)"
