"""The datasets psdk registers itself, and finding any registered dataset by name.

A dataset is what a :class:`~psdk.plugins.hookspecs.DatasetRecord` points at: a
function of the job's ``data`` config node returning what the workload
that reads it takes; :func:`load_dataset` finds one by name for any
workload. Two are built in, for the MNIST workload, each returning a
:class:`~psdk.data.mnist.Mnist` (flat uint8 images, int64 labels; the
workload scales, splits and checks them, :mod:`psdk.workloads.mnist.checks`):

* ``mnist``: the four MNIST files, checked against their MD5 sums and
  downloaded when missing;
* ``idx``: any folder holding four files in MNIST's IDX format under MNIST's
  names (Fashion-MNIST, KMNIST and EMNIST ship that way), with the image size
  and the number of classes read from the files, so such an experiment needs
  no code: ``data.name=idx data.dir=/data/fashion model.input_dim=784``.
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psdk.data import mnist
from psdk.errors import ConfigError, DataError, PluginError, PsdkError

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _get(data: Any, key: str, default: Any = None) -> Any:
    return data.get(key, default) if isinstance(data, Mapping) else getattr(data, key, default)


def mnist_dataset(data: Any) -> mnist.Mnist:
    """MNIST from ``data.dir`` (or ``$PSDK_DATA_DIR``, or the download cache), checksummed."""
    mirrors = _get(data, "mirrors") or list(mnist.MIRRORS)
    folder = mnist.resolve_dir(_get(data, "dir"), _get(data, "cache_dir"), bool(_get(data, "download", True)), mirrors)
    return mnist.load(folder, cache_dir=mnist.cache_folder(_get(data, "cache_dir")))


def idx_folder(data: Any) -> mnist.Mnist:
    """The four IDX files in ``data.dir``, whatever their image size or number of classes; no checksums."""
    where = _get(data, "dir")
    if not where:
        raise ConfigError("data.dir", "data.name=idx reads a folder of IDX files: give it as data.dir=<folder>")
    folder = Path(str(where)).expanduser()
    arrays: dict[str, np.ndarray] = {}
    for key, stem in IDX_FILES.items():
        path = next((p for p in (folder / f"{stem}.gz", folder / stem) if p.is_file()), None)
        if path is None:
            names = ", ".join(f"{s}[.gz]" for s in IDX_FILES.values())
            raise DataError(f"{folder} has no {stem}[.gz]; data.name=idx needs the four files {names}")
        arrays[key] = mnist.parse_idx(mnist.raw_bytes(path, path.suffix == ".gz"), path)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim < 2 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(
                f"{folder}: the {split} images are {list(images.shape)} and the labels {list(labels.shape)}; "
                "expected N images and N labels"
            )
    train_x = arrays["train_images"].reshape(len(arrays["train_images"]), -1)
    test_x = arrays["test_images"].reshape(len(arrays["test_images"]), -1)
    if train_x.shape[1] != test_x.shape[1]:
        raise DataError(f"{folder}: training images have {train_x.shape[1]} pixels, test images {test_x.shape[1]}")
    return mnist.Mnist(
        train_x=train_x,
        train_y=arrays["train_labels"].astype(np.int64),
        test_x=test_x,
        test_y=arrays["test_labels"].astype(np.int64),
    )


def check_dataset_name(data: Any, default: str) -> str:
    """``data.name`` (null: ``default``, the workload's own), refused before a job starts when no plugin provides it."""
    from psdk.plugins.registry import installed_datasets

    name = str(_get(data, "name") or default)
    datasets = installed_datasets()
    if name not in datasets:
        raise ConfigError("data.name", f"no installed plugin provides a dataset called {name!r}", datasets)
    return name


def load_dataset(data: Any, default: str) -> Any:
    """The dataset ``data.name`` names (null: ``default``), through the plugins that register datasets.

    What a dataset returns is between it and the workload that reads it,
    which checks it (MNIST's: :func:`psdk.workloads.mnist.checks.check_images`).
    """
    from psdk.plugins.registry import installed_datasets, load_target

    name = check_dataset_name(data, default)
    target = installed_datasets()[name].target
    try:
        return load_target(target, f"dataset {name!r}")(data)
    except PsdkError:
        raise
    except Exception as exc:  # the plugin's own code failed: say whose it is
        raise PluginError(f"dataset {name!r} ({target}) failed: {type(exc).__name__}: {exc}") from exc


def idx_file(folder: Path, key: str) -> Path | None:
    """The IDX file ``key`` (of :data:`IDX_FILES`) in ``folder``, gzipped or not; None when it has neither."""
    stem = IDX_FILES[key]
    return next((p for p in (folder / f"{stem}.gz", folder / stem) if p.is_file()), None)


def idx_dims(path: Path) -> list[int]:
    """The dimensions of an IDX file of unsigned bytes from its header alone (its first 4 + 4 x dims bytes)."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as stream:
            head = stream.read(4)
            dims = stream.read(4 * head[3]) if len(head) == 4 else b""
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DataError(f"{path} cannot be read: {exc}") from None
    sizes = [int.from_bytes(dims[i : i + 4], "big") for i in range(0, len(dims), 4)]
    if len(head) != 4 or head[:3] != b"\x00\x00\x08" or not sizes or len(dims) != 4 * head[3]:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    return sizes
