"""Schemas of the Hydra config tree: a typo in a key fails at composition, naming it.

Each config group's YAML files extend one of these dataclasses (stored in
Hydra's ConfigStore as ``base_<name>`` in that group) and carry a
``_target_`` (``package.module:Name``) that
:func:`psdk.config.build.instantiate_node` turns into the object the code
uses, without Hydra's ``instantiate``. Every option of the ``sync`` group
shares one schema, so a sweep such as
``-m sync=sync,async sync.replicas_to_aggregate=2`` never fails on one of
them.

Where the code already has a dataclass for a group, the schema is derived
from it (:func:`schema_of`) rather than copied: the update rules (one schema
per rule), :class:`~psdk.ps.consistency.SyncSpec`, and the typed options of
:mod:`psdk.config.options`. A field added there is a key here, with its type
and default, and no key here lacks a field there.

Plugins extend the tree (:mod:`psdk.plugins`): a rule or model a plugin
registers is also a choice of its group (``optimizer=<rule>``,
``model=<model>``) with its dataclass's defaults, unless ``conf/`` has a
file of that name; a backend's options are ``backend_options.<backend>.*``.

Importing this module loads no plugin and defines nothing but the fixed
schemas: the derived ones are made on first use (:func:`register_configs`,
or :func:`derived`), kept in :func:`derived`'s dictionary, and reached as
attributes of this module through its ``__getattr__``, which is how pickle
finds a config's schema class again, in this process or another one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from psdk.plugins.registry import (
    installed_backends,
    installed_models,
    installed_rules,
    installed_workloads,
    load_target,
    target_of,
)
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import NoOp, UpdateRule

log = logging.getLogger(__name__)


def schema_of(cls: type, name: str, target: bool = False) -> type:
    """A (mutable) schema dataclass with the init fields, types and defaults of dataclass ``cls``.

    ``target``: with a ``_target_`` naming ``cls`` (``package.module:Name``), for
    :func:`psdk.config.build.instantiate_node`. A field without a default is ``???``
    (required). The schema says it lives in this module as ``name``: :func:`derived`
    holds it under that name, so a config that refers to it can be pickled.
    """
    hints = typing.get_type_hints(cls)
    specs: list[tuple[str, Any, Any]] = []
    if target:
        specs.append(("_target_", str, field(default=target_of(cls))))
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
    schema.__qualname__ = name
    schema.__doc__ = f"The schema of {target_of(cls)}'s fields (derived, never edited)."
    return schema


def rules() -> dict[str, type[UpdateRule]]:
    """The update rules ``optimizer=`` may name: every installed one but NoOp (the ps's own)."""
    return {name: rule for name, rule in installed_rules().items() if rule is not NoOp}


def _ident(name: str) -> str:
    """``name`` as a Python identifier, for a schema class's name."""
    return "".join(c if c.isalnum() else "_" for c in name)


def rule_schema_name(rule: type[UpdateRule]) -> str:
    """Psdk's own rules keep their familiar names (SGDConfig); a plugin's gets its rule name too, so no two collide."""
    return f"{rule.__name__}Config" if rule.__module__ == "psdk.ps.rules" else f"PluginRuleConfig_{_ident(rule.name)}"


OPTIONS_SCHEMAS: dict[str, tuple[type, bool]] = {
    "SyncConfig": (SyncSpec, True),
    "TransportConfig": (TransportOptions, False),
    "PsConfig": (PsOptions, False),
    "TrainConfig": (TrainOptions, False),
    "CheckpointConfig": (CheckpointOptions, False),
    "RecoveryConfig": (RecoveryOptions, False),
    "PlacementConfig": (PlacementOptions, False),
    "LivenessConfig": (LivenessOptions, False),
}
"""The schemas derived from psdk's own dataclasses, by name: the class, and whether it has a ``_target_``."""


@functools.cache
def derived() -> dict[str, type]:
    """Every schema derived from a dataclass, by name: the options', and one per installed rule (made once)."""
    schemas = {name: schema_of(cls, name, target) for name, (cls, target) in OPTIONS_SCHEMAS.items()}
    for rule in rules().values():
        schemas[rule_schema_name(rule)] = schema_of(rule, rule_schema_name(rule), target=True)
    return schemas


@functools.cache
def model_schema(name: str) -> type | None:
    """The schema of plugin model ``name``'s spec; None (logged) when its spec is no dataclass psdk can configure."""
    record = installed_models()[name]
    try:
        spec = load_target(record.target, f"model {name!r}")
        return schema_of(spec, f"PluginModelConfig_{_ident(name)}", target=True)
    except Exception as exc:  # a plugin's broken model must not break jobs that do not use it
        log.warning(
            "model %r (%s) is skipped: its spec is no dataclass psdk can configure: %s", name, record.target, exc
        )
        return None


def __getattr__(name: str) -> type:
    """A derived schema by its name, as pickle asks for it (``psdk.config.schema.SGDConfig``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name.endswith("Config") or name.startswith("PluginRuleConfig_"):
        found = derived().get(name)
        if found is not None:
            return found
    if name.startswith("PluginModelConfig_"):
        for model in installed_models():
            if f"PluginModelConfig_{_ident(model)}" == name and (schema := model_schema(model)) is not None:
                return schema
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _options(name: str) -> Any:
    """An instance of derived schema ``name``, for a field of :class:`PsdkConfig` (typed by the instance)."""
    return derived()[name]()


@dataclass
class ModelConfig:
    _target_: str = "psdk.plugins.models:ModelSpec"
    name: str = MISSING
    hidden: list[int] = field(default_factory=list)
    input_dim: int = MISSING  # the data's features and classes: each model file (conf/model/) gives its own
    num_classes: int = MISSING
    init: str = "glorot_uniform"  # how the kernels are drawn (psdk.plugins.models.INITIALIZERS)
    init_stddev: float | None = None  # normal, truncated_normal: their stddev (null: 1.0)


@dataclass
class TopologyConfig:
    _target_: str = "psdk.protocol.cluster:Topology"
    num_ps: int = 1
    num_workers: int = 2
    host: str = "127.0.0.1"
    sharding: str = "round_robin"
    worker_backends: Any = None
    partition_min_bytes: int | None = None  # split variables this big across the ps (psdk.protocol.partitions)
    partitions: int | None = None  # into this many parts (null: num_ps)


@dataclass
class LocalLauncherConfig:
    _target_: str = "psdk.launch.local:LocalLauncher"
    ready_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0


@dataclass
class RayLauncherConfig:
    _target_: str = "psdk.launch.ray:RayLauncher"
    address: Any = None
    num_cpus: Any = None
    cpus_per_ps: float = 1.0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    ready_timeout_s: float = 120.0
    shutdown_timeout_s: float = 30.0


@dataclass
class DataConfig:
    """``data.*``: the workload's data set. ``name`` null is the workload's own (its ``check`` and
    ``shard`` entries say which), ``mirrors`` empty are the data set's own download mirrors."""

    name: str | None = None
    dir: Any = None
    cache_dir: Any = None
    download: bool = True
    validation_size: int = 5000
    mirrors: list[str] = field(default_factory=list)


@dataclass
class ProgressConfig:
    mode: str = "auto"
    every_s: float = 10.0


@dataclass
class WorkloadConfig:
    """The ``workload`` group: which workload the job trains; a plugin's workload adds its own keys to it."""

    name: str = MISSING


@dataclass
class ReportConfig:
    """``report.*``: the run's figures. ``target`` is a value of the workload's primary metric
    (null: the workload's default, 0.97 for MNIST's accuracy); ``target_accuracy`` is its MNIST name."""

    plot: bool = True
    tensorboard: bool = False
    step_ends: bool = False
    target: float | None = None
    target_accuracy: float | None = None


@dataclass
class PsdkConfig:
    """The primary config (``conf/config.yaml`` extends it), typed key by key.

    The groups chosen from a list (``workload``, ``model``, ``optimizer``, ``sync``,
    ``topology``, ``launcher``) stay ``Any``, as Hydra has it for a group in
    the defaults list: each choice brings its own schema (one per update
    rule, one per plugin model), which a single type here would refuse.
    ``ps_hosts`` and ``worker_hosts`` are a list or a comma-separated string.
    """

    workload: Any = MISSING
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
    recovery: Any = field(default_factory=lambda: _options("RecoveryConfig"))  # derived: typed by the instance
    checkpoint: Any = field(default_factory=lambda: _options("CheckpointConfig"))  # derived: typed by the instance
    train: Any = field(default_factory=lambda: _options("TrainConfig"))  # derived: typed by the instance
    data: DataConfig = field(default_factory=DataConfig)
    transport: Any = field(default_factory=lambda: _options("TransportConfig"))  # derived: typed by the instance
    ps: Any = field(default_factory=lambda: _options("PsConfig"))  # derived: typed by the instance
    placement: Any = field(default_factory=lambda: _options("PlacementConfig"))  # derived: typed by the instance
    liveness: Any = field(default_factory=lambda: _options("LivenessConfig"))  # derived: typed by the instance
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    backend_options: dict[str, Any] = field(default_factory=lambda: backend_option_defaults())
    tables: dict[str, Any] = field(default_factory=dict)
    """Per embedding table of the model, ``TableSpec`` settings: ``tables.emb.sharding=range`` (docs/tables.md)."""


def backend_option_defaults() -> dict[str, dict[str, Any]]:
    """Every installed backend's own options with their defaults: ``backend_options.<backend>.<key>``."""
    return {name: dict(entry.record.options) for name, entry in sorted(installed_backends().items())}


def group_schemas() -> dict[str, dict[str, type]]:
    """Each group's base schemas (``base_<name>``), as the YAML files of ``conf/<group>/`` extend them."""
    return {
        "workload": {"base_workload": WorkloadConfig},
        "model": {"base_model": ModelConfig},
        "optimizer": {f"base_{rule.name}": derived()[rule_schema_name(rule)] for rule in rules().values()},
        "sync": {"base_sync": derived()["SyncConfig"]},
        "topology": {"base_topology": TopologyConfig},
        "launcher": {"base_local": LocalLauncherConfig, "base_ray": RayLauncherConfig},
    }


def plugin_choices(conf: Path) -> dict[str, dict[str, Any]]:
    """Rules, models and workloads that plugins add, as choices of their groups (those ``conf/`` has no file for)."""

    def _has_file(group: str, name: str) -> bool:
        return (conf / group / f"{name}.yaml").is_file()

    choices: dict[str, dict[str, Any]] = {"optimizer": {}, "model": {}, "workload": {}}
    for name, rule in rules().items():
        if not _has_file("optimizer", name):
            choices["optimizer"][name] = derived()[rule_schema_name(rule)]
    for name in installed_models():
        if not _has_file("model", name) and (schema := model_schema(name)) is not None:
            choices["model"][name] = schema(name=name)
    for name, workload in installed_workloads().items():
        if not _has_file("workload", name):
            choices["workload"][name] = {"name": name, **workload.options}
    return choices


def register_configs(conf: Path) -> None:
    """Put the schemas, and the choices plugins add, into Hydra's ConfigStore (idempotent).

    This is where plugins are loaded and the derived schemas made, not at import.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=PsdkConfig)
    for group, schemas in group_schemas().items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
    for group, choices in plugin_choices(conf).items():
        for name, node in choices.items():
            cs.store(group=group, name=name, node=node)
