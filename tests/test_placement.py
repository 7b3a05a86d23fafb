from __future__ import annotations

import pytest

from psdk.errors import ConfigError
from psdk.launch.placement import RankPlacement, check_memory_fraction, visible_gpus
from psdk.protocol.cluster import ClusterSpec

CLUSTER = ClusterSpec({"ps": ["p:1"], "worker": ["a", "a", "b", "a", "b"]})


def test_workers_take_their_local_rank_modulo_the_visible_gpus() -> None:
    placement = RankPlacement("auto")
    gpus = ["0", "1"]
    assert [placement.devices(CLUSTER, i, gpus)[0] for i in range(5)] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
        "cuda:0",
        "cuda:1",
    ]


def test_no_gpu_or_cpu_requested_means_cpu() -> None:
    assert RankPlacement("auto").devices(CLUSTER, 1, []) == ["cpu"]
    assert RankPlacement("cpu").devices(CLUSTER, 1, ["0"]) == ["cpu"]


def test_cuda_visible_devices_is_honoured() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]


def test_isolation_shows_each_worker_only_its_gpu() -> None:
    placement = RankPlacement("auto")
    assert [placement.isolation_env(CLUSTER, i, ["4", "5"]) for i in (0, 1, 3)] == [
        {"CUDA_VISIBLE_DEVICES": "4"},
        {"CUDA_VISIBLE_DEVICES": "5"},
        {"CUDA_VISIBLE_DEVICES": "4"},
    ]
    assert placement.isolation_env(CLUSTER, 0, []) == {}
    # once isolated, the worker sees one GPU and the same rule gives cuda:0
    assert placement.devices(CLUSTER, 1, ["5"]) == ["cuda:0"]


def test_bad_placement_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"placement\.device"):
        RankPlacement("tpu")
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        check_memory_fraction(1.5)
    assert check_memory_fraction(0.5) == 0.5
