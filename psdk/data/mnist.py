"""MNIST from the four standard IDX files: found, or downloaded and checked.

Where the files come from, in order: ``data.dir`` in the config (which
defaults to ``$PSDK_DATA_DIR``), else a cache folder (``data.cache_dir``,
default ``~/.cache/psdk/mnist``) that is filled by downloading from the
mirrors when files are missing. Every file is checked against the published
MD5 of its raw (ungzipped) bytes; a folder the user named is never written
to. The training set's first ``validation_size`` images are held out for
validation, as TensorFlow's ``read_data_sets`` did.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import logging
import math
import os
import shutil
import stat
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from psdk.errors import DataError

log = logging.getLogger(__name__)

FILES = {
    "train_images": ("train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
    "train_labels": ("train-labels-idx1-ubyte", "a25bea736e30d166cdddb491f175f624"),
    "test_images": ("t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
    "test_labels": ("t10k-labels-idx1-ubyte", "27ae3e4e09519cfbb04c329615203637"),
}
RAW_SIZES = {"train_images": 47040016, "train_labels": 60008, "test_images": 7840016, "test_labels": 10008}
"""Bytes of each standard file once ungzipped: nothing past them is decompressed (a gzip bomb stops here)."""
MAX_IDX_BYTES = 1 << 31
"""The most an IDX file of another data set may hold, whatever its header claims."""
DECODED_ARRAYS = ("train_x", "train_y", "test_x", "test_y")
DECODED_SHA256 = {
    "train_x": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "train_y": "e474323ac02fc156161b0bbb1f8c9cfeb327a74bcd9f9680a8385269a24f566c",
    "test_x": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "test_y": "2fd8de6bdb8d11780b4b96dc57847bcfe6953f7c32aa48bfcd8237c3b7847243",
}
"""The decoded arrays of the standard files: a cache entry that differs was not decoded from them."""
DECODED_KEPT = 3  # decoded copies of MNIST kept in the cache folder (one per copy of the files)
TRAIN_SIZE = 60000  # images in the training set (validation is held out of it)
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


@dataclass
class Mnist:
    """Images as uint8 (0-255, scaled to [0, 1] by :func:`split`), flattened to 784 for MNIST; labels as int64.

    Every dataset psdk trains on has this form (:mod:`psdk.data.datasets`).
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


