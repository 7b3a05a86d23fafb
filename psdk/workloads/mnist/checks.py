"""The MNIST workload's checks: its data set's shape and size, known before any task starts.

The launcher runs :func:`check` (the workload's ``check`` entry) before it
starts a task, and :func:`train_size` (its ``train_size`` entry) turns
``train.epochs`` into steps; psdk's core knows neither MNIST's shape nor
its size, only these entries. A worker checks what it loaded again
(:func:`load_images`, :func:`check_fits`): a plugin's data set is only known
once loaded.

The workload reads any data set that returns a :class:`~psdk.data.mnist.Mnist`
(flat uint8 images, int labels): ``mnist`` (the default, ``data.name`` null),
``idx`` (a folder of IDX files) or a plugin's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from psdk.data import datasets, mnist
from psdk.errors import ConfigError, DataError

DATASET = "mnist"
"""The data set of a job whose ``data.name`` is null (the default)."""

MNIST_SHAPE = (784, 10)
"""MNIST's pixels per image and classes: known without reading its files (they are checked against their MD5s)."""


def dataset_name(data: Any) -> str:
    """``data.name`` (null: ``mnist``), refused when no plugin provides it (or ``idx`` lacks its folder)."""
    name = datasets.check_dataset_name(data, DATASET)
    if name == "idx" and not data.get("dir"):
        raise ConfigError("data.dir", "data.name=idx reads a folder of IDX files: give it as data.dir=<folder>")
    return name


def check_images(loaded: Any, name: str, target: str) -> mnist.Mnist:
    """``loaded``, what dataset ``name`` (``target``) returned, refused unless it is flat uint8 images and labels."""
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


def load_images(data: Any) -> mnist.Mnist:
    """The data set ``data.name`` names (null: ``mnist``), loaded by its plugin and checked (:func:`check_images`)."""
    from psdk.plugins.registry import installed_datasets

    name = dataset_name(data)
    loaded = datasets.load_dataset(data, DATASET)
    return check_images(loaded, name, installed_datasets()[name].target)


def load_fitting(data: Any, spec: Any) -> mnist.Mnist:
    """The data set, loaded and checked (:func:`load_images`), once the model ``spec`` is known to fit it."""
    images = load_images(data)
    check_fits(images, spec, dataset_name(data))
    return images


def _idx_folder(data: Any) -> Path:
    return Path(str(data.get("dir"))).expanduser()


def train_total(data: Any) -> int | None:
    """Images in the training set (validation not yet held out), without decoding them; None where unknown.

    MNIST's are known (its files are checked against their MD5 sums); an
    ``idx`` folder's come from its training images' header; a plugin's data
    set is only known once loaded.
    """
    name = dataset_name(data)
    if name == DATASET:
        return mnist.TRAIN_SIZE
    if name == "idx" and (images := datasets.idx_file(_idx_folder(data), "train_images")) is not None:
        return datasets.idx_dims(images)[0]
    return None


def train_size(cfg: Any) -> int:
    """The workload's ``train_size`` entry: training images the workers share, validation held out."""
    data = cfg.data
    held_out = int(data.get("validation_size", 0) or 0)
    total = train_total(data)
    if total is None:
        total = len(load_images(data).train_x)  # a plugin's data set: counted
    if not 0 <= held_out < total:
        raise ConfigError("data.validation_size", f"must be in [0, {total}), got {held_out}")
    return total - held_out


def known_shape(data: Any) -> tuple[int, int] | None:
    """``(pixels per image, classes)`` of the data set ``data.name`` names, without decoding its images.

    MNIST's are known; an ``idx`` folder's come from its training images'
    header and its label files (small); a plugin's data set is only known
    once loaded (None: its workers check it, :func:`check_fits`).
    """
    name = dataset_name(data)
    if name == DATASET:
        return MNIST_SHAPE
    if name != "idx":
        return None
    folder = _idx_folder(data)
    paths = {key: datasets.idx_file(folder, key) for key in ("train_images", "train_labels", "test_labels")}
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
    dims = datasets.idx_dims(images)
    if len(dims) < 2:
        raise DataError(f"{images} is not an IDX file of unsigned-byte images")
    return math.prod(dims[1:]), classes


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


def check_split(cfg: Any, total: int, num_workers: int) -> None:
    """``data.validation_size`` leaves training images, and ``train.batch_size`` fits in a worker's shard of them."""
    held_out = int(cfg.data.validation_size)
    if not 0 <= held_out < total:
        raise ConfigError("data.validation_size", f"must be in [0, {total}), got {held_out}")
    shard = (total - held_out) // num_workers
    batch_size = int(cfg.train.batch_size)
    if batch_size > shard:
        raise ConfigError(
            "train.batch_size",
            f"{batch_size} is more than a worker's shard of the training set ({shard} images: "
            f"{total - held_out} split over {num_workers} workers); use train.batch_size={min(shard, 100)} "
            "or fewer workers",
        )


def check(cfg: Any) -> None:
    """The workload's ``check`` entry: the model fits the data, and the data its split, before any task starts.

    Called by the launcher for the whole job and by a worker started by
    hand for its own; the data set's files are not decoded (its shape and
    size come from what is known or from headers).
    """
    from psdk.config import build

    name = dataset_name(cfg.data)
    shape = known_shape(cfg.data)
    if shape is not None:
        check_shape(shape, build.model_spec(cfg), name)
    total = train_total(cfg.data)
    if total is not None:  # a plugin's data set: its workers split it and say what does not fit
        check_split(cfg, total, build.num_workers(cfg))
