"""MNIST: found, checked, split per worker, downloaded (from a local mirror), or explained."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from psdk.data import mnist
from psdk.errors import DataError


@pytest.fixture(autouse=True)
def no_data_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSDK_DATA_DIR", raising=False)


@pytest.fixture(scope="module")
def data(mnist_dir: Path) -> mnist.Mnist:
    return mnist.load(mnist_dir)


def test_the_four_files_load_with_their_shapes(data: mnist.Mnist) -> None:
    assert data.train_x.shape == (60000, 784) and data.test_x.shape == (10000, 784)
    assert data.train_y.max() == 9 and data.train_x.dtype == np.uint8


def test_workers_get_disjoint_shards_and_validation_is_held_out(data: mnist.Mnist) -> None:
    splits = [mnist.split(data, w, 3, 5000, with_test=w == 0) for w in range(3)]
    assert sum(len(s.train_x) for s in splits) == 55000
    assert splits[0].val_x.shape == (5000, 784) and splits[0].test_x.shape == (10000, 784)
    assert splits[1].test_x.shape == (0, 784)
    np.testing.assert_array_equal(splits[0].val_x, mnist.to_float(data.train_x[:5000]))
    np.testing.assert_array_equal(splits[2].train_x[-1], mnist.to_float(data.train_x[-1]))
    assert splits[1].train_x.min() >= 0.0 and splits[1].train_x.max() <= 1.0


def test_uncompressed_files_work_too(mnist_dir: Path, tmp_path: Path) -> None:
    for stem, _ in mnist.FILES.values():
        (tmp_path / stem).write_bytes(gzip.decompress((mnist_dir / f"{stem}.gz").read_bytes()))
    assert mnist.load(mnist.resolve_dir(str(tmp_path))).test_y.shape == (10000,)


def test_a_folder_without_the_files_says_where_to_put_them(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        mnist.resolve_dir(str(tmp_path / "nowhere"))
    text = str(info.value)
    assert "train-images-idx3-ubyte.gz" in text and "PSDK_DATA_DIR" in text and "does not exist" in text


def test_a_corrupt_file_is_refused(mnist_dir: Path, tmp_path: Path) -> None:
    for path in mnist_dir.glob("*.gz"):
        shutil.copy(path, tmp_path / path.name)
    raw = bytearray(gzip.decompress((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] ^= 0xFF
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataError, match="corrupt"):
        mnist.load(tmp_path)


def test_missing_files_are_downloaded_into_the_cache_and_checked(local_mirror: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = mnist.resolve_dir(None, str(cache), mirrors=["http://127.0.0.1:1/", local_mirror], progress=False)
    assert folder == cache and sorted(p.name for p in cache.iterdir()) == sorted(
        f"{stem}.gz" for stem, _ in mnist.FILES.values()
    )
    assert mnist.load(folder).train_x.shape == (60000, 784)


def test_a_failed_download_says_why_and_where_to_put_the_files(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        mnist.resolve_dir(None, str(tmp_path), mirrors=["http://127.0.0.1:1/"], progress=False)
    text = str(info.value)
    assert "http://127.0.0.1:1/" in text and "PSDK_DATA_DIR" in text
    assert not list(tmp_path.glob("*.part"))  # nothing half-written is left behind


def test_downloading_off_is_respected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.download=false"):
        mnist.resolve_dir(None, str(tmp_path), allow_download=False)
