"""The valid range of every numeric setting, in one table, checked over the composed config before any task starts.

The schemas check a value's type, and each group's options some of its
bounds, but a value of the right type can still break a task long after it
started: ``seed=-1`` ends in numpy's traceback, ``train.threads=100000`` in
a crashed worker, ``optimizer.lr=1e39`` in a store of Inf. :data:`RANGES`
gives every numeric key of psdk's config its interval, and
:func:`check_ranges` refuses a value outside it with the key and the
interval (``seed: must be a whole number in [0, 4294967295] (numpy's
seeds), got -1``). A test walks the composed config of every group option
and fails on a numeric key with no entry here, so a new key cannot go
unchecked. What depends on the job (the message limit against the model,
the connection cap against the workers) is checked in
:mod:`psdk.config.capacity`; values a plugin adds (its rules, models,
backend options) get the generic bounds: finite, and whole numbers within
int64.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psdk.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

INT64_MAX = 2**63 - 1
"""Step counts and counters are int64 in numpy, the checkpoints and the wire."""
FLOAT32_MAX = 3.4028234663852886e38
"""The ps computes in float32: a hyper-parameter beyond this is Inf there."""
SEED_MAX = 2**32 - 1
"""numpy's legacy seeds (and so every backend's) are 32-bit."""
TIMEOUT_MAX_S = 30 * 24 * 3600.0
"""30 days: longer is never meant (null means "never" where a key allows it), and Python's and ZeroMQ's waits
overflow not far above (``threading.TIMEOUT_MAX``, int milliseconds)."""
THREADS_MAX = max(64, 4 * (os.cpu_count() or 1))
"""Threads of one pool: 4 per CPU of this host (oversubscribing further only slows it, and 100000 crashed a
worker creating them), and never below 64 so a config made on a bigger node still runs here."""
TASKS_MAX = 1024
"""The workers (and ps tasks) a ps serves at most (``ServerOptions.max_workers``)."""
DIM_MAX = 2**31 - 1
"""Layer sizes and batch sizes: int32 in some frameworks' kernels."""
CONNECTIONS_MAX = 1 << 20
"""TCP connections one ps keeps: far beyond any host's file limit."""
MESSAGE_MAX = 1 << 62
"""ZeroMQ's message limit is int64; what a connection may hold adds some slack to it."""


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (``low < value`` with ``open_low``); ``integer``: a whole number."""

    low: float
    high: float
    integer: bool = False
    open_low: bool = False
    why: str = ""

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        return above and value <= self.high

    @property
    def interval(self) -> str:
        """``[0, 4294967295]``, ``(0, 2.59e+06]``."""

        def shown(x: float) -> str:
            return str(int(x)) if self.integer else f"{x:g}"

        return f"{'(' if self.open_low else '['}{shown(self.low)}, {shown(self.high)}]"

    @property
    def kind(self) -> str:
        return "a whole number" if self.integer else "a number"

    def describe(self) -> str:
        """``a whole number in [0, 4294967295] (numpy's seeds)``: what a value must be."""
        return f"{self.kind} in {self.interval}" + (f" ({self.why})" if self.why else "")


def _int(low: int, high: int, why: str = "") -> Range:
    return Range(low, high, integer=True, why=why)


def _positive(high: float, why: str = "") -> Range:
    return Range(0.0, high, open_low=True, why=why)


def _float(low: float, high: float, why: str = "") -> Range:
    return Range(low, high, why=why)


COUNT = _int(0, INT64_MAX, "int64")
STEPS = _int(1, INT64_MAX, "int64")
TIMEOUT = _positive(TIMEOUT_MAX_S, "seconds, at most 30 days")
PERIOD = _float(0.0, TIMEOUT_MAX_S, "seconds, at most 30 days; 0 is off")
THREADS = _int(1, THREADS_MAX, "4 per CPU of this host, at least 64")
FRACTION = _float(0.0, 1.0)
DECAY = Range(0.0, 1.0, why="each step keeps this much: 1 or more never forgets")
FLOAT32 = _float(0.0, FLOAT32_MAX, "float32, as the ps computes")
TASKS = _int(1, TASKS_MAX, "a ps serves at most 1024 workers")
DIM = _int(1, DIM_MAX, "int32")

RANGES: dict[str, Range] = {
    "seed": _int(0, SEED_MAX, "numpy's seeds"),
    "task_index": _int(0, TASKS_MAX - 1, "a ps serves at most 1024 workers"),
    "train.steps": STEPS,
    "train.epochs": _positive(1e12, "the steps they make must fit int64"),
    "train.batch_size": DIM,
    "train.validate_every": COUNT,
    "train.log_every": COUNT,
    "train.threads": THREADS,
    "train.final_wait_s": PERIOD,
    "checkpoint.every_steps": COUNT,
    "checkpoint.every_seconds": PERIOD,
    "checkpoint.keep": COUNT,
    "recovery.max_restarts": COUNT,
    "recovery.timeout_s": TIMEOUT,
    "liveness.stall_timeout_s": TIMEOUT,
    "liveness.start_timeout_s": TIMEOUT,
    "liveness.interval_s": TIMEOUT,
    "placement.compute_nice": _int(0, 19, "a worker may lower its priority, never raise it"),
    "placement.gpu_memory_fraction": Range(0.0, 1.0, open_low=True),
    "placement.towers": _int(1, 1024, "devices one worker drives"),
    "progress.every_s": TIMEOUT,
    "report.target_accuracy": FRACTION,
    "report.target": _float(-FLOAT32_MAX, FLOAT32_MAX, "a value of the workload's primary metric, which may be a loss"),
    "data.validation_size": _int(0, DIM_MAX, "less than the training set"),
    "transport.heartbeat_interval_s": TIMEOUT,
    "transport.heartbeat_timeout_s": TIMEOUT,
    "transport.request_timeout_s": TIMEOUT,
    "transport.init_timeout_s": TIMEOUT,
    "transport.startup_timeout_s": TIMEOUT,
    "transport.max_message_bytes": _int(1, MESSAGE_MAX, "and at least the job's largest message"),
    "transport.io_threads": THREADS,
    "ps.io_threads": THREADS,
    "ps.log_every_s": TIMEOUT,
    "ps.idle_timeout_s": TIMEOUT,
    "ps.max_connections": _int(1, CONNECTIONS_MAX, "and at least 2 per worker"),
    "ps.pause_lease_s": TIMEOUT,
    "model.hidden": DIM,
    "model.input_dim": DIM,
    "model.num_classes": _int(2, DIM_MAX, "int32"),
    "model.init_stddev": _positive(FLOAT32_MAX, "float32"),
    "model.dim": DIM,  # model=dlrm: a table row's width
    "model.capacity": _int(1, 2**40 - 1, "a table's rows (TableSpec)"),
    "model.bottom": DIM,
    "model.top": DIM,
    "model.init_scale": _float(0.0, FLOAT32_MAX, "float32"),
    "optimizer.lr": _positive(FLOAT32_MAX, "float32, as the ps computes"),
    "optimizer.momentum": _float(0.0, 1.0, "above 1 the momentum grows without bound"),
    "optimizer.weight_decay": FLOAT32,
    "optimizer.decay_rate": FRACTION,
    "optimizer.decay_steps": STEPS,
    "optimizer.warmup_steps": COUNT,
    "optimizer.beta1": DECAY,
    "optimizer.beta2": DECAY,
    "optimizer.alpha": DECAY,
    "optimizer.eps": FLOAT32,
    "optimizer.initial_accumulator_value": FLOAT32,
    "sync.replicas_to_aggregate": TASKS,
    "sync.staleness": COUNT,
    "topology.num_ps": TASKS,
    "topology.num_workers": TASKS,
    "topology.partition_min_bytes": _int(0, INT64_MAX, "bytes; 0 or null: no variable is split"),
    "topology.partitions": DIM,
    "launcher.ready_timeout_s": TIMEOUT,
    "launcher.shutdown_timeout_s": TIMEOUT,
    "launcher.num_cpus": _positive(1e6, "CPUs Ray may use"),
    "launcher.cpus_per_ps": _positive(1e6, "Ray takes fractions"),
    "launcher.cpus_per_worker": _positive(1e6, "Ray takes fractions"),
    "launcher.gpus_per_worker": _float(0.0, 1e6, "0: CPU workers"),
}
"""Every numeric key of psdk's config tree and its valid values (a list's: each entry's)."""

GENERIC_INT = Range(-(2**63), INT64_MAX, integer=True, why="int64")
GENERIC_FLOAT = Range(-math.inf, math.inf, why="finite")
"""What a numeric key no entry names (a plugin's rule, model or backend option) must be."""


def numeric_leaves(cfg: DictConfig) -> Iterator[tuple[str, Any, bool]]:
    """``(key, value, typed)`` of every numeric leaf: a list's entries under the list's key; ``typed``: the
    schema makes it a number (so it is one even while null). Values are resolved (one that cannot be is left
    to the code that reads it), and those given as an interpolation come last: a value out of range is named
    by the key it was given to (``train.steps``, not ``optimizer.decay_steps: ${train.steps}``)."""
    leaves = list(_leaves(cfg, ""))
    yield from (leaf[:3] for leaf in leaves if not leaf[3])
    yield from (leaf[:3] for leaf in leaves if leaf[3])


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any, bool, bool]]:
    from omegaconf import DictConfig, ListConfig  # only here: psdk.config.options imports this table without it
    from omegaconf.nodes import FloatNode, IntegerNode

    keys: Any = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if prefix == "" and key == "hydra":
            continue
        path = f"{prefix}{key}" if isinstance(node, DictConfig) else prefix.rstrip(".")
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none() and not child._is_missing():
                yield from _leaves(child, f"{path}.")
            continue
        try:
            value = node[key]
        except Exception:  # an interpolation that does not resolve: its reader names it
            continue
        typed = isinstance(child, (IntegerNode, FloatNode))
        if typed or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            yield path, value, typed, child._is_interpolation()


def range_of(key: str, value: Any = None) -> Range | None:
    """``key``'s range: its entry, else the generic one for a plugin's key; None for a key outside numbers."""
    found = RANGES.get(key)
    if found is not None:
        return found
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return GENERIC_INT if isinstance(value, int) else GENERIC_FLOAT


def check_value(key: str, value: Any) -> None:
    """Refuse ``value`` for ``key`` when it lies outside the key's range, naming both."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    limits = range_of(key, value)
    if limits is None:
        return
    whole = isinstance(value, int) or (math.isfinite(value) and value == int(value))
    if limits.contains(value) and (whole or not limits.integer):
        return
    raise ConfigError(key, f"must be {limits.describe()}, got {value}")


def check_ranges(cfg: DictConfig) -> None:
    """Every numeric setting of ``cfg`` within its range (:data:`RANGES`), before any task starts."""
    for key, value, _ in numeric_leaves(cfg):
        check_value(key, value)
