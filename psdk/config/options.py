"""The typed options every task runs with, built in one place from the composed config.

Hydra's schemas check a config's keys and types when it is composed, but the
tasks used to read the raw ``DictConfig`` here and there, and settings got
lost on the way (a worker never saw ``transport.shared_memory``). Now each
task calls :func:`options_from` once and reads only the frozen dataclasses it
returns, one per config group; each checks its values and names the key it
refuses (:class:`~psdk.errors.ConfigError`). The schemas of these groups are
derived from these classes (:mod:`psdk.config.schema`), so a field added here
is a key of the config tree, and a key of the tree cannot miss a field here.

Where two keys could say the same thing, one wins, here and in
``docs/configuration.md``: on a ps ``ps.io_threads`` wins over
``transport.io_threads`` (which the workers use); ``recovery.enabled=false``
wins over ``recovery.timeout_s``; a null ``ps.pause_lease_s`` is three
``transport.heartbeat_interval_s``.

Each setting is declared once, here. :class:`TransportOptions` is not copied
into the objects of the transport, the client and the server: they hold it
(``ZmqOptions.transport``, ``ClientOptions.transport``,
``ServerOptions.transport``), so a heartbeat key reaches every task from
this one declaration. This module imports none of theirs (they import it),
and no OmegaConf until a config is read.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from psdk.config.ranges import CONNECTIONS_MAX
from psdk.errors import ConfigError
from psdk.launch.placement import DEVICE_CHOICES, check_memory_fraction, check_towers, towers_of

if TYPE_CHECKING:
    from omegaconf import DictConfig


class _Group:
    """Checks shared by the groups; ``GROUP`` prefixes the key an error names."""

    GROUP: ClassVar[str]

    def _fail(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"{self.GROUP}.{name}", message)

    def _at_least(self, low: float, *names: str, null: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if value is None and null:
                continue
            if value is None or not value >= low or (isinstance(value, float) and not math.isfinite(value)):
                also = " or null" if null else ""
                raise self._fail(name, f"must be a number >= {low:g}{also}, got {value}")

    def _positive(self, *names: str, null: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if value is None and null:
                continue
            if value is None or not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
                also = " or null" if null else ""
                raise self._fail(name, f"must be a positive number{also}, got {value}")


@dataclass(frozen=True)
class TransportOptions(_Group):
    """``transport.*``: how every task talks, held as it is by the transport, the client and the server.

    A worker passes it to :func:`psdk.connect` (``ClientOptions(transport=...)``); a ps hands it to its
    ZeroMQ transport with its own I/O threads (``ps.io_threads``) and to its server. ``secure`` and
    ``keys_dir`` say where a task's keys come from; the transport itself sees only the keys loaded.
    """

    GROUP: ClassVar[str] = "transport"
    secure: bool = True
    keys_dir: str | None = None
    shared_memory: bool = True
    doorbells: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    init_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    max_message_bytes: int = 1 << 30
    io_threads: int = 1

    def __post_init__(self) -> None:
        self._positive("heartbeat_interval_s", "request_timeout_s", "init_timeout_s", "startup_timeout_s")
        self._at_least(1, "max_message_bytes", "io_threads")
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise self._fail(
                "heartbeat_timeout_s",
                f"is {self.heartbeat_timeout_s} but must be longer than transport.heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), or a live peer is taken for dead between two heartbeats",
            )


@dataclass(frozen=True)
class PsOptions(_Group):
    """``ps.*``: what only a ps task reads."""

    GROUP: ClassVar[str] = "ps"
    bind: str | None = None
    announce_file: str | None = None
    io_threads: int | None = None
    log_every_s: float = 10.0
    idle_timeout_s: float | None = 60.0
    progress_file: str | None = None
    max_connections: int | None = None
    pause_lease_s: float | None = None

    def __post_init__(self) -> None:
        self._at_least(1, "io_threads", "max_connections", null=True)
        self._positive("log_every_s")
        self._positive("idle_timeout_s", "pause_lease_s", null=True)


@dataclass(frozen=True)
class TrainOptions(_Group):
    """``train.*``: a worker's training loop."""

    GROUP: ClassVar[str] = "train"
    steps: int = 12000
    epochs: float | None = None
    batch_size: int = 100
    validate_every: int = 500
    log_every: int = 100
    threads: int = 1
    overlap: bool = False
    final_wait_s: float = 120.0

    def __post_init__(self) -> None:
        self._at_least(1, "steps", "batch_size", "threads")
        self._at_least(0, "validate_every", "log_every", "final_wait_s")
        self._positive("epochs", null=True)


@dataclass(frozen=True)
class CheckpointOptions(_Group):
    """``checkpoint.*``: the chief's checkpoints."""

    GROUP: ClassVar[str] = "checkpoint"
    dir: str = "checkpoints"
    every_steps: int = 0
    every_seconds: float = 60.0
    keep: int = 5
    final: bool = True

    def __post_init__(self) -> None:
        self._at_least(0, "every_steps", "every_seconds", "keep")


