"""Where a torch worker runs: psdk's device string, its threads and its share of a GPU's memory.

``cuda:N`` is used when torch sees that GPU; otherwise the worker trains on
the CPU and says so (:func:`psdk.plugins.backends.kit.fall_back_to_cpu`, the soft
placement every backend shares), so a job written for GPUs still runs on a
laptop. A device string psdk does not know is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from psdk.launch.placement import check_memory_fraction
from psdk.plugins.backends import kit


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def setup(device: str, threads: int | None = None, gpu_memory_fraction: float | None = None) -> torch.device:
    """Pin torch's threads and choose its device for ``device``; the device chosen."""
    return setup_towers([device], threads, gpu_memory_fraction)[0][1]


def setup_towers(
    devices: Sequence[str], threads: int | None = None, gpu_memory_fraction: float | None = None
) -> list[tuple[str, torch.device]]:
    """Pin torch's threads and choose a device per tower: psdk's name and torch's device for each.

    One device keeps its plain name (``cpu``); towers on the CPU are named
    ``cpu:K`` and are all torch's CPU (each replica its own tensors). The
    first tower's GPU becomes the current one; the memory fraction caps every GPU used.
    """
    check_memory_fraction(gpu_memory_fraction)
    if threads:
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # settable once per process, before any parallel work
            torch.set_num_interop_threads(1)
    if len(devices) == 1:
        names = [kit.fall_back_to_cpu(devices[0], visible_gpus(), "torch")]
    else:
        names = kit.fall_back_towers(devices, visible_gpus(), "torch")
    chosen = [(name, torch.device("cpu" if kit.gpu_index(name) is None else name)) for name in names]
    gpus = list(dict.fromkeys(d for _, d in chosen if d.type == "cuda"))
    if gpus:
        torch.cuda.set_device(gpus[0])
    for gpu in gpus if gpu_memory_fraction is not None else []:
        torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, gpu)
    return chosen
