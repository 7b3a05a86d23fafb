"""The presets in conf/experiment/: each composes to the classic example it names, and trains.

A preset is a ``# @package _global_`` file chosen by ``experiment=NAME`` (or
Hydra's ``+experiment=NAME``); it must win over the defaults of the groups it
picks (softmax.yaml's own optimizer included), and the command line must still
win over it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from .jobs import FAST_FLAGS, psdk

pytestmark = pytest.mark.timeout(120)

EXPECTED: dict[str, dict[str, Any]] = {
    "softmax_sgd": {
        "model.name": "softmax",
        "model.hidden": [],
        "optimizer._target_": "psdk.ps.rules:SGD",
        "optimizer.lr": 0.01,
        "optimizer.momentum": 0.0,
        "optimizer.decay_rate": 1.0,  # not softmax.yaml's momentum_decay
        "sync.mode": "async",
        "topology.num_workers": 3,
        "train.batch_size": 100,
        "train.steps": 20000,
    },
    "mlp_adam_sync": {
        "model.name": "mlp",
        "model.hidden": [100],
        "optimizer._target_": "psdk.ps.rules:Adam",
        "optimizer.lr": 0.001,
        "sync.mode": "sync",
        "sync.replicas_to_aggregate": 2,
        "topology.num_workers": 3,
        "train.batch_size": 100,
        "train.steps": 3000,
    },
}


def composed(*args: str) -> Any:
    """The job config ``python -m psdk run ARGS --cfg job`` prints."""
    result = psdk("run", *args, "--cfg", "job", timeout=60)
    assert result.returncode == 0, result.stderr
    return OmegaConf.create(result.stdout)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_preset_composes_to_its_example(name: str) -> None:
    cfg = composed(f"experiment={name}")
    for key, value in EXPECTED[name].items():
        got = OmegaConf.select(cfg, key)
        assert (OmegaConf.to_object(got) if OmegaConf.is_config(got) else got) == value, key
    assert OmegaConf.to_yaml(composed(f"+experiment={name}")) == OmegaConf.to_yaml(cfg)


def test_the_command_line_wins_over_a_preset() -> None:
    cfg = composed("experiment=mlp_adam_sync", "train.steps=7", "sync.replicas_to_aggregate=3", "optimizer=sgd")
    assert (cfg.train.steps, cfg.sync.replicas_to_aggregate, cfg.optimizer._target_) == (7, 3, "psdk.ps.rules:SGD")


@pytest.mark.slow
@pytest.mark.parametrize("name, steps, at_least", [("softmax_sgd", 600, 0.7), ("mlp_adam_sync", 300, 0.85)])
def test_a_preset_trains_end_to_end(tmp_path: Path, name: str, steps: int, at_least: float) -> None:
    result = psdk(
        "run", f"experiment={name}", "backend=numpy", f"train.steps={steps}", *FAST_FLAGS, out=tmp_path, timeout=110
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = OmegaConf.to_container(OmegaConf.load(tmp_path / "summary.json"))
    assert isinstance(summary, dict)
    assert summary["global_step"] == steps and summary["num_workers"] == 3
    assert summary["model"] == EXPECTED[name]["model.name"] and summary["sync"]["mode"] == EXPECTED[name]["sync.mode"]
    assert summary["test_accuracy"] >= at_least, summary["test_accuracy"]
