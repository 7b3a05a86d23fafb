"""The Hydra config tree: every option of every group composes and instantiates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from psdk.config import config_dir, prepare_hydra
from psdk.config.build import cluster_from, instantiate_node, model_spec, sync_spec, update_rule
from psdk.config.options import options_from
from psdk.errors import ConfigError
from psdk.launch.local import LocalLauncher
from psdk.plugins.loading import workload_of
from psdk.plugins.models import ModelSpec
from psdk.plugins.registry import locate, target_of
from psdk.protocol import Sender
from psdk.protocol.cluster import Topology
from psdk.ps import main as ps_main
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, UpdateRule
from psdk.ps.server import ServerOptions
from psdk.workloads.ctr.model import DlrmSpec

CONF = config_dir()
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
# Groups that build one object; experiment/ holds presets of the whole config (tests/test_experiments.py),
# workload/ names a registered workload (tests/test_workloads.py), whose record says what runs.
COMPONENT_GROUPS = [g for g in GROUPS if g not in ("experiment", "workload")]


@pytest.fixture(autouse=True)
def hydra_context() -> Iterator[None]:
    prepare_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_the_tree_has_the_documented_groups() -> None:
    assert GROUPS == ["experiment", "launcher", "model", "optimizer", "sync", "topology", "workload"]


@pytest.mark.parametrize("option", options("workload"))
def test_every_workload_option_composes_and_names_an_installed_workload(option: str) -> None:
    cfg = compose("config", overrides=[f"workload={option}"])
    assert workload_of(cfg).name == cfg.workload.name == option


@pytest.mark.parametrize("group, option", [(g, o) for g in COMPONENT_GROUPS for o in options(g)])
def test_every_option_of_every_group_composes_and_instantiates(group: str, option: str) -> None:
    cfg = compose("config", overrides=[f"{group}={option}"])
    obj = instantiate_node(cfg, group)
    expected = {
        "model": ModelSpec,
        "optimizer": UpdateRule,
        "sync": SyncSpec,
        "topology": Topology,
        "launcher": LocalLauncher,
    }[group]
    if (group, option) == ("model", "dlrm"):  # the click-through workload's model: a spec of its own
        expected = DlrmSpec
    assert isinstance(obj, expected)


def test_a_target_whose_module_lacks_a_dependency_names_the_dependency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "torchy_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "spec.py").write_text("import torchy  # not installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="No module named 'torchy'"):
        model_spec(compose("config", overrides=["model._target_=torchy_models.spec.Spec"]))


@pytest.mark.parametrize("form", ["torchy_models.spec:Spec", "torchy_models.spec.Spec"])
def test_a_target_in_either_form_whose_module_lacks_a_dependency_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    package = tmp_path / "torchy_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "spec.py").write_text("import torchy  # not installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="No module named 'torchy'"):
        locate(form)


def test_a_target_is_package_module_colon_name_and_the_dotted_form_is_read_too() -> None:
    """One function reads every target: plugin records', and configs' _target_, saved ones included."""
    assert locate("psdk.ps.rules:SGD") is SGD and locate("psdk.ps.rules.SGD") is SGD
    assert locate("psdk.protocol:Sender.CHIEF") is Sender.CHIEF  # a dotted name after the colon: nested
    assert target_of(SGD) == "psdk.ps.rules:SGD" and locate(target_of(Sender)) is Sender
    # a module psdk moved is read at its new place, in either form (old run folders name them)
    assert locate("psdk.consistency:SyncSpec") is SyncSpec and locate("psdk.cluster.Topology") is Topology
    for bad, says in [
        ("psdk.ps.rules:NoSuchRule", "psdk.ps.rules has no NoSuchRule"),
        ("psdk:optim:SGD", "write package.module:Name"),
        ("", "write package.module:Name"),
        ("psdk.optim.NoSuchRule", "as package.module:Name"),
    ]:
        with pytest.raises(ImportError, match=says):
            locate(bad)


def test_a_saved_run_config_with_dotted_targets_still_builds() -> None:
    """Run folders written before the colon form hold ``_target_: psdk.optim.SGD`` and the like."""
    fresh = compose("config", overrides=["optimizer=sgd"])
    assert fresh.optimizer._target_ == "psdk.ps.rules:SGD" and fresh.model._target_ == "psdk.plugins.models:ModelSpec"
    saved = compose(
        "config",
        overrides=[
            "optimizer=sgd",
            "optimizer._target_=psdk.optim.SGD",
            "sync._target_=psdk.consistency.SyncSpec",
            "model._target_=psdk.models.ModelSpec",
            "topology._target_=psdk.cluster.Topology",
        ],
    )
    assert update_rule(saved) == update_rule(fresh) and sync_spec(saved) == sync_spec(fresh)
    assert model_spec(saved) == model_spec(fresh)
    assert instantiate_node(saved, "topology") == instantiate_node(fresh, "topology")


@pytest.mark.timeout(60)
def test_importing_the_schemas_loads_no_plugin_and_writes_no_globals() -> None:
    """The derived schemas are made when the ConfigStore is filled, and pickle still finds them, in a fresh process."""
    code = (
        "import pickle, psdk.config.schema as schema, psdk.plugins.registry as registry\n"
        "assert registry.get_plugin_manager.cache_info().currsize == 0, 'plugins loaded at import'\n"
        "assert 'SGDConfig' not in vars(schema) and 'SyncConfig' not in vars(schema)\n"
        "node = schema.SGDConfig(lr=0.5)\n"
        "assert 'SGDConfig' not in vars(schema)\n"
        "assert pickle.loads(pickle.dumps(node)) == node\n"
        "print(node._target_)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "psdk.ps.rules:SGD"


def test_a_required_value_left_unset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model\.input_dim: must be given"):
        model_spec(compose("config", overrides=["model.input_dim=???"]))


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            "model._target_=psdk.plugins.models.NoSuchSpec",
            "model._target_: psdk.plugins.models.NoSuchSpec cannot be imported",
        ),
        ("model._target_=no_such_package.Spec", "model._target_: no_such_package.Spec cannot be imported"),
        (
            "model._target_=psdk.protocol.cluster.Topology",
            "model: psdk.protocol.cluster.Topology refused the values given",
        ),
    ],
)
def test_a_group_that_names_no_buildable_class_is_a_config_error(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        model_spec(compose("config", overrides=[override]))


def test_the_documented_overrides_compose_together() -> None:
    cfg = compose(
        "config",
        overrides=[
            "sync=sync",
            "sync.replicas_to_aggregate=2",
            "topology.num_ps=2",
            "topology.num_workers=3",
            "optimizer=adam",
            "optimizer.lr=0.001",
            "model=softmax",
            "train.steps=123",
            "train.batch_size=50",
            "train.validate_every=10",
            "seed=7",
            "backend=numpy",
        ],
    )
    assert sync_spec(cfg).resolved(3) == SyncSpec("sync", 2, 0)
    assert update_rule(cfg).to_json()["lr"] == 0.001 and update_rule(cfg).name == "adam"
    assert model_spec(cfg).hidden == () and model_spec(cfg).num_parameters == 7850
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.validate_every, cfg.seed) == (123, 50, 10, 7)


@pytest.mark.parametrize("option", options("sync"))
def test_every_sync_option_accepts_the_same_keys(option: str) -> None:
    cfg = compose("config", overrides=[f"sync={option}", "sync.replicas_to_aggregate=1", "sync.staleness=3"])
    assert set(cfg.sync) == {"_target_", "mode", "replicas_to_aggregate", "staleness", "scale_momentum"}
    sync_spec(cfg)


@pytest.mark.parametrize("override", ["trian.steps=5", "sync.replicas=2", "optimizer.beta1=0.5"])
def test_a_typo_in_a_key_fails_at_composition(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose("config", overrides=[override])  # optimizer.beta1 does not exist for momentum


def test_a_typo_in_a_group_option_lists_the_choices() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose("config", overrides=["sync=synk"])
    assert "async" in str(info.value.__cause__ or info.value)


def test_replicas_to_aggregate_above_the_workers_is_refused_by_name() -> None:
    cfg = compose("config", overrides=["sync=sync", "sync.replicas_to_aggregate=3"])
    with pytest.raises(ConfigError) as info:
        sync_spec(cfg).resolved(2)
    assert "sync.replicas_to_aggregate" in str(info.value) and "only 2 workers" in str(info.value)


def test_per_task_mode_needs_both_host_lists() -> None:
    cfg: DictConfig = compose("config", overrides=["ps_hosts=127.0.0.1:2222"])
    with pytest.raises(ConfigError, match="worker_hosts"):
        cluster_from(cfg)


def test_the_data_dir_defaults_to_psdk_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PSDK_DATA_DIR", str(tmp_path))
    assert compose("config").data.dir == str(tmp_path)
    monkeypatch.delenv("PSDK_DATA_DIR")
    assert compose("config").data.dir is None


def server_options(cfg: DictConfig) -> ServerOptions:
    """A ps's serving options as a per-task ps builds them (a chief only where worker_hosts is given)."""
    cluster = cluster_from(cfg) if cfg.worker_hosts is not None and cfg.ps_hosts is not None else None
    return ps_main.server_options(options_from(cfg), cluster)