@dataclass
class Split:
    """One worker's view: its shard of the training set, the validation and test sets.

    Images stay uint8 (``*_images``) until used: scaling a worker's 27,500
    training images and the test set to float32 up front cost each worker
    about 0.25 s of start-up, on the path to its first gradient. Training
    scales each batch as it is cut (:meth:`batch`); ``val_x`` and ``test_x``
    are scaled once, when first read.
    """

    train_images: np.ndarray
    train_y: np.ndarray
    val_images: np.ndarray
    val_y: np.ndarray
    test_images: np.ndarray
    test_y: np.ndarray
    train_size: int = 0
    """Training images of every worker's shard together (what an epoch passes over: :mod:`psdk.jobs.epochs`)."""

    def batch(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training images ``rows`` scaled to [0, 1], and their labels."""
        return to_float(self.train_images[rows]), self.train_y[rows]

    @cached_property
    def train_x(self) -> np.ndarray:
        return to_float(self.train_images)

    @cached_property
    def val_x(self) -> np.ndarray:
        return to_float(self.val_images)

    @cached_property
    def test_x(self) -> np.ndarray:
        return to_float(self.test_images)


def cache_folder(cache_dir: str | None) -> Path:
    """``data.cache_dir``, or psdk's default: where downloads and decoded arrays go."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "psdk" / "mnist"


def _find(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def raw_bytes(path: Path, gzipped: bool, known_size: int | None = None) -> bytes:
    """The file's IDX bytes, never more than ``known_size`` or than its IDX header says it holds.

    A small gzip file can expand to gigabytes (a 17 MiB file to 4 GiB): it is
    read in pieces and refused as soon as it passes what an IDX file of its
    header (or the standard file, ``known_size``) can hold.
    """
    try:
        with gzip.open(path, "rb") if gzipped else path.open("rb") as stream:
            head = stream.read(4)
            dims = stream.read(4 * head[3]) if len(head) == 4 else b""
            claimed = (
                len(head)
                + len(dims)
                + math.prod(int.from_bytes(dims[i : i + 4], "big") for i in range(0, len(dims), 4))
            )
            if known_size is None and claimed > MAX_IDX_BYTES:
                raise DataError(f"{path}: its IDX header claims {claimed} bytes, more than the 2 GiB psdk reads")
            limit = known_size if known_size is not None else claimed
            rest = stream.read(max(0, limit - len(head) - len(dims)) + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DataError(f"{path} cannot be read: {exc}") from None
    raw = head + dims + rest
    if len(raw) > limit:
        what = "of the standard file" if known_size is not None else "its IDX header gives"
        raise DataError(
            f"{path} holds more than the {limit} bytes {what}: it is not an intact IDX file (damaged, or a "
            "decompression bomb); replace it with an intact copy (`python -m psdk data data.dir=<folder>` checks one)"
        )
    return raw


def _checked(path: Path, md5: str, gzipped: bool | None = None) -> bytes:
    known = next((RAW_SIZES[k] for k, (_, digest) in FILES.items() if digest == md5), None)
    raw = raw_bytes(path, path.suffix == ".gz" if gzipped is None else gzipped, known)
    digest = hashlib.md5(raw).hexdigest()
    if digest != md5:
        raise DataError(
            f"{path} is corrupt (MD5 of its raw bytes is {digest}, expected {md5}); put an intact copy "
            "there (in psdk's download cache, deleting it is enough: it is downloaded again); "
            "`python -m psdk data data.dir=<folder>` checks all four files"
        )
    return raw


def parse_idx(raw: bytes, path: Path) -> np.ndarray:
    if len(raw) < 8 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(dims)


FILES_HINT = (
    "the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte; gzipped or not)"
)


def _missing_message(folder: Path, missing: Sequence[str], why: str, fix: str | None = None) -> str:
    names = ", ".join(f"{FILES[k][0]}.gz" for k in missing)
    fix = fix or (
        f"point data.dir=... (or PSDK_DATA_DIR) at a folder holding {FILES_HINT}, or leave both unset to "
        f"download them into {default_cache_dir()}; `python -m psdk data` checks a folder"
    )
    return f"MNIST files missing in {folder}: {names}. {why} Fix: {fix}."


def _why_missing(folder: Path) -> tuple[str, str | None]:
    """Why a folder the user named lacks the files, and the fix when the files are near."""
    if folder.is_file():
        return "That is a file, not a folder.", f"data.dir (or PSDK_DATA_DIR) names the folder: {folder.parent}"
    if not folder.is_dir():
        return "The folder does not exist.", None
    stem = FILES["train_images"][0]
    near = sorted({p.parent for pattern in (f"*/{stem}*", f"*/*/{stem}*") for p in folder.glob(pattern)})
    if near:
        return f"They are in {near[0]}.", f"use data.dir={near[0]} (or PSDK_DATA_DIR={near[0]})"
    return "That folder was named by data.dir or PSDK_DATA_DIR.", None


def _offline(errors: Sequence[BaseException]) -> bool:
    """Whether every mirror failed before any answer came: no network, DNS, or a proxy in the way."""
    return bool(errors) and all(
        isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError) for e in errors
    )


def _download_failed(folder: Path, missing: Sequence[str], errors: Sequence[tuple[str, BaseException]]) -> str:
    names = ", ".join(f"{FILES[k][0]}.gz" for k in missing)
    if _offline([e for _, e in errors]):
        why = "No mirror could be reached: this machine seems to have no internet access (or a proxy blocks it)."
    else:
        why = "Every mirror failed."
    details = "".join(f"\n  {url}: {exc}" for url, exc in errors)
    return (
        f"MNIST could not be downloaded into {folder} (missing: {names}). {why} Fix: copy {FILES_HINT} "
        "from a machine that has them (`python -m psdk data` downloads them there) and point data.dir=... "
        f"(or PSDK_DATA_DIR) at their folder, or give reachable mirrors with data.mirrors=[URL,...].{details}"
    )


def download(
    folder: Path,
    mirrors: Sequence[str] = MIRRORS,
    keys: Sequence[str] | None = None,
    timeout_s: float = 15.0,
    progress: bool = True,
) -> None:
    """Fetch the missing files into ``folder``, each checked before it is kept."""
    from tqdm import tqdm

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"MNIST cannot be downloaded into {folder}: {exc}. Fix: set data.cache_dir to a folder you can "
            f"write, or point data.dir=... (or PSDK_DATA_DIR) at a folder holding {FILES_HINT}."
        ) from None
    wanted = list(keys or FILES)
    for i, key in enumerate(wanted):
        stem, md5 = FILES[key]
        target = folder / f"{stem}.gz"
        errors: list[tuple[str, BaseException]] = []
        for mirror in mirrors:
            url = f"{mirror.rstrip('/')}/{stem}.gz"
            fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=".part")
            tmp = Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
                    total = int(resp.headers.get("Content-Length") or 0) or None
                    with tqdm(
                        total=total,
                        unit="B",
                        unit_scale=True,
                        desc=f"{stem}.gz",
                        disable=not progress,
                        leave=False,
                    ) as bar:
                        while chunk := resp.read(1 << 16):
                            out.write(chunk)
                            bar.update(len(chunk))
                _checked(tmp, md5, gzipped=True)
                os.replace(tmp, target)
                log.info("downloaded %s", url)
                break
            except (OSError, DataError) as exc:
                errors.append((url, exc))
            finally:
                tmp.unlink(missing_ok=True)
        else:
            raise DataError(_download_failed(folder, wanted[i:], errors))


