"""Schemas of the Hydra config tree: a typo in a key fails at composition, naming it.

Each config group's YAML files extend one of these dataclasses (stored in
Hydra's ConfigStore as ``base_<name>`` in that group) and carry a
``_target_`` that :func:`hydra.utils.instantiate` turns into the object the
code uses. Every option of the ``sync`` group shares one schema, so a sweep
such as ``-m sync=sync,async sync.replicas_to_aggregate=2`` never fails on
one of them.

Where the code already has a dataclass for a group, the schema is derived
from it (:func:`schema_of`) rather than copied: the update rules (one schema
per rule), :class:`~psdk.consistency.SyncSpec`, and the typed options of
:mod:`psdk.config.options`. A field added there is a key here, with its type
and default, and no key here lacks a field there.

Plugins extend the tree (:mod:`psdk.plugins`): a rule or model a plugin
registers is also a choice of its group (``optimizer=<rule>``,
``model=<model>``) with its dataclass's defaults, unless ``conf/`` has a
file of that name; a backend's options are ``backend_options.<backend>.*``.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from psdk.config.options import (
    CheckpointOptions,
    LivenessOptions,
    PlacementOptions,
    PsOptions,
    RecoveryOptions,
    TrainOptions,
    TransportOptions,
)
from psdk.consistency import SyncSpec
from psdk.optim import NoOp
from psdk.registry import installed_backends, installed_models, installed_rules, load_target

log = logging.getLogger(__name__)


def schema_of(cls: type, name: str, target: bool = False) -> type:
    """A (mutable) schema dataclass with the init fields, types and defaults of dataclass ``cls``.

    ``target``: with a ``_target_`` naming ``cls``, for :func:`hydra.utils.instantiate`. A field
    without a default is ``???`` (required). The schema is a module attribute named ``name``, so a
    config that refers to it can be pickled.
    """
    hints = typing.get_type_hints(cls)
    specs: list[tuple[str, Any, Any]] = []
    if target:
        specs.append(("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}")))
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default=MISSING)
        specs.append((f.name, hints[f.name], default))
    schema = dataclasses.make_dataclass(name, specs)
    schema.__module__ = __name__
    schema.__doc__ = f"The schema of {cls.__module__}.{cls.__qualname__}'s fields (derived, never edited)."
    globals()[name] = schema
    return schema


RULES = {name: rule for name, rule in installed_rules().items() if rule is not NoOp}  # NoOp: the ps's own


def _ident(name: str) -> str:
    """``name`` as a Python identifier, for a schema class's module-level name."""
    return "".join(c if c.isalnum() else "_" for c in name)


# Psdk's own rules keep their familiar names (SGDConfig); a plugin's gets its rule name too, so no two collide.
OPTIMIZER_SCHEMAS = {
    f"base_{rule.name}": schema_of(
        rule,
        f"{rule.__name__}Config" if rule.__module__ == "psdk.optim" else f"PluginRuleConfig_{_ident(rule.name)}",
        target=True,
    )
    for rule in RULES.values()
}
SyncConfig = schema_of(SyncSpec, "SyncConfig", target=True)
if TYPE_CHECKING:  # a derived schema has its options class's fields, so the type checker reads the root by those
    TransportConfig = TransportOptions
    PsConfig = PsOptions
    TrainConfig = TrainOptions
    CheckpointConfig = CheckpointOptions
    RecoveryConfig = RecoveryOptions
    PlacementConfig = PlacementOptions
    LivenessConfig = LivenessOptions
else:
    TransportConfig = schema_of(TransportOptions, "TransportConfig")
    PsConfig = schema_of(PsOptions, "PsConfig")
    TrainConfig = schema_of(TrainOptions, "TrainConfig")
    CheckpointConfig = schema_of(CheckpointOptions, "CheckpointConfig")
    RecoveryConfig = schema_of(RecoveryOptions, "RecoveryConfig")
    PlacementConfig = schema_of(PlacementOptions, "PlacementConfig")
    LivenessConfig = schema_of(LivenessOptions, "LivenessConfig")


