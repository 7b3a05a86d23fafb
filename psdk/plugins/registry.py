"""The plugin registry: what installed plugins provide, as records, without importing any framework.

Five kinds of things plug in, each through its own hook (:mod:`psdk.plugins.hookspecs`):
backends, update rules, models, datasets and workloads. psdk's own (the numpy backend,
the rules, the dense models, MNIST and IDX folders, the MNIST workload) register through the
same hooks from :data:`DEFAULT_PLUGINS`, as pytest registers its own plugins.
Nothing happens at import time: the manager is built by
:func:`get_plugin_manager` on first use. This module knows records and rule
classes only; making a backend from its record is :mod:`psdk.plugins`'s job,
so the contract (:mod:`psdk.plugins.backend`) and the rules can look records up here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from psdk._moved import MOVED
from psdk.errors import ConfigError, PluginError, UnknownBackendError
from psdk.plugins import hookspecs
from psdk.plugins.hookspecs import BackendRecord, DatasetRecord, ModelRecord, TrainerRecord, WorkloadRecord
from psdk.ps.rules import UpdateRule

ENTRY_POINT_GROUP = "psdk"
DEFAULT_PLUGINS = ("psdk.plugins.builtins", "psdk.plugins.backends.numpy_plugin")

T = TypeVar("T")
log = logging.getLogger(__name__)


# ------------------------------------------------------------- targets
def target_of(obj: Any) -> str:
    """Where a class or function lives, in psdk's one target syntax: ``"package.module:Name"``."""
    return f"{obj.__module__}:{obj.__qualname__}"


def package_of(target: str) -> str:
    """The top-level package a target lives in (``"psdk_torch.backend:TorchBackend"``: ``psdk_torch``)."""
    return target.partition(":")[0].split(".")[0]


def moved_to(module: str) -> str:
    """Where psdk's module ``module`` lives now (itself, unless :data:`psdk._moved.MOVED` says it moved)."""
    old = max((o for o in MOVED if module == o or module.startswith(f"{o}.")), key=len, default=None)
    return module if old is None else MOVED[old] + module[len(old) :]


def locate(target: str) -> Any:
    """The object ``target`` names: the one function that reads targets, records' and configs' ``_target_`` alike.

    The syntax is an entry point's, ``"package.module:Name"`` (the name may
    be dotted, for a nested class): the colon says where the module ends,
    so nothing is guessed. The dotted ``"package.module.Name"`` that Hydra
    writes is read too, as an alias: the run folders of psdk before 0.2
    saved their ``_target_`` so, and they still resume. Its module is the
    longest prefix that imports. A module psdk has since moved
    (``psdk.consistency``, now ``psdk.ps.consistency``) is read at its new
    place, so those folders' targets still build. Raises ImportError saying what is missing:
    a module that exists but imports one that does not names that one.
    """
    if not isinstance(target, str) or not target.strip(". :") or target.count(":") > 1:
        raise ImportError(f"{target!r} is no target; write package.module:Name")
    if ":" in target:
        module, _, name = target.partition(":")
        found: Any = importlib.import_module(moved_to(module))
        for attribute in name.split("."):
            if not hasattr(found, attribute):
                raise ImportError(f"{module} has no {name} (in {target})")
            found = getattr(found, attribute)
        return found
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.import_module(moved_to(module))
        except ModuleNotFoundError as exc:
            if exc.name is not None and target != exc.name and not target.startswith(f"{exc.name}."):
                raise  # the module exists but imports one that does not: that is the error to see
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            break
        return found
    raise ImportError(f"nothing named {target!r} can be imported (as package.module:Name, say where the module ends)")


@dataclass(frozen=True)
class InstalledBackend:
    record: BackendRecord
    distribution: str
    """Who provides it: ``"psdk-torch 0.1.0"``, or psdk itself."""


BROKEN: dict[str, str] = {}
"""Entry points that failed to load, by name, with why: they are skipped, each named once in the log."""


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """psdk's own plugins, then every ``psdk`` entry point that loads.

    A plugin that fails to import is skipped with a warning naming it and its
    distribution, rather than failing every job: a ps needs only the rules,
    and a worker only its own backend, which it then reports as missing.
    """
    pm = pluggy.PluginManager("psdk")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(entry.name) is not None or pm.is_blocked(entry.name):
            continue
        try:
            pm.register(entry.load(), name=entry.name)
        except Exception as exc:  # a broken third-party plugin must say who it is, and spoil nothing else
            who = f"{entry.dist.name} {entry.dist.version}" if entry.dist is not None else "an unknown distribution"
            BROKEN[entry.name] = f"the plugin {entry.name!r} ({entry.value}, from {who}) failed to load: {exc}"
            log.warning("%s; skipping it", BROKEN[entry.name])
    return pm


