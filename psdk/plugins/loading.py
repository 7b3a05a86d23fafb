"""Making backends from what plugins register: loading one, checking its framework, finding one for an object.

The records themselves (and rules, models, datasets) are in :mod:`psdk.plugins.registry`;
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
    "distribution_of",
    "get_plugin_manager",
    "installed_backends",
    "installed_datasets",
    "installed_models",
    "installed_rules",
    "listing",
    "load_backend",
    "load_target",
    "merged_options",
    "record_of",
    "resolve_backend_name",
    "rule_from_json",
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
    backend: Backend = cls()
    backend.record = record
    backend.options = merged_options(record, options)
    return backend


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


def listing() -> list[tuple[str, str, str, str]]:
    """(kind, name, provider, description) of every backend, rule, model and dataset: ``python -m psdk plugins``."""
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
    return rows


def _with_defaults(rule: Callable[[], UpdateRule]) -> UpdateRule | None:
    """The rule with its default hyper-parameters (to list its slots), None when it has required ones."""
    try:
        return rule()
    except Exception:  # a required hyper-parameter, or a check that refuses the defaults
        return None