def resolve_dir(
    data_dir: str | None,
    cache_dir: str | None = None,
    allow_download: bool = True,
    mirrors: Sequence[str] = MIRRORS,
    progress: bool = True,
) -> Path:
    """The folder holding all four files, downloading into the cache if needed.

    ``data_dir`` defaults to ``$PSDK_DATA_DIR``, so scripts on the public API
    find the files the same way the CLI does; no ``mirrors`` (``data.mirrors``
    left empty) are :data:`MIRRORS`.
    """
    mirrors = list(mirrors) or list(MIRRORS)
    data_dir = data_dir or os.environ.get("PSDK_DATA_DIR") or None
    if data_dir:
        folder = Path(data_dir).expanduser()
        missing = [k for k, (stem, _) in FILES.items() if _find(folder, stem) is None]
        if missing:
            raise DataError(_missing_message(folder, missing, *_why_missing(folder)))
        return folder
    folder = cache_folder(cache_dir)
    missing = [k for k, (stem, _) in FILES.items() if _find(folder, stem) is None]
    if missing:
        if not allow_download:
            raise DataError(_missing_message(folder, missing, "Downloading is off (data.download=false)."))
        download(folder, mirrors, missing, progress=progress)
    return folder


def verify(folder: Path) -> list[tuple[Path, str]]:
    """Each of the four files in ``folder`` with the MD5 it was checked against; a missing or corrupt one raises."""
    checked = []
    for key, (stem, md5) in FILES.items():
        path = _find(folder, stem)
        if path is None:
            raise DataError(_missing_message(folder, [key], ""))
        parse_idx(_checked(path, md5), path)
        checked.append((path, md5))
    return checked


