"""Making backends from what plugins register: loading one, checking its framework, finding one for an object.

It also finds the chosen workload (:func:`workload_of`) and runs one of its
entries (:func:`run_entry`), so the CLI and the launchers name no workload.
The records themselves (and rules, models, datasets, workloads) are in :mod:`psdk.plugins.registry`;
the names a plugin author reaches for are re-exported here, so
``psdk.plugins`` is the one module to read. A backend's module (which
imports its framework) is imported only when :func:`load_backend` is asked for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

from psdk.errors import ConfigError, PluginError, UnknownBackendError
from psdk.plugins.backend import Backend
from psdk.plugins.hookspecs import WorkloadRecord
from psdk.plugins.registry import (
    BROKEN,
    DEFAULT_PLUGINS,
    ENTRY_POINT_GROUP,
    InstalledBackend,
    distribution_of,
    get_plugin_manager,
    installed_backends,
    installed_datasets,
    installed_models,
    installed_rules,
    installed_workloads,
    load_target,
    merged_options,
    record_of,
    resolve_backend_name,
    rule_from_json,
    rule_target,
)
from psdk.ps.rules import UpdateRule

__all__ = [
    "BROKEN",
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "InstalledBackend",
    "backend_for",
    "check_framework",
    "check_trainer",
    "distribution_of",
    "get_plugin_manager",
    "installed_backends",
    "installed_datasets",
    "installed_models",
    "installed_rules",
    "installed_workloads",
    "listing",
    "load_backend",
    "load_target",
    "merged_options",
    "record_of",
    "resolve_backend_name",
    "rule_from_json",
    "run_entry",
    "workload_of",
]


def check_framework(name: str) -> None:
    """Refuse a backend that is not installed, or whose framework is not, without importing it."""
    backends = installed_backends()
    entry = backends[resolve_backend_name(name, backends)]
    framework = entry.record.framework
    if importlib.util.find_spec(framework) is None:
        how = entry.record.install or f"pip install {framework}"
        raise ConfigError(
            "backend",
            f"the {entry.record.name} backend ({entry.distribution}) needs {framework}, which is not installed "
            f"in this Python ({sys.executable}); {how}",
        )


def load_backend(name: str, options: Mapping[str, Any] | None = None) -> Backend:
    """A fresh instance of the backend called ``name`` (or one of its aliases), given its options."""
    backends = installed_backends()
    record = backends[resolve_backend_name(name, backends)].record
    try:
        cls = load_target(record.target, f"backend {record.name!r}")
    except PluginError as exc:
        how = f" ({record.install})" if record.install else ""
        raise PluginError(f"{exc}. Is {record.framework} installed in this environment?{how}") from exc.__cause__
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"backend {record.name!r} points at {record.target}, which is not a Backend")
    refuse_old_contract(cls, record.name, record.target)
    backend: Backend = cls()
    backend.record = record
    backend.options = merged_options(record, options)
    return backend


OLD_CONTRACT = ("forward_backward", "accuracy")
"""What a backend did before workloads: MNIST's loss and metric, which are a trainer's now."""


def refuse_old_contract(cls: type, name: str, target: str) -> None:
    """Refuse a backend written against the contract before workloads, saying what to move where.

    Its ``forward_backward(model, x, y)`` and ``accuracy`` would never be
    called (a workload's trainer trains now), so a job would fail later and
    less clearly; the message names the methods and the guide's section.
    """
    old = [method for method in OLD_CONTRACT if any(method in vars(k) for k in cls.__mro__ if k is not Backend)]
    if old:
        raise PluginError(
            f"backend {name!r} ({target}) defines {' and '.join(old)}, which a backend no longer has: a backend is "
            "now a framework bridge (variables, weights, gradients, rules, devices) and a workload's Trainer holds "
            "the loss and the predictions. Move forward_backward(model, x, y) to Trainer.forward_backward(model, "
            "batch) and accuracy to Trainer.predict (returning the logits), register it with "
            "psdk_register_trainers -> TrainerRecord('mnist', <framework>, 'pkg.mod:Class'), and delete both "
            "from the backend: docs/writing-a-backend.md, 'Moving a backend to a bridge'"
        )


def backend_for(obj: object) -> Backend:
    """The backend that owns ``obj`` (a model or optimizer), asked through :meth:`Backend.owns`.

    Only backends whose framework (or one of its ``modules``) is already
    imported are asked: an object of a framework means that framework is
    loaded, so finding its backend never imports another. A backend that
    cannot be loaded (an outdated plugin for a framework imported alongside:
    Keras imports JAX) is passed over, and named only if none owns ``obj``.
    """
    backends = installed_backends()
    unloadable: list[str] = []
    for name, entry in backends.items():
        record = entry.record
        if any(package in sys.modules for package in (record.framework, *record.modules)):
            try:
                backend = load_backend(name)
            except PluginError as exc:
                unloadable.append(str(exc))
                continue
            if backend.owns(obj):
                return backend
    what = f"{type(obj).__module__} objects like {type(obj).__name__}"
    if unloadable:
        raise PluginError(f"no backend that loads owns {what}; these could not be loaded: {'; '.join(unloadable)}")
    raise UnknownBackendError(f"<one for {what}>", backends, {})


# ------------------------------------------------------------- workloads
DEFAULT_WORKLOAD = "mnist"
"""The workload of a config that names none: one saved before workloads were a config group."""

ENTRIES = ("worker", "evaluate", "prepare", "data", "check", "train_size")
"""The entries of a :class:`~psdk.plugins.hookspecs.WorkloadRecord` that the commands run."""


def workload_of(cfg: Any) -> WorkloadRecord:
    """The record of the workload ``cfg`` chooses (``workload=<name>``); an unknown one is refused, listing the rest."""
    node = cfg.get("workload") if hasattr(cfg, "get") else None
    name = str(node.get("name", DEFAULT_WORKLOAD)) if node is not None else DEFAULT_WORKLOAD
    workloads = installed_workloads()
    if name not in workloads:
        broken = "".join(f"; {why}" for why in BROKEN.values())
        raise ConfigError(
            "workload",
            f"no installed workload is called {name!r}; is the plugin that provides it installed?{broken}",
            sorted(workloads),
        )
    return workloads[name]


def check_trainer(workload: WorkloadRecord, backend: str) -> str:
    """The target of ``workload``'s trainer for ``backend``'s framework; refused when it has none."""
    backends = installed_backends()
    record = backends[resolve_backend_name(backend, backends)].record
    trainer = workload.trainer(record.framework)
    if trainer is None:
        raise ConfigError(
            "backend",
            f"the workload {workload.name!r} has no trainer for {record.framework} (the {record.name} backend)",
            sorted(workload.trainers),
        )
    return trainer


def run_entry(cfg: Any, entry: str) -> Any:
    """Run the chosen workload's ``entry`` (one of :data:`ENTRIES`) on ``cfg``; None when the workload has none."""
    if entry not in ENTRIES:
        raise ValueError(f"a workload has no entry {entry!r}; its entries are {', '.join(ENTRIES)}")
    record = workload_of(cfg)
    target = getattr(record, entry)
    if not target:
        return None
    function = load_target(target, f"the {entry} entry of workload {record.name!r}")
    if not callable(function):
        raise PluginError(f"workload {record.name!r}'s {entry} entry {target} is not a function")
    return function(cfg)


# ------------------------------------------------------------- other kinds


def listing() -> list[tuple[str, str, str, str]]:
    """(kind, name, provider, description) of every backend, rule, model, dataset, workload: ``psdk plugins``."""
    rows: list[tuple[str, str, str, str]] = []
    for name, entry in sorted(installed_backends().items()):
        r = entry.record
        extra = f" (also: {', '.join(r.aliases)})" if r.aliases else ""
        options = f"; options: {', '.join(f'{k}={v!r}' for k, v in r.options.items())}" if r.options else ""
        rows.append(("backend", name, entry.distribution, f"{r.framework}: {r.description}{extra}{options}"))
    for name, rule in sorted(installed_rules().items()):
        doc = (rule.__doc__ or "").strip().splitlines()[0] if rule.__doc__ else ""
        instance = _with_defaults(rule)
        slots = ", ".join(instance.slot_names()) if instance is not None else "?"
        rows.append(("rule", name, distribution_of(rule_target(rule)), f"{doc} [slots: {slots or 'none'}]"))
    for name, model in sorted(installed_models().items()):
        builds = f" (backends: {', '.join(sorted(model.builders))})" if model.builders else " (every backend)"
        rows.append(("model", name, distribution_of(model.target), f"{model.description}{builds}"))
    for name, dataset in sorted(installed_datasets().items()):
        rows.append(("dataset", name, distribution_of(dataset.target), dataset.description))
    for name, workload in sorted(installed_workloads().items()):
        description = f"{workload.description} (trains on: {', '.join(_trained_on(workload)) or 'no backend'})"
        provider = distribution_of(workload.shard or workload.worker)  # its own entry: the worker may be psdk's loop
        rows.append(("workload", name, provider, description))
    return rows


def _trained_on(workload: WorkloadRecord) -> list[str]:
    """The installed backends whose framework the workload has a trainer for."""
    return sorted(name for name, e in installed_backends().items() if workload.trainer(e.record.framework) is not None)


def _with_defaults(rule: Callable[[], UpdateRule]) -> UpdateRule | None:
    """The rule with its default hyper-parameters (to list its slots), None when it has required ones."""
    try:
        return rule()
    except Exception:  # a required hyper-parameter, or a check that refuses the defaults
        return None
