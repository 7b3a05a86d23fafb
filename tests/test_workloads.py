"""Workloads plug in like every other extension: through a hook, the built-in MNIST one too.

The commands and launchers find the chosen workload in the registry and run
its entries; none of them imports a workload's package (checked from the
source, at any depth, as ``tests/test_structure.py`` reads imports).
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pluggy
import pytest
from omegaconf import OmegaConf

from psdk import plugins
from psdk.config import config_dir, prepare_hydra
from psdk.config.check import OverrideChecker
from psdk.config.schema import plugin_choices
from psdk.errors import ConfigError, PluginError
from psdk.launch.cli import main
from psdk.plugins import builtins, hookspecs, registry
from psdk.plugins.hookspecs import WorkloadRecord, hookimpl
from psdk.plugins.registry import locate
from tests.test_structure import import_graph

pytestmark = pytest.mark.timeout(60)

CALLS: list[Any] = []


def toy_worker(cfg: Any) -> str:
    """A plugin workload's worker entry: records that it ran, on what."""
    CALLS.append(cfg.workload.name)
    return "trained"


TOY = WorkloadRecord(
    "toy",
    "a toy regression on generated data",
    trainers={"torch": "tests.test_workloads:toy_worker"},
    worker="tests.test_workloads:toy_worker",
    evaluate="tests.test_workloads:toy_worker",
    options={"noise": 0.1},
)


def manager(*answers: list[Any]) -> pluggy.PluginManager:
    """psdk's own plugins, then one fake plugin per answer to ``psdk_register_workloads``."""
    pm = pluggy.PluginManager("psdk")
    pm.add_hookspecs(hookspecs)
    for name in registry.DEFAULT_PLUGINS:
        pm.register(__import__(name, fromlist=["_"]), name=name)
    for i, answer in enumerate(answers):
        module = types.ModuleType(f"fake_workload_plugin_{i}")
        module.psdk_register_workloads = hookimpl(lambda answer=answer: answer)  # type: ignore[attr-defined]
        pm.register(module, name=module.__name__)
    return pm


def test_the_mnist_workload_is_built_in_and_its_entries_load() -> None:
    mnist = plugins.installed_workloads()["mnist"]
    built_in, ctr = builtins.psdk_register_workloads()  # MNIST, and the click-through workload (test_ctr*.py)
    assert ctr.name == "ctr"
    # The installed record is the built-in one with the trainers framework plugins give it (TrainerRecord).
    assert dataclasses.replace(mnist, trainers=built_in.trainers) == built_in
    assert dict(built_in.trainers).items() <= dict(mnist.trainers).items()
    for entry in ("worker", "evaluate", "prepare", "data"):
        assert callable(locate(getattr(mnist, entry))), entry
    assert mnist.trainer("psdk") == "psdk.workloads.mnist.trainers:NumpyClassifier"  # the numpy bridge's
    assert mnist.trainer("no-such-framework") is None  # no trainer for every framework: each names its own
    assert plugins.distribution_of(mnist.worker).startswith("psdk")


def test_a_config_that_names_no_workload_is_the_mnist_job() -> None:
    assert plugins.workload_of(OmegaConf.create({"backend": "numpy"})).name == "mnist"


def test_a_plugins_workload_is_found_through_the_hook_and_its_entry_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = manager([TOY])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    assert sorted(plugins.installed_workloads()) == ["ctr", "mnist", "toy"]
    cfg = OmegaConf.create({"workload": {"name": "toy", "noise": 0.1}})
    CALLS.clear()
    assert plugins.run_entry(cfg, "worker") == "trained" and CALLS == ["toy"]
    assert plugins.run_entry(cfg, "prepare") is None  # it prepares nothing
    everywhere = dataclasses.replace(TOY, trainers={"*": "tests.test_workloads:toy_worker"})
    assert plugins.check_trainer(everywhere, "numpy") == "tests.test_workloads:toy_worker"
    with pytest.raises(ConfigError, match=r"'toy' has no trainer for psdk \(the numpy backend\)"):
        plugins.check_trainer(TOY, "numpy")  # it trains on torch alone
    # A workload without a file in conf/workload/ is a choice of the group all the same, with its keys.
    assert plugin_choices(config_dir())["workload"] == {"toy": {"name": "toy", "noise": 0.1}}


def test_two_plugins_registering_one_workload_name_are_both_named(monkeypatch: pytest.MonkeyPatch) -> None:
    other = WorkloadRecord("toy", "another", trainers={"*": "b:T"}, worker="other_pkg.job:run", evaluate="b:e")
    pm = manager([TOY], [other])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    with pytest.raises(PluginError, match="two plugins provide the workload 'toy'") as info:
        plugins.installed_workloads()
    assert "tests.test_workloads:toy_worker" in str(info.value) and "other_pkg.job:run" in str(info.value)


def test_a_plugin_registering_no_workload_record_is_skipped_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = manager([{"name": "toy"}])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    monkeypatch.setattr(registry, "BROKEN", {})
    assert sorted(plugins.installed_workloads()) == ["ctr", "mnist"]
    assert "fake_workload_plugin_0" in " ".join(registry.BROKEN.values())


def test_an_unknown_workload_is_refused_naming_the_installed_ones() -> None:
    prepare_hydra()
    with pytest.raises(ConfigError, match=r"workload: has no option 'mnsit'; did you mean workload=mnist\?"):
        OverrideChecker(config_dir()).check(["workload=mnsit"])
    with pytest.raises(ConfigError, match="no installed workload is called 'clicks'") as info:
        plugins.workload_of(OmegaConf.create({"workload": {"name": "clicks"}}))
    assert "mnist" in str(info.value)


def test_the_default_config_chooses_the_mnist_workload() -> None:
    prepare_hydra()
    cfg = OverrideChecker(config_dir()).composed([])
    assert cfg.workload.name == "mnist" and plugins.workload_of(cfg).name == "mnist"


def test_psdk_plugins_lists_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["workload", "mnist"]]
    assert len(rows) == 1 and "(built in)" in rows[0] and "(trains on: " in rows[0] and "numpy" in rows[0]


def test_no_command_or_launcher_imports_a_workload_package() -> None:
    launch = {m: deps for m, deps in import_graph().items() if m == "psdk.launch" or m.startswith("psdk.launch.")}
    assert "psdk.launch.cli" in launch and "psdk.launch.local" in launch
    bad = {m: sorted(d for d in deps if d.startswith("psdk.workloads")) for m, deps in launch.items()}
    assert not {m: d for m, d in bad.items() if d}, f"launch modules importing a workload: {bad}"


def test_the_workload_import_check_can_fail(tmp_path: Path) -> None:
    from tests.test_structure import _imports

    module = tmp_path / "m.py"
    module.write_text("def f():\n    from psdk.workloads.mnist import workload\n")
    assert _imports(module, {"psdk.workloads.mnist.workload"}) == {"psdk.workloads.mnist.workload"}


@pytest.mark.timeout(300)
def test_workload_mnist_is_the_default_job_and_trains(tmp_path: Path, psdk_mnist_dir: Path) -> None:
    """``workload=mnist`` named on the command line is the job ``run`` trains by default, to its usual accuracy."""
    import json

    from tests.jobs import FAST_FLAGS, psdk

    result = psdk("run", "workload=mnist", "backend=numpy", "train.steps=300", *FAST_FLAGS, out=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] >= 300 and summary["test_accuracy"] > 0.9
    # The launcher fetched the data once, through the workload's prepare entry, for every task.
    assert f"data.dir={psdk_mnist_dir}" in result.stdout + result.stderr
