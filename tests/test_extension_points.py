"""Rules, models and datasets plug in like backends: a plugin installed as a real entry point, end to end.

The plugin lives in a temporary folder with its own ``dist-info`` (what pip
writes), put on ``PYTHONPATH`` of the subprocesses only: psdk finds it
through the ``psdk`` entry-point group exactly as it finds an installed one.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psdk.data import datasets
from psdk.data.mnist import Mnist
from psdk.errors import ConfigError, DataError
from psdk.plugins import registry
from psdk.plugins.hookspecs import DatasetRecord
from psdk.plugins.models import ModelSpec
from psdk.workloads.mnist import checks

from .jobs import FAST_FLAGS

pytestmark = pytest.mark.timeout(180)

PLUGIN = '''
"""A test plugin: a rule, a dataset, and a broken backend record's neighbour."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from psdk.plugins.hookspecs import DatasetRecord, hookimpl
from psdk.ps.rules import UpdateRule


@dataclass(frozen=True)
class SignSGD(UpdateRule):
    """Steps by lr in the direction of the gradient's sign; one slot counting steps per parameter."""

    name: ClassVar[str] = "signsgd"
    lr: float = 0.001

    def slot_names(self):
        return ("seen",)

    def apply(self, params, grad, state):
        params -= self.lr_at(state.step) * np.sign(grad)
        state.slots["seen"] += 1.0
        state.step += 1


def tiny(data):
    rng = np.random.default_rng(0)

    def make(n):
        y = rng.integers(0, 4, n)
        x = rng.integers(0, 40, (n, 36)).astype(np.uint8)
        for label in range(4):
            x[y == label, label * 9 : label * 9 + 9] += 200  # each class lights its own block of pixels
        return x, y.astype(np.int64)

    from psdk.data.mnist import Mnist
    train_x, train_y = make(3000)
    test_x, test_y = make(500)
    return Mnist(train_x, train_y, test_x, test_y)


@hookimpl
def psdk_register_rules():
    return [SignSGD]


@hookimpl
def psdk_register_datasets():
    return [DatasetRecord("tiny", "psdk_testplugin:tiny", "four classes of 6x6 images, generated")]
