"""The datasets psdk registers itself, and finding any registered dataset by name.

A dataset is what a :class:`~psdk.hookspecs.DatasetRecord` points at: a
function of the job's ``data`` config node returning a
:class:`~psdk.data.mnist.Mnist`-shaped set of arrays (flat uint8 images,
int64 labels; the job scales and splits them). Two are built in:

* ``mnist``: the four MNIST files, checked against their MD5 sums and
  downloaded when missing;
* ``idx``: any folder holding four files in MNIST's IDX format under MNIST's
  names (Fashion-MNIST, KMNIST and EMNIST ship that way), with the image size
  and the number of classes read from the files, so such an experiment needs
  no code: ``data.name=idx data.dir=/data/fashion model.input_dim=784``.
"""

from __future__ import annotations

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


def check_dataset_name(data: Any) -> str:
    """``data.name``, refused before a job starts when no plugin provides it (or ``idx`` lacks its folder)."""
    from psdk.registry import installed_datasets

    name = str(_get(data, "name") or "mnist")
    datasets = installed_datasets()
    if name not in datasets:
        raise ConfigError("data.name", f"no installed plugin provides a dataset called {name!r}", datasets)
    if name == "idx" and not _get(data, "dir"):
        raise ConfigError("data.dir", "data.name=idx reads a folder of IDX files: give it as data.dir=<folder>")
    return name


def load_dataset(data: Any) -> mnist.Mnist:
    """The dataset ``data.name`` names (default ``mnist``), through the plugins that register datasets."""
    from psdk.registry import installed_datasets, load_target

    name = check_dataset_name(data)
    datasets = installed_datasets()
    target = datasets[name].target
    try:
        loaded = load_target(target, f"dataset {name!r}")(data)
    except PsdkError:
        raise
    except Exception as exc:  # the plugin's own code failed: say whose it is
        raise PluginError(f"dataset {name!r} ({target}) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(loaded, mnist.Mnist):
        raise DataError(f"dataset {name!r} ({target}) returned {type(loaded).__name__}, not psdk.data.mnist.Mnist")
    for split in ("train_x", "test_x"):
        images = getattr(loaded, split)
        if images.dtype != np.uint8 or images.ndim != 2:
            raise DataError(
                f"dataset {name!r} ({target}) gave {split} as {images.dtype}{list(images.shape)}; psdk takes flat "
                "uint8 images (0-255, rows of pixels) and scales them to [0, 1] itself"
            )
    return loaded


def train_size(data: Any) -> int:
    """Training images the workers share (validation held out): known for MNIST, counted for any other dataset."""
    held_out = int(_get(data, "validation_size", 0) or 0)
    # MNIST's files are checked against their MD5 sums: its size needs no reading. Any other is counted.
    total = mnist.TRAIN_SIZE if check_dataset_name(data) == "mnist" else len(load_dataset(data).train_x)
    if not 0 <= held_out < total:
        raise ConfigError("data.validation_size", f"must be in [0, {total}), got {held_out}")
    return total - held_out


def check_fits(dataset: mnist.Mnist, spec: Any, name: str) -> None:
    """Refuse a model whose input size or number of classes does not fit the dataset's."""
    pixels = int(dataset.train_x.shape[1])
    classes = int(max(dataset.train_y.max(initial=0), dataset.test_y.max(initial=0))) + 1
    if int(spec.input_dim) != pixels:
        raise ConfigError("model.input_dim", f"is {spec.input_dim}, but the {name} images have {pixels} pixels")
    if int(spec.num_classes) < classes:
        raise ConfigError("model.num_classes", f"is {spec.num_classes}, but the {name} labels go up to {classes - 1}")
