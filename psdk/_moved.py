"""Where psdk's modules went when the flat top level became packages, and what an old import path does now.

Until 0.1 every module sat in ``psdk/`` itself. The tree now follows the
architecture (``docs/architecture.md``): the ps side in :mod:`psdk.ps`, the
worker side in :mod:`psdk.client`, the shared contracts in
:mod:`psdk.protocol` and :mod:`psdk.config`, the plugin system in
:mod:`psdk.plugins`, the launchers and the CLI in :mod:`psdk.launch`. The MNIST
job has since become psdk's training loop for every workload (:mod:`psdk.jobs.worker`)
and MNIST's own package (:mod:`psdk.workloads.mnist`).

A finder first on ``sys.meta_path`` answers for the old paths alone (a
dict lookup; any other name passes on). First, because an old package's
submodule (``psdk.backends.kit``) would otherwise be found again on the
new package's path and load twice. The paths plugins import (the
backend contract and its kit, models, update rules, sharding, placement,
hooks, the registry, the CLI) still load: the old name becomes a second
name of the module at its new place, so classes stay one class. Any other
old path fails with a ``ModuleNotFoundError`` that names the new module,
rather than with a bare "No module named".
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "psdk.access": "psdk.runtime.access",
    "psdk.announce": "psdk.launch.announce",
    "psdk.backend": "psdk.plugins.backend",
    "psdk.backends": "psdk.plugins.backends",
    "psdk.backends.kit": "psdk.plugins.backends.kit",
    "psdk.backends.numpy_backend": "psdk.plugins.backends.numpy_backend",
    "psdk.backends.numpy_plugin": "psdk.plugins.backends.numpy_plugin",
    "psdk.builtins": "psdk.plugins.builtins",
    "psdk.checkpoint": "psdk.client.checkpoint",
    "psdk.cli": "psdk.launch.cli",
    "psdk.cluster": "psdk.protocol.cluster",
    "psdk.commands": "psdk.launch.commands",
    "psdk.consistency": "psdk.ps.consistency",
    "psdk.disks": "psdk.runtime.disks",
    "psdk.epochs": "psdk.jobs.epochs",
    "psdk.failpoints": "psdk.runtime.failpoints",
    "psdk.jobs.mnist": "psdk.jobs.worker",
    "psdk.workloads.mnist.job": "psdk.jobs.worker",
    "psdk.workloads.mnist.evaluate": "psdk.jobs.evaluate",
    "psdk.hookspecs": "psdk.plugins.hookspecs",
    "psdk.jobspec": "psdk.protocol.jobspec",
    "psdk.liveness": "psdk.runtime.liveness",
    "psdk.logs": "psdk.runtime.logs",
    "psdk.metrics": "psdk.report.metrics",
    "psdk.models": "psdk.plugins.models",
    "psdk.numerics": "psdk.protocol.numerics",
    "psdk.optim": "psdk.ps.rules",
    "psdk.placement": "psdk.launch.placement",
    "psdk.recovery": "psdk.client.recovery",
    "psdk.registry": "psdk.plugins.registry",
    "psdk.serving": "psdk.ps.serving",
    "psdk.sharding": "psdk.protocol.sharding",
    "psdk.store": "psdk.ps.store",
    "psdk.tf_config": "psdk.launch.tf_config",
    "psdk.waits": "psdk.runtime.waits",
    "psdk.testing.fuzz": "psdk.fuzz",
    "psdk.testing.zmtp": "psdk.bench.zmtp",
}
"""Each old module path and the module it became (``psdk.protocol`` and ``psdk.plugins`` kept their names)."""

STILL_IMPORTABLE = frozenset(
    {
        "psdk.backend",
        "psdk.backends",
        "psdk.backends.kit",
        "psdk.backends.numpy_backend",
        "psdk.cli",
        "psdk.hookspecs",
        "psdk.models",
        "psdk.optim",
        "psdk.placement",
        "psdk.registry",
        "psdk.sharding",
    }
)
"""The old paths that plugins and their tests import (``plugins/*``, ``docs/writing-a-backend.md``): they still load."""


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old module path: the module at its new place, or an error naming it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        if fullname not in STILL_IMPORTABLE:
            raise ModuleNotFoundError(f"No module named {fullname!r}: it moved to {new!r}", name=fullname)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new place has run already."""


def install() -> None:
    """Puts the finder first on ``sys.meta_path``, once."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