@functools.cache
def _distributions() -> Mapping[str, str]:
    """Top-level package -> ``"name version"`` of what provides it: psdk, and each entry point's distribution.

    Found through the entry points rather than the files a distribution lists,
    which an editable install (``pip install -e``) does not list.
    """
    found: dict[str, str] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.dist is not None:
            found.setdefault(entry.value.split(".")[0], f"{entry.dist.name} {entry.dist.version}")
    try:
        found["psdk"] = f"psdk {metadata.version('psdk')} (built in)"
    except metadata.PackageNotFoundError:
        found["psdk"] = "psdk (built in, not installed)"
    return found


def distribution_of(target: str) -> str:
    """The distribution (name and version) whose package holds ``target`` (``"pkg.mod:Name"``)."""
    package = package_of(target)
    return _distributions().get(package, f"{package}, not an installed distribution")


def _items(answer: Any, what: str) -> list[Any]:
    if answer is None:
        return []
    if not isinstance(answer, (list, tuple)):
        raise PluginError(f"it returned {answer!r} from its {what} hook, not a list")
    return list(answer)


def _is_rule(item: Any) -> bool:
    return isinstance(item, type) and issubclass(item, UpdateRule) and isinstance(getattr(item, "name", None), str)


def _collected(hook_name: str, valid: Callable[[Any], bool], what: str) -> list[Any]:
    """Every plugin's answers to one hook (called through pluggy), checked; a plugin that misbehaves is dropped.

    When the hook call fails, or an answer is not what the hook promises, each
    plugin is asked on its own to find which: those that fail are unregistered
    and named in :data:`BROKEN` and the log, and the hook is called again
    without them, so one broken plugin never breaks jobs that do not use it.
    psdk's own plugins are never dropped: an error there is psdk's, and raised.
    """
    pm = get_plugin_manager()
    hook = getattr(pm.hook, hook_name)
    try:
        found = [item for answer in hook() for item in _items(answer, hook_name)]
        bad = next((item for item in found if not valid(item)), None)
        if bad is None:
            return found
        problem: Exception = PluginError(f"{bad!r} is not a {what}")
    except Exception as exc:  # a hook that raises, or returns no list
        problem = exc
    dropped = False
    for impl in hook.get_hookimpls():
        try:
            bad_items = [item for item in _items(impl.function(), hook_name) if not valid(item)]
            if bad_items:
                raise PluginError(f"it registered {bad_items[0]!r} as a {what}, which is not one")
        except Exception as exc:
            if impl.plugin_name in DEFAULT_PLUGINS:
                raise
            BROKEN[impl.plugin_name] = f"the plugin {impl.plugin_name!r} is skipped: {exc}"
            log.warning("%s", BROKEN[impl.plugin_name])
            pm.unregister(name=impl.plugin_name)
            dropped = True
    if not dropped:  # it failed as a whole but no plugin alone: nothing to blame, so nothing to hide
        raise PluginError(f"the {hook_name} hook failed: {problem}") from problem
    return _collected(hook_name, valid, what)


def _unique(items: Iterable[T], name_of: Callable[[T], str], origin: Callable[[T], str], what: str) -> dict[str, T]:
    found: dict[str, T] = {}
    for item in items:
        name = name_of(item)
        if name in found:
            raise PluginError(
                f"two plugins provide the {what} {name!r}: {origin(found[name])} and {origin(item)}; "
                "uninstall one of them"
            )
        found[name] = item
    return found


# ------------------------------------------------------------------ backends


# ------------------------------------------------------------------ backends
def installed_backends() -> dict[str, InstalledBackend]:
    """Every registered backend by name; two plugins claiming one name is an error."""
    records = _collected("psdk_register_backends", lambda r: isinstance(r, BackendRecord), "BackendRecord")
    entries = [InstalledBackend(record, distribution_of(record.target)) for record in records]
    return _unique(entries, lambda e: e.record.name, lambda e: f"{e.record.target} ({e.distribution})", "backend")


def resolve_backend_name(name: str, backends: Mapping[str, InstalledBackend] | None = None) -> str:
    """``name``, or the backend whose record lists it among its aliases; unknown names are refused."""
    backends = installed_backends() if backends is None else backends
    if name in backends:
        return name
    aliases = {alias.lower(): real for real, entry in backends.items() for alias in entry.record.aliases}
    if name.lower() in aliases:
        return aliases[name.lower()]
    raise UnknownBackendError(name, backends, aliases, BROKEN.values())


