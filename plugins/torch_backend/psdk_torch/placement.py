"""Where a torch worker runs: psdk's device string, its threads and its share of a GPU's memory.

``cuda:N`` is used when torch sees that GPU; otherwise the worker trains on
the CPU and says so (:func:`psdk.plugins.backends.kit.fall_back_to_cpu`, the soft
placement every backend shares), so a job written for GPUs still runs on a
laptop. A device string psdk does not know is refused by name.
"""

from __future__ import annotations

import contextlib

import torch

from psdk.launch.placement import check_memory_fraction
from psdk.plugins.backends import kit


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def setup(device: str, threads: int | None = None, gpu_memory_fraction: float | None = None) -> torch.device:
    """Pin torch's threads and choose its device for ``device``; the device chosen."""
    check_memory_fraction(gpu_memory_fraction)
    if threads:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # settable once per process, before any parallel work
            torch.set_num_interop_threads(1)
    chosen = torch.device(kit.fall_back_to_cpu(device, visible_gpus(), "torch"))
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        if gpu_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, chosen)
    return chosen
