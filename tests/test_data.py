"""MNIST: found, checked, split per worker, downloaded (from a local mirror), or explained."""

from __future__ import annotations

import gzip
import os
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
def data(psdk_mnist_dir: Path) -> mnist.Mnist:
    return mnist.load(psdk_mnist_dir)


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


def test_a_split_keeps_bytes_and_scales_each_batch_as_cut(data: mnist.Mnist) -> None:
    split = mnist.split(data, 1, 2, 5000, with_test=False)
    assert split.train_images.dtype == np.uint8 and "train_x" not in vars(split)  # nothing scaled up front
    rows = np.array([3, 0, 27499])
    x, y = split.batch(rows)
    assert x.dtype == np.float32 and x.shape == (3, 784)
    np.testing.assert_array_equal(x, mnist.to_float(data.train_x[5000 + 27500 + rows]))
    np.testing.assert_array_equal(y, data.train_y[5000 + 27500 + rows])


def test_uncompressed_files_work_too(psdk_mnist_dir: Path, tmp_path: Path) -> None:
    for stem, _ in mnist.FILES.values():
        (tmp_path / stem).write_bytes(gzip.decompress((psdk_mnist_dir / f"{stem}.gz").read_bytes()))
    assert mnist.load(mnist.resolve_dir(str(tmp_path))).test_y.shape == (10000,)


