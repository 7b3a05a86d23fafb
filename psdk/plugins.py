"""Finding what plugins provide: pluggy over the ``psdk`` entry-point group, built on first use.

Four kinds of things plug in, each through its own hook (:mod:`psdk.hookspecs`):
backends, update rules, models and datasets. psdk's own (the numpy backend,
the four rules, the dense models, MNIST and IDX folders) register through the
same hooks from :data:`DEFAULT_PLUGINS`, as pytest registers its own plugins.
Nothing happens at import time: the manager is built by
:func:`get_plugin_manager`, and a backend's module (which imports its
framework) only when :func:`load_backend` is asked for it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from psdk import hookspecs
from psdk.backend import Backend
from psdk.errors import ConfigError, PluginError, UnknownBackendError
from psdk.hookspecs import BackendRecord, DatasetRecord, ModelRecord
from psdk.optim import UpdateRule

ENTRY_POINT_GROUP = "psdk"
DEFAULT_PLUGINS = ("psdk.builtins", "psdk.backends.numpy_plugin")

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    package = target.partition(":")[0].split(".")[0]
    return _distributions().get(package, f"{package}, not an installed distribution")


def _collected(results: Iterable[list[T] | None], kind: type | tuple[type, ...], what: str) -> list[T]:
    """Every plugin's answers to one hook, flattened; anything of the wrong type is refused by name."""
    found: list[T] = []
    for answer in results:
        for item in answer or []:
            if not isinstance(item, kind):
                raise PluginError(f"a plugin registered {item!r} as a {what}, which is not a {kind}")
            found.append(item)
    return found


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
def installed_backends() -> dict[str, InstalledBackend]:
    """Every registered backend by name; two plugins claiming one name is an error."""
    records = _collected(get_plugin_manager().hook.psdk_register_backends(), BackendRecord, "backend")
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


def load_backend(name: str, options: Mapping[str, Any] | None = None) -> Backend:
    """A fresh instance of the backend called ``name`` (or one of its aliases), given its options."""
    backends = installed_backends()
    record = backends[resolve_backend_name(name, backends)].record
    module_name, _, class_name = record.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        how = f" ({record.install})" if record.install else ""
        raise PluginError(
            f"backend {record.name!r} ({record.target}) could not be loaded: {exc}. Is {record.framework} "
            f"installed in this environment?{how}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"backend {record.name!r} points at {record.target}, which is not a Backend")
    backend: Backend = cls()
    backend.record = record
    backend.options = merged_options(record, options)
    return backend


def record_of(cls: type) -> BackendRecord:
    """The record that registers backend class ``cls`` (found by its target)."""
    target = f"{cls.__module__}:{cls.__qualname__}"
    for entry in installed_backends().values():
        if entry.record.target == target:
            return entry.record
    raise PluginError(f"no installed plugin registers the backend {target}; its record names it, as the target")


def backend_for(obj: object) -> Backend:
    """The backend that owns ``obj`` (a model or optimizer), asked through :meth:`Backend.owns`.

    Only backends whose framework (or one of its ``modules``) is already
    imported are asked: an object of a framework means that framework is
    loaded, so finding its backend never imports another.
    """
    backends = installed_backends()
    for name, entry in backends.items():
        record = entry.record
        if any(package in sys.modules for package in (record.framework, *record.modules)):
            backend = load_backend(name)
            if backend.owns(obj):
                return backend
    raise UnknownBackendError(f"<one for {type(obj).__module__} objects like {type(obj).__name__}>", backends, {})


# ------------------------------------------------------------- other kinds
def installed_rules() -> dict[str, type[UpdateRule]]:
    """Every registered ps update rule by name (``optimizer=<name>``)."""
    rules = _collected(get_plugin_manager().hook.psdk_register_rules(), type, "rule")
    for rule in rules:
        if not issubclass(rule, UpdateRule):
            raise PluginError(f"a plugin registered {rule!r} as an update rule; it is not a psdk.optim.UpdateRule")
    return _unique(rules, lambda r: r.name, lambda r: f"{r.__module__}.{r.__qualname__}", "update rule")


def installed_models() -> dict[str, ModelRecord]:
    """Every registered model by name (``model=<name>``)."""
    records = _collected(get_plugin_manager().hook.psdk_register_models(), ModelRecord, "model")
    return _unique(records, lambda r: r.name, lambda r: f"{r.target} ({distribution_of(r.target)})", "model")


def installed_datasets() -> dict[str, DatasetRecord]:
    """Every registered dataset by name (``data.name=<name>``)."""
    records = _collected(get_plugin_manager().hook.psdk_register_datasets(), DatasetRecord, "dataset")
    return _unique(records, lambda r: r.name, lambda r: f"{r.target} ({distribution_of(r.target)})", "dataset")


def load_target(target: str, what: str) -> Any:
    """The object ``"package.module:name"`` points at; a clear error if it cannot be imported."""
    module_name, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"{what} ({target}) could not be loaded: {exc}") from exc
