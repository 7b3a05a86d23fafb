"""The MNIST workload's data preparation: the launcher's fetch-once, and ``python -m psdk data``.

MNIST itself (files, checksums, download, decoding) is a dataset,
:mod:`psdk.data.mnist`, registered as ``data.name=mnist``; what is MNIST's
*workload's* is when it is fetched: once by the launcher before the tasks
start, so that workers do not all download at once.
"""

from __future__ import annotations

from typing import Any

from psdk.data import mnist
from psdk.workloads.mnist.checks import DATASET, dataset_name


def _folder(data: Any) -> str:
    return str(mnist.resolve_dir(data.dir, data.cache_dir, bool(data.download), list(data.mirrors)))


def prepare(cfg: Any) -> list[str]:
    """Fetch MNIST once, here, when the job trains on it; the override that points every task at it."""
    if dataset_name(cfg.data) != DATASET:
        return []  # another dataset: each worker loads its own
    return [f"data.dir={_folder(cfg.data)}"]


def check_data(cfg: Any) -> int:
    """``python -m psdk data``: MNIST found (or downloaded) and every file's checksum verified; no training."""
    folder = mnist.resolve_dir(cfg.data.dir, cfg.data.cache_dir, bool(cfg.data.download), list(cfg.data.mirrors))
    checked = mnist.verify(folder)
    print(f"MNIST is in {folder}; the MD5 checksums of all four files are verified:")
    for path, md5 in checked:
        print(f"  {path.name:<28} md5 {md5}  ok")
    print(f"train on it with data.dir={folder} (or PSDK_DATA_DIR={folder}), e.g. python -m psdk run data.dir={folder}")
    return 0
