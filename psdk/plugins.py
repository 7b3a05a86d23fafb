"""Finding backends: pluggy over the ``psdk`` entry-point group, built on first use.

The built-in numpy backend registers through the same hook as outside
plugins (:data:`DEFAULT_PLUGINS`). Nothing happens at import time: the
manager is built by :func:`get_plugin_manager`, and a backend's module (which
imports its framework) only when :func:`load_backend` is asked for it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from importlib import metadata

import pluggy

from psdk import hookspecs
from psdk.backend import Backend
from psdk.errors import ConfigError, PluginError, UnknownBackendError
from psdk.hookspecs import BackendRecord

ENTRY_POINT_GROUP = "psdk"
# How to install the frameworks of the plugins in psdk's repository.
FRAMEWORK_INSTALL = {
    "torch": "pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu), "
    "or `make setup` in a psdk checkout",
    "tensorflow": "pip install -e 'plugins/tf_backend[cpu]' installs tensorflow-cpu with the plugin "
    "([gpu] for tensorflow[and-cuda]), or pip install tensorflow-cpu",
}
DEFAULT_PLUGINS = ("psdk.backends.numpy_plugin",)


@dataclass(frozen=True)
class InstalledBackend:
    record: BackendRecord
    plugin: str
    distribution: str


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("psdk")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    except Exception as exc:  # a broken third-party plugin must say who it is
        raise PluginError(f"loading a plugin from the {ENTRY_POINT_GROUP!r} entry points failed: {exc}") from exc
    return pm


def _distribution_of(pm: pluggy.PluginManager, plugin: object) -> str:
    for candidate, dist in pm.list_plugin_distinfo():
        if candidate is plugin:
            return f"{dist.project_name} {dist.version}"
    try:
        return f"psdk {metadata.version('psdk')} (built in)"
    except metadata.PackageNotFoundError:
        return "psdk (built in, not installed)"


def installed_backends() -> dict[str, InstalledBackend]:
    """Every registered backend by name; two plugins claiming one name is an error."""
    pm = get_plugin_manager()
    found: dict[str, InstalledBackend] = {}
    for impl in pm.hook.psdk_register_backends.get_hookimpls():
        records = impl.function()
        for record in records or []:
            if not isinstance(record, BackendRecord):
                raise PluginError(f"plugin {impl.plugin_name} registered {record!r}, not a BackendRecord")
            entry = InstalledBackend(record, impl.plugin_name, _distribution_of(pm, impl.plugin))
            if record.name in found:
                other = found[record.name]
                raise PluginError(
                    f"two plugins provide the backend {record.name!r}: {other.plugin} "
                    f"({other.distribution}) and {entry.plugin} ({entry.distribution}); "
                    "uninstall one of them"
                )
            found[record.name] = entry
    return found


def check_framework(name: str) -> None:
    """Refuse a backend that is not installed, or whose framework is not, without importing it."""
    backends = installed_backends()
    if name not in backends:
        raise UnknownBackendError(name, backends)
    entry = backends[name]
    framework = entry.record.framework
    if importlib.util.find_spec(framework) is None:
        how = FRAMEWORK_INSTALL.get(framework, f"pip install {framework}")
        raise ConfigError(
            "backend",
            f"the {name} backend ({entry.distribution}) needs {framework}, which is not installed in this "
            f"Python ({sys.executable}); {how}",
        )


def load_backend(name: str) -> Backend:
    """A fresh instance of the backend called ``name``."""
    backends = installed_backends()
    if name not in backends:
        raise UnknownBackendError(name, backends)
    record = backends[name].record
    module_name, _, class_name = record.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise PluginError(
            f"backend {name!r} ({record.target}) could not be loaded: {exc}. Is {record.framework} "
            "installed in this environment?"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"backend {name!r} points at {record.target}, which is not a Backend")
    backend: Backend = cls()
    return backend


def backend_for(obj: object) -> Backend:
    """The backend whose framework ``obj`` (a model or optimizer) comes from."""
    framework = type(obj).__module__.split(".")[0]
    backends = installed_backends()
    for name, entry in backends.items():
        if framework == entry.record.framework or framework in entry.record.modules:
            return load_backend(name)
    raise UnknownBackendError(f"<one for {framework} objects like {type(obj).__name__}>", backends)