def merged_options(record: BackendRecord, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The record's option defaults overridden by ``given``; a key the plugin does not declare is refused."""
    options = dict(record.options)
    unknown = sorted(set(given or {}) - set(options))
    if unknown:
        raise ConfigError(
            f"backend_options.{record.name}",
            f"the {record.name} backend has no option(s) {', '.join(unknown)}",
            options,
        )
    options.update(given or {})
    return options


def record_of(cls: type) -> BackendRecord:
    """The record that registers backend class ``cls`` (found by its target)."""
    target = target_of(cls)
    for entry in installed_backends().values():
        if entry.record.target == target:
            return entry.record
    raise PluginError(f"no installed plugin registers the backend {target}; its record names it, as the target")


# ------------------------------------------------------------- other kinds
def installed_rules() -> dict[str, type[UpdateRule]]:
    """Every registered ps update rule by name (``optimizer=<name>``)."""
    rules = _collected("psdk_register_rules", _is_rule, "psdk.ps.rules.UpdateRule subclass with a name")
    return _unique(rules, lambda r: r.name, _rule_origin, "update rule")


def rule_target(rule: type) -> str:
    """Where a rule class lives, as a record's ``target`` says it (``package.module:Name``)."""
    return target_of(rule)


def _rule_origin(rule: type) -> str:
    return f"{rule_target(rule)} ({distribution_of(rule_target(rule))})"


def installed_models() -> dict[str, ModelRecord]:
    """Every registered model by name (``model=<name>``)."""
    records = _collected("psdk_register_models", lambda r: isinstance(r, ModelRecord), "ModelRecord")
    return _unique(records, lambda r: r.name, lambda r: f"{r.target} ({distribution_of(r.target)})", "model")


def installed_datasets() -> dict[str, DatasetRecord]:
    """Every registered dataset by name (``data.name=<name>``)."""
    records = _collected("psdk_register_datasets", lambda r: isinstance(r, DatasetRecord), "DatasetRecord")
    return _unique(records, lambda r: r.name, lambda r: f"{r.target} ({distribution_of(r.target)})", "dataset")


def installed_workloads() -> dict[str, WorkloadRecord]:
    """Every registered workload by name (``workload=<name>``), with the trainers other plugins give it."""
    records = _collected("psdk_register_workloads", lambda r: isinstance(r, WorkloadRecord), "WorkloadRecord")
    workloads = _unique(records, lambda r: r.name, lambda r: f"{r.worker} ({distribution_of(r.worker)})", "workload")
    given = _collected("psdk_register_trainers", lambda r: isinstance(r, TrainerRecord), "TrainerRecord")
    added: dict[str, dict[str, str]] = {}
    for trainer in given:
        if trainer.workload not in workloads:
            continue  # a trainer for a workload that is not installed here: nothing to train
        mine = added.setdefault(trainer.workload, {})
        if trainer.framework in mine and mine[trainer.framework] != trainer.target:
            raise PluginError(
                f"two plugins give workload {trainer.workload!r} a {trainer.framework} trainer: "
                f"{mine[trainer.framework]} and {trainer.target}"
            )
        mine[trainer.framework] = trainer.target
    for name, trainers in added.items():
        record = workloads[name]
        workloads[name] = dataclasses.replace(record, trainers={**trainers, **record.trainers})
    return workloads


def load_target(target: str, what: str) -> Any:
    """The object a plugin record's ``target`` points at (:func:`locate`); a PluginError naming ``what`` if none."""
    try:
        return locate(target)
    except ImportError as exc:
        raise PluginError(f"{what} ({target}) could not be loaded: {exc}") from exc


def rule_from_json(data: dict[str, Any]) -> UpdateRule:
    """Rebuild a rule sent by the chief or read from a checkpoint; unknown names or keys are refused.

    Rules come from every installed plugin (:func:`installed_rules`),
    psdk's own among them: a ps runs a plugin's rule once that plugin is
    installed where the ps runs.
    """
    rules = installed_rules()
    values = dict(data)
    name = values.pop("name", None)
    if name not in rules:
        raise ConfigError(
            "optimizer",
            f"unknown update rule {name!r}; is the plugin that provides it installed where this task runs?",
            rules,
        )
    cls = rules[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError("optimizer", f"{name} has no option(s) {sorted(unknown)}", known)
    return cls(**values)
