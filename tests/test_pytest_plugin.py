"""psdk's pytest plugin, loaded in the session of anyone who installs psdk, adds only fixtures named ``psdk_...``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psdk.testing import pytest_plugin

pytestmark = pytest.mark.timeout(120)

A_PROJECT = {
    "conftest.py": 'import pytest\n\n\n@pytest.fixture\ndef mnist_dir():\n    return "the project\'s own"\n',
    "test_project.py": """
from psdk.testing import RuleAgreement


class TestAgree(RuleAgreement):
    def framework_steps(self, rule, start, grads):
        return self.rule_steps(rule, start, grads)


def test_its_own_fixture_is_its_own(mnist_dir):
    assert mnist_dir == "the project's own"

""",
}


def test_the_plugin_defines_psdk_fixtures_and_no_hook() -> None:
    names = [n for n in vars(pytest_plugin) if not n.startswith("__")]
    fixtures = [n for n in names if type(getattr(pytest_plugin, n)).__name__ == "FixtureFunctionDefinition"]
    assert sorted(fixtures) == ["psdk_mnist_dir", "psdk_ps"]
    assert not [n for n in names if n.startswith("pytest_")]


def test_a_project_keeps_its_fixtures_and_rule_agreement_still_gets_a_test_per_case(tmp_path: Path) -> None:
    for name, text in A_PROJECT.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "psdk.testing.pytest_plugin", "-p", "no:cacheprovider", "."],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "9 passed" in done.stdout, done.stdout[-3000:]
