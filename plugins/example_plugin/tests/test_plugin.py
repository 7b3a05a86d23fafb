"""The plugin as psdk sees it: registered, listed, selectable from the config, nothing imported early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from psdk_example.lion import Lion
from psdk_example.resmlp import ResMlpSpec

from psdk import plugins


def test_its_rule_and_model_are_registered() -> None:
    assert plugins.installed_rules()["lion"] is Lion
    record = plugins.installed_models()["resmlp"]
    assert record.target == "psdk_example.resmlp:ResMlpSpec" and set(record.builders) == {"torch", "tf", "jax"}
    assert plugins.distribution_of(record.target).startswith("psdk-example")


def test_listing_plugins_shows_both_and_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "from psdk.launch.cli import main\n"
        "code = main(['plugins'])\n"
        "print('loaded', sorted(m for m in ('torch', 'tensorflow', 'jax', 'keras') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    rows = [line.split()[:3] for line in out.stdout.splitlines()]
    assert ["rule", "lion", "psdk-example"] in rows and ["model", "resmlp", "psdk-example"] in rows
    assert out.stdout.strip().splitlines()[-1] == "loaded []"


def test_the_config_offers_them_with_their_defaults(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psdk", "run", "--cfg", "job", "model=resmlp", "optimizer=lion", "model.blocks=2"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "_target_: psdk_example.lion:Lion" in out.stdout and "beta2: 0.99" in out.stdout
    assert "_target_: psdk_example.resmlp:ResMlpSpec" in out.stdout and "blocks: 2" in out.stdout


def test_the_spec_is_canonical_and_seeded() -> None:
    spec = ResMlpSpec(width=16, blocks=2, input_dim=8)
    names = [name for name, _ in spec.variables()]
    assert names[:2] == ["stem/kernel", "stem/bias"] and names[-1] == "logits/bias" and len(names) == 8
    first, again = spec.init_weights(3), spec.init_weights(3)
    assert all(np.array_equal(first[n], again[n]) for n in names)
    assert [tuple(first[n].shape) for n in names] == [shape for _, shape in spec.variables()]
