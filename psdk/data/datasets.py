"""The datasets psdk registers itself, and finding any registered dataset by name.

A dataset is what a :class:`~psdk.plugins.hookspecs.DatasetRecord` points at: a
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

import gzip
import math
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
    from psdk.plugins.registry import installed_datasets

    name = str(_get(data, "name") or "mnist")
    datasets = installed_datasets()
    if name not in datasets:
        raise ConfigError("data.name", f"no installed plugin provides a dataset called {name!r}", datasets)
    if name == "idx" and not _get(data, "dir"):
        raise ConfigError("data.dir", "data.name=idx reads a folder of IDX files: give it as data.dir=<folder>")
    return name


def load_dataset(data: Any) -> mnist.Mnist:
    """The dataset ``data.name`` names (default ``mnist``), through the plugins that register datasets."""
    from psdk.plugins.registry import installed_datasets, load_target

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


MNIST_SHAPE = (784, 10)
"""MNIST's pixels per image and classes: known without reading its files (they are checked against their MD5s)."""


def _idx_file(folder: Path, key: str) -> Path | None:
    stem = IDX_FILES[key]
    return next((p for p in (folder / f"{stem}.gz", folder / stem) if p.is_file()), None)


def _idx_pixels(path: Path) -> int:
    """Pixels per image from an IDX images file's header alone (its first 4 + 4 x dims bytes)."""
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as stream:
            head = stream.read(4)
            dims = stream.read(4 * head[3]) if len(head) == 4 else b""
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DataError(f"{path} cannot be read: {exc}") from None
    sizes = [int.from_bytes(dims[i : i + 4], "big") for i in range(0, len(dims), 4)]
    if len(head) != 4 or head[:3] != b"\x00\x00\x08" or len(sizes) < 2 or len(dims) != 4 * head[3]:
        raise DataError(f"{path} is not an IDX file of unsigned-byte images")
    return math.prod(sizes[1:])


def known_shape(data: Any) -> tuple[int, int] | None:
    """``(pixels per image, classes)`` of the data set ``data.name`` names, without decoding its images.

    MNIST's are known; an ``idx`` folder's come from its training images'
    header and its label files (small); a plugin's data set is only known
    once loaded (None: its workers check it, :func:`check_fits`).
    """
    name = check_dataset_name(data)
    if name == "mnist":
        return MNIST_SHAPE
    if name != "idx":
        return None
    folder = Path(str(_get(data, "dir"))).expanduser()
    paths = {key: _idx_file(folder, key) for key in ("train_images", "train_labels", "test_labels")}
    if any(path is None for path in paths.values()):
        return None  # the workers' loading names what is missing
    classes = 0
    for key in ("train_labels", "test_labels"):
        path = paths[key]
        assert path is not None
        labels = mnist.parse_idx(mnist.raw_bytes(path, path.suffix == ".gz"), path)
        classes = max(classes, int(labels.max(initial=0)) + 1)
    images = paths["train_images"]
    assert images is not None
    return _idx_pixels(images), classes


def check_fits(dataset: mnist.Mnist, spec: Any, name: str) -> None:
    """Refuse a model whose input size or number of classes does not fit the dataset's."""
    pixels = int(dataset.train_x.shape[1])
    classes = int(max(dataset.train_y.max(initial=0), dataset.test_y.max(initial=0))) + 1
    check_shape((pixels, classes), spec, name)


def check_shape(shape: tuple[int, int], spec: Any, name: str) -> None:
    """Refuse a model whose input or output does not fit a data set of ``shape`` (pixels, classes)."""
    pixels, classes = shape
    input_dim, num_classes = getattr(spec, "input_dim", None), getattr(spec, "num_classes", None)
    if input_dim is not None and int(input_dim) != pixels:
        raise ConfigError(
            "model.input_dim",
            f"is {input_dim}, but the {name} images have {pixels} pixels; must be {pixels} (one input per pixel)",
        )
    if num_classes is not None and int(num_classes) < classes:
        raise ConfigError(
            "model.num_classes",
            f"is {num_classes}, but the {name} labels go up to {classes - 1}; must be at least {classes}",
        )
