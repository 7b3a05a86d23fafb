"""Device placement: which device each worker task trains on.

The rule: a worker uses ``cuda:N`` with N its rank among the workers on its
host modulo the GPUs visible to it, honouring ``CUDA_VISIBLE_DEVICES``; the
CPU when no GPU is visible or ``device=cpu`` (soft placement, as TensorFlow
had it). The launcher can instead give each worker only its own GPU, by
setting ``CUDA_VISIBLE_DEVICES`` before the framework loads, so a framework
that grabs memory on every visible GPU touches only that one; the worker then
sees one GPU and uses ``cuda:0``. Device strings are framework-neutral; each
backend turns them into its own device objects. The ps never uses a GPU.

A worker with ``placement.towers=N`` (in-graph replication, docs/placement.md)
drives N devices: the N GPUs after those of the workers before it on its host
(modulo the GPUs it sees), or, without a GPU, N CPU replicas ``cpu:0`` ..
``cpu:N-1``. With one tower nothing changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from psdk.errors import ConfigError
from psdk.protocol.cluster import ClusterSpec

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def visible_gpus(env: Mapping[str, str] | None = None, probe: bool = True) -> list[str]:
    """GPU ids this process may use, as ``CUDA_VISIBLE_DEVICES`` names them.

    Without that variable, ``nvidia-smi -L`` is asked (never a framework, so
    the launcher stays framework-free); no driver means no GPU.
    """
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        ids = []
        for part in value.split(","):
            part = part.strip()
            if not part or part.startswith("-"):
                break  # CUDA stops at the first invalid id; "-1" hides every GPU
            ids.append(part)
        return ids
    if not probe or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


class Placement(ABC):
    """Chooses a worker's devices; a list so one worker may later drive several."""

    @abstractmethod
    def devices(self, cluster: ClusterSpec, task_index: int, gpus: Sequence[str]) -> list[str]:
        """Devices for worker ``task_index`` given the GPU ids visible to it."""


def towers_of(towers: int | Sequence[int], task_index: int) -> int:
    """Worker ``task_index``'s towers: ``towers`` itself, or its entry of a list (cycled, as ``worker_backends``)."""
    if isinstance(towers, int):
        return towers
    return int(towers[task_index % len(towers)])


def check_towers(towers: object) -> int | tuple[int, ...]:
    """``placement.towers`` checked: a whole number >= 1, or a non-empty list of them (one per worker, cycled)."""
    given = list(towers) if isinstance(towers, (list, tuple)) else [towers]
    values = [v for v in given if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
    if not values or len(values) < len(given):
        raise ConfigError(
            "placement.towers",
            f"must be a whole number >= 1 (devices per worker) or a list of them, one per worker, got {towers!r}",
        )
    return tuple(values) if isinstance(towers, (list, tuple)) else values[0]


class RankPlacement(Placement):
    """``cuda:<local rank mod visible GPUs>``, else the CPU; with towers, that many devices per worker."""

    def __init__(self, device: str = "auto", towers: int | Sequence[int] = 1):
        if device not in DEVICE_CHOICES:
            raise ConfigError("placement.device", f"got {device!r}", DEVICE_CHOICES)
        self.device = device
        self.towers = check_towers(towers)

    def _first_gpu(self, cluster: ClusterSpec, task_index: int) -> int:
        """How many GPUs the workers before this one on its host take: where its own begin."""
        host = cluster.worker_host(task_index)
        return sum(towers_of(self.towers, i) for i in range(task_index) if cluster.worker_host(i) == host)

    def _gpus(self, cluster: ClusterSpec, task_index: int, gpus: Sequence[str]) -> list[int]:
        first = self._first_gpu(cluster, task_index)
        return [(first + k) % len(gpus) for k in range(towers_of(self.towers, task_index))]

    def devices(self, cluster: ClusterSpec, task_index: int, gpus: Sequence[str]) -> list[str]:
        count = towers_of(self.towers, task_index)
        if self.device == "cpu" or not gpus:
            return ["cpu"] if count == 1 else [f"cpu:{k}" for k in range(count)]
        return [f"cuda:{index}" for index in self._gpus(cluster, task_index, gpus)]

    def isolation_env(self, cluster: ClusterSpec, task_index: int, gpus: Sequence[str]) -> dict[str, str]:
        """Environment that shows worker ``task_index`` only its own GPU(s) (empty on CPU)."""
        if self.device == "cpu" or not gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i] for i in dict.fromkeys(self._gpus(cluster, task_index, gpus)))}


def pin_to_cpu(local_rank: int) -> int | None:
    """Pin the calling thread, and the threads it starts later, to CPU ``local_rank`` mod CPUs.

    Workers that share a host then stop trading cores with each other; the
    ps tasks and the ZeroMQ I/O threads (started earlier) stay free to run
    wherever a core is idle.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[local_rank % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value (Linux sets it per thread).

    A worker's compute then yields its core at once to a ps or to its own
    I/O thread when they have a message to move, which shortens every other
    worker's wait.
    """
    if nice > 0 and hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def check_memory_fraction(fraction: float | None) -> float | None:
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ConfigError("placement.gpu_memory_fraction", f"must be in (0, 1], got {fraction}")
    return fraction
