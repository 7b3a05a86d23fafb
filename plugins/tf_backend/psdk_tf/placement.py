"""Where a TensorFlow worker runs: psdk's device string turned into TensorFlow's device setup.

:func:`plan` decides from plain values (the device psdk's placement rule
chose, how many GPUs TensorFlow sees, the memory policy), so it is tested on
machines without a GPU; :func:`apply` carries a plan out through
``tf.config``, which TensorFlow accepts only before it initialises its
devices (at the first op).

* ``cuda:N`` keeps only TensorFlow's N-th GPU visible
  (``tf.config.set_visible_devices``), so the worker allocates nothing on the
  others; inside TensorFlow that GPU is then ``/GPU:0``. ``cpu`` hides every
  GPU. No GPU, or fewer than N + 1, means the CPU and a log line, like soft
  placement: the device string is read, and the fallback decided and logged,
  by :mod:`psdk.plugins.backends.kit`, as for every backend.
* Memory: ``placement.gpu_memory_fraction`` becomes a hard limit of that share
  of the GPU's memory (TensorFlow 2 takes megabytes, so the size is asked of
  ``nvidia-smi``); without it memory grows on demand (TF 1's
  ``allow_growth``), as torch's allocator does, so that several workers can
  share one GPU. A ``TF_FORCE_GPU_ALLOW_GROWTH`` set by the user is left to
  TensorFlow.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psdk.errors import ConfigError
from psdk.launch.placement import check_memory_fraction, visible_gpus
from psdk.plugins.backends import kit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    device: str
    """The psdk device actually used: ``"cpu"`` or ``"cuda:N"``."""
    tf_device: str
    """Its name inside TensorFlow once only that GPU is visible: ``"/CPU:0"`` or ``"/GPU:0"``."""
    gpu: int | None = None
    """Index, among the GPUs TensorFlow sees, of the one to keep visible; None hides them all."""
    memory_growth: bool = False
    memory_limit_mb: int | None = None
    notes: tuple[str, ...] = ()
    """Why the plan differs from what was asked, for the log."""


CPU = Plan("cpu", "/CPU:0")


def plan(
    device: str,
    gpus_seen: int,
    memory_fraction: float | None = None,
    total_memory_mb: int | None = None,
    growth_left_to_tf: bool = False,
) -> Plan:
    """The device setup for ``device`` on a machine where TensorFlow sees ``gpus_seen`` GPUs.

    A GPU TensorFlow does not see means the CPU, with a warning logged here.
    """
    check_memory_fraction(memory_fraction)
    chosen = kit.fall_back_to_cpu(device, gpus_seen, "TensorFlow")
    index = kit.gpu_index(chosen)
    if index is None:
        return CPU
    if memory_fraction is not None:
        if total_memory_mb:
            limit = max(1, int(memory_fraction * total_memory_mb))
            return Plan(chosen, "/GPU:0", index, memory_limit_mb=limit)
        note = (
            "the GPU's memory size is unknown (no nvidia-smi answer), so "
            "placement.gpu_memory_fraction gives way to on-demand growth"
        )
        return Plan(chosen, "/GPU:0", index, memory_growth=True, notes=(note,))
    return Plan(chosen, "/GPU:0", index, memory_growth=not growth_left_to_tf)


def physical_id(index: int, env: Mapping[str, str] | None = None) -> str:
    """The id ``nvidia-smi`` knows TensorFlow's GPU ``index`` by (``CUDA_VISIBLE_DEVICES`` remaps)."""
    env = os.environ if env is None else env
    ids = visible_gpus(env, probe=False)
    if "CUDA_VISIBLE_DEVICES" in env and index < len(ids):
        return ids[index]
    return str(index)


