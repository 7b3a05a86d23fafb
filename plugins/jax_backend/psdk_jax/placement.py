"""psdk's device string and thread count to JAX's setup, decided by pure functions where it can be.

JAX reads most of its setup once, when its first client starts (the first
``jax.devices()`` or array): the GPU allocator's environment variables and
the size of XLA's CPU thread pool. So :func:`start` runs before anything
else touches JAX in a worker, and says when it came too late.

* **Device.** ``cpu`` or ``cuda:N`` (:func:`psdk.plugins.backends.kit.gpu_index`);
  ``cuda:N`` is the N-th of ``jax.devices("gpu")`` when JAX sees that many,
  otherwise the CPU with a warning (:func:`psdk.plugins.backends.kit.fall_back_to_cpu`).
  The chosen device becomes ``jax_default_device`` and holds the model's
  params. psdk's launcher shows each worker only its own GPU
  (``placement.isolate_gpus``), so JAX never starts a context on the others.
* **GPU memory** (:func:`memory_env`). Without ``gpu_memory_fraction`` the
  allocator grows on demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), as the
  TensorFlow backend's memory growth does, instead of JAX's default of
  taking 75% of the GPU at start, which would starve a torch or TensorFlow
  worker on the same GPU; with it, JAX preallocates exactly that fraction
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``), a hard cap. A variable the user set
  is kept.
* **Threads** (:func:`thread_cpus`). In jaxlib 0.10 the
  ``intra_op_parallelism_threads`` and ``--xla_cpu_multi_thread_eigen`` of
  ``XLA_FLAGS`` no longer change anything on the CPU (measured: a 1500x1500
  matmul keeps both cores busy with either), but XLA sizes its CPU thread
  pool from the CPUs the process may run on when the client starts. So
  :func:`start` narrows this thread's CPU affinity to ``threads`` CPUs while
  the client starts, then gives every thread, XLA's new ones included, the
  affinity it had: the pool has ``threads`` threads and they are not pinned
  (measured: 1.0 core busy instead of 2.0 with ``threads=1``). Where affinity
  cannot be set (not Linux) the pool keeps its size.
* **Towers** (``placement.towers``, :func:`start`'s ``cpu_devices``). CPU
  replicas are JAX CPU devices, of which XLA makes one unless told before
  its CPU client starts (``jax_num_cpu_devices``, what
  ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` says too): so
  ``start`` asks for one per tower. A process whose JAX started with fewer
  is refused by name.
* **Dispatch.** A worker waits for each step's result, so JAX's asynchronous
  dispatch on the CPU would only hand the work to another thread and back:
  :func:`start` turns it off (``jax_cpu_enable_async_dispatch``, also read
  when the client starts), so most of a step runs on the training thread,
  where psdk's ``placement.pin_cpus`` and ``compute_nice`` apply (measured on
  the MLP's step, 0.7 ms: 0.4-0.7 ms of CPU on the training thread, against
  0.2-0.3 ms with it on; XLA still hands some of it to its pool).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence, Set
from typing import Any

from psdk.errors import ConfigError
from psdk.plugins.backends import kit

log = logging.getLogger(__name__)

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def memory_env(device: str, fraction: float | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables to set before JAX starts its GPU client (see the module docstring)."""
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ConfigError("placement.gpu_memory_fraction", f"must be in (0, 1], got {fraction}")
    if kit.gpu_index(device) is None:
        return {}
    wanted = {PREALLOCATE: "false"} if fraction is None else {MEM_FRACTION: f"{fraction:g}"}
    return {key: value for key, value in wanted.items() if key not in environ}


def thread_cpus(threads: int | None, allowed: Set[int]) -> set[int] | None:
    """The CPUs to start XLA's CPU client on so its pool has ``threads`` threads; None: leave it be."""
    if not threads or threads >= len(allowed):
        return None
    return set(sorted(allowed)[:threads])


def client_started() -> bool:
    """Whether JAX has started its clients in this process (then devices and pools are fixed)."""
    try:
        from jax._src import xla_bridge  # no public API tells; without it, assume not started
    except ImportError:
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if callable(started) else False


def start(
    device: str,
    threads: int | None,
    memory_fraction: float | None,
    jax: Any,
    *,
    in_line: bool = True,
    cpu_devices: int = 1,
) -> bool:
    """Start JAX's clients for ``device`` with ``threads`` CPU threads; False if they had already started.

    ``in_line=False`` keeps JAX's asynchronous CPU dispatch (for a loop that does not wait for each step).
    ``cpu_devices``: the CPU devices towers need (one per tower); refused if JAX started with fewer.
    """
    env = memory_env(device, memory_fraction, os.environ)
    if client_started():
        have = len(jax.devices("cpu"))
        if have < cpu_devices:
            raise ConfigError(
                "placement.towers",
                f"JAX started in this process with {have} CPU device(s) before psdk could ask for {cpu_devices}; "
                f"set XLA_FLAGS=--xla_force_host_platform_device_count={cpu_devices} before JAX starts",
            )
        log.info("JAX had already started in this process; its devices, memory and CPU threads stay as they are")
        return False
    os.environ.update(env)
    if cpu_devices > 1:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    # Read when the CPU client starts. A worker waits for every step's result, so asynchronous
    # dispatch would only hand the work to another thread and back.
    jax.config.update("jax_cpu_enable_async_dispatch", not in_line)
    cpus = thread_cpus(threads, os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if cpus is None:
        jax.devices()
        return True
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        jax.devices()
    finally:
        _restore_affinity(cpus, before)
    return True


def _restore_affinity(narrowed: set[int], before: Set[int]) -> None:
    """Give this thread and the threads started while it was narrowed their former CPUs back."""
    for task in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(task)) == narrowed:
                os.sched_setaffinity(int(task), before)
        except OSError:  # a thread that has ended since listing
            continue
    os.sched_setaffinity(0, before)


def choose(device: str, gpus: Sequence[Any], cpu: Any) -> tuple[str, Any]:
    """psdk's device string for this process and the JAX device it names (the CPU if that GPU is missing)."""
    used = kit.fall_back_to_cpu(device, len(gpus), "jax")
    index = kit.gpu_index(used)
    return used, (cpu if index is None else gpus[index])


def choose_towers(devices: Sequence[str], gpus: Sequence[Any], cpus: Sequence[Any]) -> list[tuple[str, Any]]:
    """psdk's device string and JAX device of each tower: ``cuda:N`` the N-th GPU, ``cpu:K`` the K-th CPU device."""
    names = kit.fall_back_towers(devices, len(gpus), "jax")
    chosen = []
    for name in names:
        index = kit.gpu_index(name)
        chosen.append((name, gpus[index] if index is not None else cpus[kit.cpu_index(name) or 0]))
    return chosen


def gpu_devices(jax: Any) -> list[Any]:
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:  # no GPU platform in this jaxlib, or no GPU
        return []