'''


def install(folder: Path, name: str, entry_points: str, module: str = "") -> Path:
    """A package and its dist-info in ``folder``, as ``pip install`` would leave them."""
    folder.mkdir(parents=True, exist_ok=True)
    if module:
        (folder / f"{name}.py").write_text(module)
    info = folder / f"{name.replace('_', '-')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    return folder


def run(folder: Path, *args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "psdk", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    return install(tmp_path / "site", "psdk_testplugin", "[psdk]\ntestplugin = psdk_testplugin\n", PLUGIN)


def test_an_installed_plugins_rule_and_dataset_are_listed(plugin_dir: Path, tmp_path: Path) -> None:
    done = run(plugin_dir, "plugins", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {tuple(line.split()[:3]) for line in done.stdout.splitlines()}
    assert ("rule", "signsgd", "psdk-testplugin") in rows and ("dataset", "tiny", "psdk-testplugin") in rows
    assert ("rule", "sgd", "psdk") in rows and ("model", "mlp", "psdk") in rows  # the built-ins, same hooks


def test_a_job_trains_with_a_plugins_rule_on_its_dataset_and_checkpoints_the_slot(
    plugin_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["backend=numpy", "optimizer=signsgd", "optimizer.lr=0.003", "data.name=tiny", "data.validation_size=500"]
    args += ["model.input_dim=36", "model.num_classes=4", "train.steps=300", "report.plot=false", *FAST_FLAGS]
    done = run(plugin_dir, "run", *args, f"hydra.run.dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.9  # chance is 0.25
    with np.load(next((out / "checkpoints").glob("ckpt-*-300.npz"))) as saved:
        seen = [saved[k] for k in saved.files if k.startswith("slots/seen/")]
    assert seen and all(float(s.min()) == float(s.max()) == 300.0 for s in seen)  # async: one apply per step


def test_a_broken_plugin_is_named_and_spoils_nothing_else(tmp_path: Path) -> None:
    site = install(tmp_path / "site", "psdk_broken", "[psdk]\nbroken = psdk_broken_missing.plugin\n")
    done = run(site, "plugins", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "'broken'" in done.stderr and "psdk-broken 0.1" in done.stderr and "failed to load" in done.stderr
    assert any(line.split()[:2] == ["backend", "numpy"] for line in done.stdout.splitlines())


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def fashion_like(folder: Path, side: int = 8, classes: int = 3) -> Path:
    """Four IDX files under MNIST's names, of ``side`` x ``side`` images: what Fashion-MNIST ships."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 2000), ("t10k", 300)):
        y = rng.integers(0, classes, n)
        x = rng.integers(0, 30, (n, side, side))
        for label in range(classes):
            x[y == label, label] += 220  # each class lights one row
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", x)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", y)
    return folder


def test_any_folder_of_idx_files_is_a_dataset_without_code(tmp_path: Path) -> None:
    folder = fashion_like(tmp_path / "fashion")
    data = datasets.idx_folder({"dir": str(folder)})
    assert data.train_x.shape == (2000, 64) and data.test_y.shape == (300,) and data.train_x.dtype == np.uint8
    checks.check_fits(data, ModelSpec(hidden=(16,), input_dim=64, num_classes=3), "idx")
    with pytest.raises(ConfigError, match=r"model\.input_dim: is 784, but the idx images have 64 pixels"):
        checks.check_fits(data, ModelSpec(), "idx")
    with pytest.raises(ConfigError, match=r"model\.num_classes: is 2, but the idx labels go up to 2"):
        checks.check_fits(data, ModelSpec(input_dim=64, num_classes=2), "idx")
    with pytest.raises(ConfigError, match=r"data\.dir"):
        datasets.idx_folder({"dir": None})
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        datasets.idx_folder({"dir": str(folder)})


def test_a_job_on_an_idx_folder(tmp_path: Path) -> None:
    folder = fashion_like(tmp_path / "fashion")
    out = tmp_path / "run"
    args = ["backend=numpy", "data.name=idx", f"data.dir={folder}", "data.validation_size=200", "model.input_dim=64"]
    args += ["model.num_classes=3", "train.steps=200", "report.plot=false", *FAST_FLAGS, f"hydra.run.dir={out}"]
    done = run(tmp_path, "run", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] > 0.9
    wrong = run(tmp_path, "run", *[a for a in args if a != "model.input_dim=64"], cwd=tmp_path, timeout=60)
    assert wrong.returncode != 0
    assert "model.input_dim: is 784, but the idx images have 64 pixels" in wrong.stdout + wrong.stderr


def test_an_unknown_dataset_lists_the_installed_ones() -> None:
    with pytest.raises(ConfigError, match=r"data\.name: no installed plugin provides a dataset called 'cifar'"):
        checks.load_images({"name": "cifar"})


MISBEHAVING = """
from psdk.plugins.hookspecs import hookimpl


class Nameless:  # no UpdateRule, no name
    pass


@hookimpl
def psdk_register_rules():
    return [Nameless]


@hookimpl
def psdk_register_models():
    raise RuntimeError("model registry exploded")


@hookimpl
def psdk_register_datasets():
    return "not a list"
"""


def test_a_plugin_whose_hooks_misbehave_is_dropped_and_jobs_without_it_run(tmp_path: Path) -> None:
    site = install(tmp_path / "site", "psdk_rogue", "[psdk]\nrogue = psdk_rogue\n", MISBEHAVING)
    listed = run(site, "plugins", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "the plugin 'rogue' is skipped" in listed.stderr
    assert any(line.split()[:2] == ["rule", "sgd"] for line in listed.stdout.splitlines())
    composed = run(site, "run", "--cfg", "job", "backend=numpy", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr
    assert "momentum" in composed.stdout


def floaty(data: object) -> Mnist:
    """A dataset that hands over images already scaled, which psdk would scale again."""
    x = np.random.default_rng(0).random((20, 4), dtype=np.float32)
    return Mnist(x, np.zeros(20, np.int64), x, np.zeros(20, np.int64))


def test_a_dataset_of_float_images_is_refused_not_scaled_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        registry, "installed_datasets", lambda: {"floaty": DatasetRecord("floaty", f"{__name__}:floaty")}
    )
    with pytest.raises(DataError, match=r"gave train_x as float32\[20, 4\]; psdk takes flat uint8 images"):
        checks.load_images({"name": "floaty"})


def test_an_unknown_dataset_is_refused_before_any_task_starts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run(tmp_path, "run", "backend=numpy", "data.name=cifar", f"hydra.run.dir={out}", cwd=tmp_path, timeout=60)
    assert done.returncode != 0
    assert "data.name: no installed plugin provides a dataset called 'cifar'" in done.stdout + done.stderr
    assert not list((out / "tasks").glob("*.pid"))