@dataclass
class ModelConfig:
    _target_: str = "psdk.models.ModelSpec"
    name: str = MISSING
    hidden: list[int] = field(default_factory=list)
    input_dim: int = 784
    num_classes: int = 10
    init: str = "glorot_uniform"  # how the kernels are drawn (psdk.models.INITIALIZERS)
    init_stddev: float | None = None  # normal, truncated_normal: their stddev (null: 1.0)


@dataclass
class TopologyConfig:
    _target_: str = "psdk.cluster.Topology"
    num_ps: int = 1
    num_workers: int = 2
    host: str = "127.0.0.1"
    sharding: str = "round_robin"
    worker_backends: Any = None


@dataclass
class LocalLauncherConfig:
    _target_: str = "psdk.launch.local.LocalLauncher"
    ready_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0


@dataclass
class RayLauncherConfig:
    _target_: str = "psdk.launch.ray.RayLauncher"
    address: Any = None
    num_cpus: Any = None
    cpus_per_ps: float = 1.0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    ready_timeout_s: float = 120.0
    shutdown_timeout_s: float = 30.0


@dataclass
class DataConfig:
    name: str = "mnist"
    dir: Any = None
    cache_dir: Any = None
    download: bool = True
    validation_size: int = 5000
    mirrors: list[str] = field(
        default_factory=lambda: [
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ]
    )


@dataclass
class ProgressConfig:
    mode: str = "auto"
    every_s: float = 10.0


@dataclass
class ReportConfig:
    plot: bool = True
    tensorboard: bool = False
    target_accuracy: float = 0.97


@dataclass
class PsdkConfig:
    """The primary config (``conf/config.yaml`` extends it), typed key by key.

    The groups chosen from a list (``model``, ``optimizer``, ``sync``,
    ``topology``, ``launcher``) stay ``Any``, as Hydra has it for a group in
    the defaults list: each choice brings its own schema (one per update
    rule, one per plugin model), which a single type here would refuse.
    ``ps_hosts`` and ``worker_hosts`` are a list or a comma-separated string.
    """

    model: Any = MISSING
    optimizer: Any = MISSING
    sync: Any = MISSING
    topology: Any = MISSING
    launcher: Any = MISSING
    backend: str = "torch"
    seed: int = 0
    job_name: str | None = None
    task_index: int = 0
    ps_hosts: Any = None
    ps_hosts_from: str | None = None
    worker_hosts: Any = None
    output_dir: str | None = None
    resume: str | None = None
    run_id: str | None = None
    weights: str | None = None
    file_access: str = "owner"
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    backend_options: dict[str, Any] = field(default_factory=lambda: backend_option_defaults())


def backend_option_defaults() -> dict[str, dict[str, Any]]:
    """Every installed backend's own options with their defaults: ``backend_options.<backend>.<key>``."""
    return {name: dict(entry.record.options) for name, entry in sorted(installed_backends().items())}


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base_model": ModelConfig},
    "optimizer": OPTIMIZER_SCHEMAS,
    "sync": {"base_sync": SyncConfig},
    "topology": {"base_topology": TopologyConfig},
    "launcher": {"base_local": LocalLauncherConfig, "base_ray": RayLauncherConfig},
}


def plugin_choices(conf: Path) -> dict[str, dict[str, Any]]:
    """Rules and models that plugins add, as choices of their groups (those ``conf/`` has no file for)."""

    def _has_file(group: str, name: str) -> bool:
        return (conf / group / f"{name}.yaml").is_file()

    choices: dict[str, dict[str, Any]] = {"optimizer": {}, "model": {}}
    for name in RULES:
        if not _has_file("optimizer", name):
            choices["optimizer"][name] = OPTIMIZER_SCHEMAS[f"base_{name}"]
    for name, record in installed_models().items():
        if _has_file("model", name):
            continue
        try:
            spec = load_target(record.target, f"model {name!r}")
            choices["model"][name] = schema_of(spec, f"PluginModelConfig_{_ident(name)}", target=True)(name=name)
        except Exception as exc:  # a plugin's broken model must not break jobs that do not use it
            log.warning(
                "model %r (%s) is skipped: its spec is no dataclass psdk can configure: %s", name, record.target, exc
            )
    return choices


def register_configs(conf: Path) -> None:
    """Put the schemas, and the choices plugins add, into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=PsdkConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
    for group, choices in plugin_choices(conf).items():
        for name, node in choices.items():
            cs.store(group=group, name=name, node=node)
