"""The plugin registers without importing torch, and psdk finds it by name and by object."""

from __future__ import annotations

import subprocess
import sys

import torch

from psdk import plugins


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = (
        "import sys, psdk_torch, psdk_torch.plugin, psdk.plugins as p\n"
        "backends = p.installed_backends()\n"
        "assert 'torch' in backends, backends\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_the_backend_is_registered_by_its_distribution() -> None:
    entry = plugins.installed_backends()["torch"]
    assert entry.distribution.startswith("psdk-torch") and entry.record.framework == "torch"
    assert plugins.load_backend("torch").name == "torch"


def test_a_torch_optimizer_selects_the_torch_backend() -> None:
    model = torch.nn.Linear(2, 2)
    assert plugins.backend_for(torch.optim.SGD(model.parameters(), lr=0.1)).name == "torch"


def test_psdk_plugins_lists_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psdk", "plugins"], capture_output=True, text=True, timeout=120, check=True
    )
    line = next(row for row in out.stdout.splitlines() if row.split()[:2] == ["backend", "torch"])
    assert "psdk-torch" in line
