"""Old module paths from before the tree had packages: those plugins import still load, the others name the new place.

A plugin written against ``psdk.optim`` or ``psdk.backend`` must keep
working; a script that imported ``psdk.store`` must be told the new place,
not just "No module named".
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from psdk import _moved

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def test_every_old_path_names_a_module_that_exists_and_no_longer_exists_itself() -> None:
    for old, new in _moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        relative = Path(*old.split("."))
        assert not (ROOT / relative.with_suffix(".py")).exists() and not (ROOT / relative).is_dir(), old
    assert set(_moved.MOVED) >= _moved.STILL_IMPORTABLE


@pytest.mark.parametrize("old", sorted(_moved.STILL_IMPORTABLE))
def test_an_old_path_plugins_import_is_the_module_at_its_new_place(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


@pytest.mark.parametrize("old", sorted(set(_moved.MOVED) - _moved.STILL_IMPORTABLE))
def test_any_other_old_path_fails_naming_the_new_module(old: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"it moved to '{_moved.MOVED[old]}'") as caught:
        importlib.import_module(old)
    assert caught.value.name == old


def test_a_plugin_written_against_the_old_paths_gets_one_class_per_name() -> None:
    """What psdk_torch imported before the move, in a fresh process: the same classes as the new paths give."""
    code = (
        "from psdk.optim import UpdateRule, SGD\n"
        "from psdk.backend import Backend\n"
        "from psdk.backends import kit\n"
        "from psdk.models import ModelSpec\n"
        "from psdk.hookspecs import BackendRecord, hookimpl\n"
        "from psdk.sharding import layout\n"
        "from psdk.placement import check_memory_fraction\n"
        "from psdk.registry import rule_from_json\n"
        "import psdk, psdk.rules, psdk.plugins.backends.kit\n"
        "assert UpdateRule is psdk.rules.UpdateRule and SGD is psdk.rules.SGD\n"
        "assert Backend is psdk.Backend and ModelSpec is psdk.ModelSpec and BackendRecord is psdk.BackendRecord\n"
        "assert kit is psdk.plugins.backends.kit\n"
        "try:\n"
        "    from psdk.store import FlatStore\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "No module named 'psdk.store': it moved to 'psdk.ps.store'"