def total_memory_mb(gpu_id: str) -> int | None:
    """Total memory of one GPU in MiB, from ``nvidia-smi``; None when it cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    command = ["nvidia-smi", f"--id={gpu_id}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return int(first[0]) if out.returncode == 0 and first and first[0].strip().isdigit() else None


def gpu_to_use(device: str, gpus_seen: int) -> int | None:
    """Index of the GPU ``device`` names, if TensorFlow sees it (asked before planning, for its memory size)."""
    index = kit.gpu_index(device)
    return index if index is not None and index < gpus_seen else None


def apply(chosen: Plan, threads: int | None, tf: Any) -> None:
    """Carry ``chosen`` out; a process whose TensorFlow already started keeps its setup and says so."""
    for note in chosen.notes:
        log.warning("%s", note)
    if threads:
        _pin_threads(tf, threads)
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    try:
        tf.config.set_visible_devices([gpus[chosen.gpu]] if chosen.gpu is not None else [], "GPU")
        if chosen.gpu is not None and chosen.memory_limit_mb is not None:
            config = tf.config.LogicalDeviceConfiguration(memory_limit=chosen.memory_limit_mb)
            tf.config.set_logical_device_configuration(gpus[chosen.gpu], [config])
        elif chosen.gpu is not None and chosen.memory_growth:
            tf.config.experimental.set_memory_growth(gpus[chosen.gpu], True)
    except RuntimeError as exc:  # devices are fixed once TensorFlow has run an op
        log.warning("TensorFlow has already initialised its devices; keeping them (%s)", exc)


def _pin_threads(tf: Any, threads: int) -> None:
    """``threads`` intra-op threads and one inter-op thread, as the torch backend pins them."""
    threading = tf.config.threading
    try:
        threading.set_intra_op_parallelism_threads(threads)
        threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # settable only before TensorFlow starts
        current = threading.get_intra_op_parallelism_threads()
        if current != threads:
            log.warning(
                "TensorFlow already runs with %s intra-op threads in this process; %d not applied",
                current or "its default number of",
                threads,
            )


def tower_names(devices: Sequence[str]) -> list[str]:
    """TensorFlow's name of each tower's device once only the towers' GPUs are visible, in their order."""
    gpus = list(dict.fromkeys(i for i in map(kit.gpu_index, devices) if i is not None))
    names = []
    for device in devices:
        index = kit.gpu_index(device)
        names.append(f"/GPU:{gpus.index(index)}" if index is not None else f"/CPU:{kit.cpu_index(device) or 0}")
    return names


def apply_towers(devices: Sequence[str], threads: int | None, memory_fraction: float | None, tf: Any) -> list[str]:
    """Set TensorFlow up for towers on ``devices`` (already fallen back); TensorFlow's device name of each.

    Refused by name when TensorFlow's runtime started before the logical
    CPU devices could be made (a process that ran an op first).
    """
    check_memory_fraction(memory_fraction)
    if threads:
        _pin_threads(tf, threads)
    gpu_ids = list(dict.fromkeys(i for i in map(kit.gpu_index, devices) if i is not None))
    replicas = 1 + max((kit.cpu_index(d) or 0 for d in devices if kit.gpu_index(d) is None), default=0)
    try:
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices([gpus[i] for i in gpu_ids], "GPU")
            for i in gpu_ids:
                total = total_memory_mb(physical_id(i)) if memory_fraction is not None else None
                if total and memory_fraction is not None:
                    limit = tf.config.LogicalDeviceConfiguration(memory_limit=max(1, int(memory_fraction * total)))
                    tf.config.set_logical_device_configuration(gpus[i], [limit])
                elif "TF_FORCE_GPU_ALLOW_GROWTH" not in os.environ:
                    tf.config.experimental.set_memory_growth(gpus[i], True)
        if replicas > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    except RuntimeError as exc:  # devices are fixed once TensorFlow has run an op
        have = len(tf.config.list_logical_devices("CPU"))
        if have < replicas:
            raise ConfigError(
                "placement.towers",
                f"TensorFlow started in this process with {have} CPU device(s) before psdk could make {replicas} "
                "(its logical devices are set before its first op)",
            ) from exc
        log.warning("TensorFlow has already initialised its devices; keeping them (%s)", exc)
    return tower_names(devices)