def load(folder: Path, cache_dir: Path | None = None) -> Mnist:
    """Read and check the four files in ``folder``; with ``cache_dir``, once per version of the files.

    Gunzipping and checking 55 MB costs each worker about 0.4 s of CPU at
    start-up. The checked arrays are kept in ``cache_dir`` under the files'
    fingerprint (path, size, modification time): a file that changes is
    decoded and checked again, and a damaged cache entry is ignored and
    written anew. ``cache_dir`` may be shared by several users: an entry is
    used only when no other user could have written it (:func:`_only_mine`)
    and its arrays hash to the standard files' (:data:`DECODED_SHA256`,
    about 0.1 s), so an entry planted with flipped labels is never trained on.
    """
    cached = cache_dir / f"decoded-{_fingerprint(folder)}" if cache_dir is not None else None
    if cached is not None and cached.is_dir():
        try:
            _only_mine(cached)
            return _digests_match(_plausible(_read_decoded(cached), cached), cached)
        except Exception as exc:  # a damaged entry: decode the files instead, and replace it
            log.warning("ignoring the decoded-MNIST cache %s (%s); decoding the files again", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    data = _decode(folder)
    if cached is not None:
        _write_decoded(data, cached)
    return data


def _decode(folder: Path) -> Mnist:
    arrays = {}
    for key, (stem, md5) in FILES.items():
        path = _find(folder, stem)
        if path is None:
            raise DataError(_missing_message(folder, [key], ""))
        arrays[key] = parse_idx(_checked(path, md5), path)
    return Mnist(
        train_x=arrays["train_images"].reshape(-1, 784),
        train_y=arrays["train_labels"].astype(np.int64),
        test_x=arrays["test_images"].reshape(-1, 784),
        test_y=arrays["test_labels"].astype(np.int64),
    )


def _fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for key, (stem, md5) in FILES.items():
        found = _find(folder, stem)
        if found is None:
            raise DataError(_missing_message(folder, [key], ""))
        path = found.resolve()
        info = path.stat()
        digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\0{md5}\n".encode())
    return digest.hexdigest()[:32]


def _only_mine(entry: Path) -> None:
    """Refuse a cache entry (folder or file) that another user owns or that group or others may write."""
    for path in (entry, *(entry / f"{name}.npy" for name in DECODED_ARRAYS)):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            raise DataError(f"{path} is a symbolic link")
        if info.st_uid != os.geteuid():
            raise DataError(f"{path} belongs to user {info.st_uid}, not to this user ({os.geteuid()})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise DataError(f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o})")


def _digests_match(data: Mnist, path: Path) -> Mnist:
    for name in DECODED_ARRAYS:
        array = np.ascontiguousarray(getattr(data, name))
        if hashlib.sha256(array.data.cast("B")).hexdigest() != DECODED_SHA256[name]:
            raise DataError(f"{path}: {name} differs from the standard MNIST files' decoded {name}")
    return data


def _read_decoded(folder: Path) -> Mnist:
    """Images memory-mapped (a worker reads only the pages of its shard; ``split`` copies them out), labels read."""
    return Mnist(
        *(np.load(folder / f"{name}.npy", mmap_mode="r" if name.endswith("_x") else None) for name in DECODED_ARRAYS)
    )


def _plausible(data: Mnist, path: Path) -> Mnist:
    shapes = {
        "train_x": ((TRAIN_SIZE, 784), np.uint8),
        "train_y": ((TRAIN_SIZE,), np.int64),
        "test_x": ((10000, 784), np.uint8),
        "test_y": ((10000,), np.int64),
    }
    for name, (shape, dtype) in shapes.items():
        array = getattr(data, name)
        if array.shape != shape or array.dtype != dtype:
            raise DataError(f"{path}: {name} is {array.dtype}{list(array.shape)}, not {np.dtype(dtype)}{list(shape)}")
    if data.train_y.min() < 0 or data.train_y.max() > 9 or data.test_y.min() < 0 or data.test_y.max() > 9:
        raise DataError(f"{path}: labels outside 0..9")
    return data


def _write_decoded(data: Mnist, path: Path) -> None:
    """Written aside and renamed into place (several workers may write it at once); failing only skips it.

    The newest few entries are kept: tests and users with several copies of
    MNIST get one each without the folder growing by 55 MB a copy.
    """
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".decoded-"))
        for name in DECODED_ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(data, name))
            os.chmod(tmp / f"{name}.npy", 0o600)  # whatever the umask: an entry others can write is not used
        with contextlib.suppress(FileExistsError, OSError):  # OSError: ENOTEMPTY, another worker was first
            tmp.rename(path)
            tmp = None
        entries = sorted(path.parent.glob("decoded-*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[DECODED_KEPT:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        log.info("MNIST decoded but not cached in %s: %s", path.parent, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def to_float(images: np.ndarray) -> np.ndarray:
    scaled = images.astype(np.float32)
    np.divide(scaled, np.float32(255.0), out=scaled)  # in place: one array, not two (half the page faults)
    return scaled


def split(data: Mnist, worker: int, num_workers: int, validation_size: int = 5000, with_test: bool = True) -> Split:
    """Worker ``worker``'s contiguous shard of the training images left after validation."""
    if not 0 <= validation_size < len(data.train_x):
        raise DataError(f"data.validation_size must be in [0, {len(data.train_x)}), got {validation_size}")
    rest = np.arange(validation_size, len(data.train_x))
    mine = np.array_split(rest, num_workers)[worker]
    empty_x, empty_y = np.zeros((0, data.train_x.shape[1]), np.uint8), np.zeros(0, np.int64)
    return Split(
        train_images=data.train_x[mine],  # a copy (an index array), out of the memory map
        train_y=data.train_y[mine],
        val_images=data.train_x[:validation_size],
        val_y=data.train_y[:validation_size],
        test_images=data.test_x if with_test else empty_x,
        test_y=data.test_y if with_test else empty_y,
        train_size=len(rest),
    )
