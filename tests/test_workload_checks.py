"""A workload says whether a model fits its data and how big its training set is; the core only asks.

MNIST's ``check`` and ``train_size`` entries (``psdk/workloads/mnist/checks.py``)
refuse what cannot train before any task starts, with the messages MNIST users
know; a workload without them has nothing checked and counts no epochs. The
launcher, the config and the jobs import no workload and no data set.
"""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import DictConfig

from psdk.config import capacity, config_dir, prepare_hydra
from psdk.config.check import OverrideChecker
from psdk.errors import ConfigError
from psdk.jobs.epochs import EpochCount, resolve_steps
from psdk.plugins import registry
from psdk.plugins.hookspecs import WorkloadRecord
from psdk.workloads.mnist import checks
from tests.test_structure import import_graph
from tests.test_workloads import manager

pytestmark = pytest.mark.timeout(60)

CORE = ("psdk.config", "psdk.jobs", "psdk.launch", "psdk.report", "psdk.ps")
"""What runs any workload: none of it may import a workload, or the data sets only a workload reads."""


def composed(*overrides: str) -> DictConfig:
    prepare_hydra()
    return OverrideChecker(config_dir()).composed(list(overrides))


def never(cfg: Any) -> None:
    raise AssertionError("a workload entry that no test runs")


def thousand(cfg: Any) -> int:
    """A plugin workload's ``train_size`` entry: its training set, whatever ``data`` says."""
    return 1000


BARE = WorkloadRecord(
    "bare", "checks nothing, counts no epochs", {"*": "x:T"}, worker=f"{__name__}:never", evaluate=f"{__name__}:never"
)


def test_mnist_refuses_a_split_that_cannot_train_before_any_task_starts() -> None:
    capacity.check_data_fits(composed())
    with pytest.raises(ConfigError, match=r"data\.validation_size: must be in \[0, 60000\), got 60000"):
        capacity.check_data_fits(composed("data.validation_size=60000"))
    with pytest.raises(ConfigError, match=r"data\.validation_size: must be in \[0, 60000\), got -1"):
        capacity.check_data_fits(composed("data.validation_size=-1"))
    message = (
        r"train\.batch_size: 20000 is more than a worker's shard of the training set \(18333 images: 55000 split "
        r"over 3 workers\); use train\.batch_size=100 or fewer workers"
    )
    with pytest.raises(ConfigError, match=message):
        capacity.check_data_fits(composed("train.batch_size=20000", "topology.num_workers=3"))
    # A worker started by hand counts the workers of its cluster.
    by_hand = composed("job_name=worker", "ps_hosts=127.0.0.1:1", "worker_hosts=[a:1,b:2]", "train.batch_size=27501")
    with pytest.raises(ConfigError, match=r"27501 is more than a worker's shard .* \(27500 images"):
        capacity.check_data_fits(by_hand)


def idx_folder(folder: Path, train: int, side: int = 3, classes: int = 4) -> Path:
    """Four IDX files of ``train`` training images ``side`` x ``side``, labels below ``classes``."""
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", 7)):
        for kind, array in (("images", rng.integers(0, 255, (n, side, side))), ("labels", np.arange(n) % classes)):
            header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            path = folder / f"{prefix}-{kind}-idx{array.ndim}-ubyte.gz"
            path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))
    return folder


def test_an_idx_folder_is_split_by_its_own_size_read_from_its_header(tmp_path: Path) -> None:
    data = ["data.name=idx", f"data.dir={idx_folder(tmp_path, 50)}", "model.input_dim=9", "model.num_classes=4"]
    assert checks.train_size(composed(*data, "data.validation_size=10")) == 40
    capacity.check_data_fits(composed(*data, "data.validation_size=10", "train.batch_size=20"))
    with pytest.raises(ConfigError, match=r"data\.validation_size: must be in \[0, 50\), got 50"):
        capacity.check_data_fits(composed(*data, "data.validation_size=50"))
    with pytest.raises(ConfigError, match=r"train\.batch_size: 21 .* \(20 images: 40 split over 2 workers\)"):
        capacity.check_data_fits(composed(*data, "data.validation_size=10", "train.batch_size=21"))
    with pytest.raises(ConfigError, match=r"model\.input_dim: is 784, but the idx images have 9 pixels"):
        capacity.check_data_fits(composed(*data[:2], "data.validation_size=10"))


def test_the_default_data_set_is_the_workloads_and_epochs_count_its_size() -> None:
    cfg = composed("train.epochs=1", "data.validation_size=0", "train.batch_size=50")
    assert cfg.data.name is None and checks.dataset_name(cfg.data) == "mnist"  # null: MNIST's own
    assert checks.train_size(cfg) == 60000 and resolve_steps(cfg) == 1200
    with pytest.raises(ConfigError, match=r"data\.name: no installed plugin provides a dataset called 'cifar'"):
        capacity.check_data_fits(composed("data.name=cifar"))


def test_a_workload_without_check_or_train_size_has_nothing_checked_and_counts_no_epochs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = dataclasses.replace(BARE, name="counting", train_size=f"{__name__}:thousand")
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: manager([BARE, counting]))
    cfg = composed("model.input_dim=5", "data.validation_size=70000", "train.epochs=2")
    cfg.workload.name = "bare"
    capacity.check_data_fits(cfg)  # MNIST's shape and split are MNIST's checks, not the core's
    with pytest.raises(ConfigError, match=r"train\.epochs: the workload 'bare' does not say .* give train\.steps"):
        resolve_steps(cfg)
    cfg.workload.name = "counting"
    assert resolve_steps(cfg) == EpochCount.of_job(1000, 2, 100).steps_for(2) == 20


def test_the_core_imports_no_workload_and_no_data_set() -> None:
    graph = import_graph()
    core = {m: deps for m, deps in graph.items() if any(m == c or m.startswith(f"{c}.") for c in CORE)}
    assert {"psdk.config.capacity", "psdk.config.build", "psdk.jobs.epochs", "psdk.launch.local"} <= set(core)
    bad = {m: sorted(d for d in deps if d.startswith(("psdk.workloads", "psdk.data"))) for m, deps in core.items()}
    assert not {m: d for m, d in bad.items() if d}, f"core modules importing a workload or a data set: {bad}"
