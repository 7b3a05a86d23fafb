"""The plugin system: the hooks, the registry of what plugins provide, and the backends made from it.

:mod:`~psdk.plugins.hookspecs` declares the five hooks and their records,
:mod:`~psdk.plugins.registry` finds what installed plugins register,
:mod:`~psdk.plugins.loading` makes backends from it, :mod:`~psdk.plugins.backend`
is the contract a framework implements, :mod:`~psdk.plugins.models` the
model specs every backend builds alike, :mod:`~psdk.plugins.builtins` psdk's
own rules, models, datasets and the MNIST workload, and :mod:`~psdk.plugins.backends` the numpy
reference backend with the kit every backend uses.

``psdk.plugins.load_backend`` and the other names of
:mod:`~psdk.plugins.loading` load lazily from here, so that ``import psdk``
(which imports the hooks) loads no backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psdk.plugins.loading import (
        backend_for,
        check_framework,
        installed_backends,
        installed_datasets,
        installed_models,
        installed_rules,
        installed_workloads,
        listing,
        load_backend,
        merged_options,
        resolve_backend_name,
        rule_from_json,
        run_entry,
        workload_of,
    )

__all__ = [
    "backend_for",
    "check_framework",
    "installed_backends",
    "installed_datasets",
    "installed_models",
    "installed_rules",
    "installed_workloads",
    "listing",
    "load_backend",
    "merged_options",
    "resolve_backend_name",
    "rule_from_json",
    "run_entry",
    "workload_of",
]


def __getattr__(name: str) -> Any:
    loading = importlib.import_module("psdk.plugins.loading")
    if name.startswith("__") or name not in loading.__all__:
        raise AttributeError(f"module 'psdk.plugins' has no attribute {name!r}")
    return getattr(loading, name)