@dataclass(frozen=True)
class RecoveryOptions(_Group):
    """``recovery.*``: the launcher restarts lost tasks, the workers wait for a lost ps, the ps for its chief."""

    GROUP: ClassVar[str] = "recovery"
    enabled: bool = True
    max_restarts: int = 3
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self._at_least(0, "max_restarts")
        self._positive("timeout_s")

    @property
    def wait_s(self) -> float | None:
        """How long a worker waits out a lost ps: ``recovery.timeout_s``, or never with recovery off."""
        return self.timeout_s if self.enabled else None

    @property
    def restarts(self) -> int:
        """Restarts per task the launcher allows: ``recovery.max_restarts``, or none with recovery off."""
        return self.max_restarts if self.enabled else 0


@dataclass(frozen=True)
class LivenessOptions(_Group):
    """``liveness.*``: each task's beat file, and when the launcher calls a task hung (psdk.runtime.liveness)."""

    GROUP: ClassVar[str] = "liveness"
    stall_timeout_s: float | None = 30.0
    start_timeout_s: float | None = 50.0
    interval_s: float = 1.0
    file: str | None = None

    def __post_init__(self) -> None:
        self._positive("interval_s")
        self._positive("stall_timeout_s", "start_timeout_s", null=True)
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 2 * self.interval_s:
            raise self._fail(
                "stall_timeout_s",
                f"is {self.stall_timeout_s} but must be longer than twice liveness.interval_s ({self.interval_s}): "
                "a beat reaches the launcher up to two intervals late",
            )

    @property
    def detect_s(self) -> float | None:
        """The longest a hang goes unnoticed: the limit, one write and one look (None: never judged)."""
        return None if self.stall_timeout_s is None else self.stall_timeout_s + 2 * self.interval_s


@dataclass(frozen=True)
class PlacementOptions(_Group):
    """``placement.*``: where a worker computes (the launcher reads ``device`` and ``isolate_gpus`` too)."""

    GROUP: ClassVar[str] = "placement"
    device: str = "auto"
    gpu_memory_fraction: float | None = None
    isolate_gpus: bool = True
    pin_cpus: bool = False
    compute_nice: int = 0
    towers: Any = 1
    """Devices each worker drives (in-graph replication, docs/placement.md): a count, or a list cycled per worker."""

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ConfigError("placement.device", f"got {self.device!r}", DEVICE_CHOICES)
        check_memory_fraction(self.gpu_memory_fraction)
        object.__setattr__(self, "towers", check_towers(self.towers))
        if not 0 <= self.compute_nice <= 19:
            raise self._fail(
                "compute_nice",
                f"must be in [0, 19], got {self.compute_nice}: a worker may lower its training thread's priority, "
                "never raise it",
            )

    def towers_for(self, task_index: int) -> int:
        """Worker ``task_index``'s towers (a list of counts cycles over the workers)."""
        return towers_of(self.towers, task_index)


GROUPS: dict[str, type[_Group]] = {
    "transport": TransportOptions,
    "ps": PsOptions,
    "train": TrainOptions,
    "checkpoint": CheckpointOptions,
    "recovery": RecoveryOptions,
    "placement": PlacementOptions,
    "liveness": LivenessOptions,
}
"""The config groups read through typed options, and their classes (the schemas derive from these)."""


@dataclass(frozen=True)
class TaskOptions:
    """Every typed group of one task's config, built once at the task's start (:func:`options_from`)."""

    transport: TransportOptions = field(default_factory=TransportOptions)
    ps: PsOptions = field(default_factory=PsOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    recovery: RecoveryOptions = field(default_factory=RecoveryOptions)
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    liveness: LivenessOptions = field(default_factory=LivenessOptions)

    def ps_io_threads(self, num_workers: int) -> int:
        """A ps's ZeroMQ I/O threads: ``ps.io_threads``, else one per worker up to the CPUs (never transport's)."""
        if self.ps.io_threads is not None:
            return self.ps.io_threads
        return min(max(1, num_workers), os.cpu_count() or 1)

    def ps_max_connections(self, num_workers: int) -> int:
        """TCP connections a ps keeps: ``ps.max_connections``, else 4 per worker + 16; never fewer than 2 per worker."""
        limit = self.ps.max_connections
        if limit is None:
            return 4 * num_workers + 16
        if limit < 2 * num_workers:
            raise ConfigError(
                "ps.max_connections",
                f"is {limit} but each of the {num_workers} workers makes two connections to every ps; must be null "
                f"or in [{2 * num_workers}, {CONNECTIONS_MAX}]: use ps.max_connections={4 * num_workers + 16} or null "
                "(4 per worker + 16, room for restarted workers)",
            )
        return limit


def _group(cls: type[_Group], node: Any) -> _Group:
    """One group's options from its config node (typed by its schema already, so only values are checked)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
    except InterpolationResolutionError as exc:
        raise ConfigError(f"{cls.GROUP}.{exc.key}", f"cannot be resolved: {str(exc).splitlines()[0]}") from None
    assert isinstance(values, dict)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:  # a config composed without psdk's schemas
        raise ConfigError(f"{cls.GROUP}.{unknown[0]}", "there is no such key", sorted(names))
    return cls(**{str(k): v for k, v in values.items()})


def options_from(cfg: DictConfig) -> TaskOptions:
    """The typed options of every group in :data:`GROUPS`, checked; the one way a task reads those groups."""
    groups = {name: _group(cls, cfg.get(name)) for name, cls in GROUPS.items()}
    return TaskOptions(**groups)  # type: ignore[arg-type]