def test_a_folder_without_the_files_says_where_to_put_them(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        mnist.resolve_dir(str(tmp_path / "nowhere"))
    text = str(info.value)
    assert "train-images-idx3-ubyte.gz" in text and "PSDK_DATA_DIR" in text and "does not exist" in text


def test_a_corrupt_file_is_refused(psdk_mnist_dir: Path, tmp_path: Path) -> None:
    for path in psdk_mnist_dir.glob("*.gz"):
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


# ------------------------------------------------------------------ the decoded cache
def copy_of(psdk_mnist_dir: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in psdk_mnist_dir.glob("*.gz"):
        shutil.copy(path, folder / path.name)
    return folder


def test_decoded_arrays_are_cached_and_used_until_a_file_changes(
    psdk_mnist_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cache = copy_of(psdk_mnist_dir, tmp_path / "files"), tmp_path / "cache"
    first = mnist.load(files, cache_dir=cache)
    (entry,) = cache.glob("decoded-*")
    decoded: list[Path] = []
    real_decode = mnist._decode
    monkeypatch.setattr(mnist, "_decode", lambda folder: decoded.append(folder) or real_decode(folder))
    again = mnist.load(files, cache_dir=cache)
    assert decoded == []  # from the cache
    for name in mnist.DECODED_ARRAYS:
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
    # A file that changes is checked again: a corrupt one is refused, never served from the cache.
    raw = bytearray(gzip.decompress((files / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] ^= 0xFF
    (files / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataError, match="corrupt"):
        mnist.load(files, cache_dir=cache)
    assert decoded == [files] and entry.exists()


def test_a_damaged_cache_entry_is_ignored_and_written_anew(
    psdk_mnist_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cache = copy_of(psdk_mnist_dir, tmp_path / "files"), tmp_path / "cache"
    truth = mnist.load(files, cache_dir=cache)
    (entry,) = cache.glob("decoded-*")
    for damage in (
        lambda: (entry / "train_x.npy").write_bytes((entry / "train_x.npy").read_bytes()[:1000]),  # truncated
        lambda: np.save(entry / "test_y.npy", np.full(10000, 42, np.int64)),  # labels out of range
        lambda: (entry / "train_y.npy").unlink(),
    ):
        damage()
        caplog.clear()
        np.testing.assert_array_equal(mnist.load(files, cache_dir=cache).test_y, truth.test_y)
        assert "ignoring the decoded-MNIST cache" in caplog.text
    monkeypatch.setattr(mnist, "_decode", lambda folder: pytest.fail("decoded again: the entry was not rewritten"))
    np.testing.assert_array_equal(mnist.load(files, cache_dir=cache).train_x, truth.train_x)


def test_the_cache_keeps_only_the_newest_entries(psdk_mnist_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for copy in range(mnist.DECODED_KEPT + 1):
        mnist.load(copy_of(psdk_mnist_dir, tmp_path / f"files{copy}"), cache_dir=cache)
    assert len(list(cache.glob("decoded-*"))) == mnist.DECODED_KEPT


def test_a_folder_missing_a_file_is_explained_with_the_cache_on_too(psdk_mnist_dir: Path, tmp_path: Path) -> None:
    files = copy_of(psdk_mnist_dir, tmp_path / "files")
    (files / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"MNIST files missing in .*t10k-labels-idx1-ubyte\.gz"):
        mnist.load(files, cache_dir=tmp_path / "cache")


def planted(entry: Path, truth: mnist.Mnist) -> None:
    """What another user could leave in a shared cache: the real images, the labels shifted by one."""
    np.save(entry / "train_y.npy", (truth.train_y + 1) % 10)


def test_a_cache_entry_that_is_not_the_standard_data_is_never_trained_on(
    psdk_mnist_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files, cache = copy_of(psdk_mnist_dir, tmp_path / "files"), tmp_path / "cache"
    truth = mnist.load(files, cache_dir=cache)
    (entry,) = cache.glob("decoded-*")
    planted(entry, truth)  # right shapes, labels in 0..9, this user's own files: only the digest tells
    np.testing.assert_array_equal(mnist.load(files, cache_dir=cache).train_y, truth.train_y)
    assert "differs from the standard MNIST files' decoded train_y" in caplog.text


@pytest.mark.parametrize("how", ["group-writable folder", "others-writable file", "another user's"])
def test_a_cache_entry_another_user_could_have_written_is_not_used(
    psdk_mnist_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    files, cache = copy_of(psdk_mnist_dir, tmp_path / "files"), tmp_path / "cache"
    truth = mnist.load(files, cache_dir=cache)
    (entry,) = cache.glob("decoded-*")
    if how == "group-writable folder":
        entry.chmod(0o770)
    elif how == "others-writable file":
        (entry / "test_x.npy").chmod(0o606)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        for path in (entry, *entry.iterdir()):
            os.chown(path, 65534, 65534)
    np.testing.assert_array_equal(mnist.load(files, cache_dir=cache).test_y, truth.test_y)
    assert "ignoring the decoded-MNIST cache" in caplog.text
    assert "belongs to user 65534" in caplog.text or "can be written by other users" in caplog.text


def bomb(path: Path, header: bytes, megabytes: int) -> Path:
    """A small gzip file that expands far past what its IDX header (or the standard file) holds."""
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(header)
        for _ in range(megabytes):
            out.write(bytes(1 << 20))
    return path


def test_decompression_stops_at_the_size_the_file_may_have(psdk_mnist_dir: Path, tmp_path: Path) -> None:
    labels = (60000).to_bytes(4, "big")
    files = copy_of(psdk_mnist_dir, tmp_path / "files")
    bomb(files / "train-labels-idx1-ubyte.gz", b"\x00\x00\x08\x01" + labels, 64)
    with pytest.raises(DataError, match=r"holds more than the 60008 bytes of the standard file"):
        mnist.load(files)
    other = bomb(tmp_path / "other.gz", b"\x00\x00\x08\x01" + (10).to_bytes(4, "big"), 64)
    with pytest.raises(DataError, match=r"holds more than the 18 bytes its IDX header gives"):
        mnist.raw_bytes(other, gzipped=True)
    huge = bomb(tmp_path / "huge.gz", b"\x00\x00\x08\x02" + (1 << 16).to_bytes(4, "big") * 2, 0)
    with pytest.raises(DataError, match=r"claims 4294967308 bytes, more than the 2 GiB"):
        mnist.raw_bytes(huge, gzipped=True)