def test_the_ps_idle_timeout_is_seconds_or_null_and_names_the_chief() -> None:
    hosts = ["ps_hosts=10.0.0.1:2222", "worker_hosts='10.0.0.2,10.0.0.3'", "output_dir=/tmp/psdk-test"]
    options = server_options(compose("config", overrides=[*hosts, "ps.idle_timeout_s=5"]))
    assert (options.idle_timeout_s, options.chief_host) == (5.0, "10.0.0.2")
    assert server_options(compose("config", overrides=[*hosts, "ps.idle_timeout_s=null"])).idle_timeout_s is None
    with pytest.raises(ConfigError, match=r"ps\.idle_timeout_s.*null"):
        server_options(compose("config", overrides=[*hosts, "ps.idle_timeout_s=0"]))


def test_periodic_checkpoints_and_a_pause_lease_are_on_by_default() -> None:
    """A lost ps costs at most a minute of training; a checkpoint pause ends a few heartbeats after the chief."""
    cfg = compose(config_name="config", overrides=["output_dir=/tmp/psdk-test"])
    assert cfg.checkpoint.every_seconds == 60
    assert server_options(cfg).pause_lease_s == 3 * cfg.transport.heartbeat_interval_s
    lease = compose(config_name="config", overrides=["output_dir=/tmp/psdk-test", "ps.pause_lease_s=7"])
    assert server_options(lease).pause_lease_s == 7
    with pytest.raises(ConfigError, match=r"ps\.pause_lease_s"):
        server_options(compose(config_name="config", overrides=["output_dir=/tmp/psdk-test", "ps.pause_lease_s=0"]))
