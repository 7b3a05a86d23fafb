"""The plugin registers without importing TensorFlow, and psdk finds it by name and by object."""

from __future__ import annotations

import subprocess
import sys

import keras

from psdk import plugins


def test_importing_the_plugin_does_not_import_tensorflow() -> None:
    code = (
        "import sys, psdk_tf, psdk_tf.plugin, psdk.plugins as p\n"
        "backends = p.installed_backends()\n"
        "assert 'tf' in backends, backends\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_the_backend_is_registered_by_its_distribution() -> None:
    entry = plugins.installed_backends()["tf"]
    assert entry.distribution.startswith("psdk-tf") and entry.record.framework == "tensorflow"
    assert plugins.load_backend("tf").name == "tf"


def test_a_keras_optimizer_selects_the_tf_backend() -> None:
    """Keras optimizers live in the ``keras`` package, which the plugin's record claims."""
    backend = plugins.backend_for(keras.optimizers.SGD(0.1))
    assert backend.name == "tf" and backend.owns(keras.optimizers.Adam())


def test_psdk_plugins_lists_tf() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "psdk", "plugins"], capture_output=True, text=True, timeout=120, check=True
    )
    line = next(row for row in out.stdout.splitlines() if row.split()[:2] == ["backend", "tf"])
    assert "tensorflow" in line and "psdk-tf" in line
