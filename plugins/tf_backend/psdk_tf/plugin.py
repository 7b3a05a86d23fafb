"""psdk's entry point for this plugin: registers the backend and MNIST's trainer without importing TensorFlow."""

from __future__ import annotations

from psdk.plugins.hookspecs import BackendRecord, TrainerRecord, hookimpl

FRAMEWORK = "tensorflow"


@hookimpl
def psdk_register_backends() -> list[BackendRecord]:
    return [
        BackendRecord(
            name="tf",
            target="psdk_tf.backend:TfBackend",
            framework=FRAMEWORK,
            description="TensorFlow 2 with Keras 3 optimizers (CPU or GPU)",
            modules=("keras",),
            aliases=("tensorflow", "tensorflow2", "keras"),
            install="pip install -e 'plugins/tf_backend[cpu]' installs tensorflow-cpu with the plugin "
            "([gpu] for tensorflow[and-cuda]), or pip install tensorflow-cpu",
        )
    ]


@hookimpl
def psdk_register_trainers() -> list[TrainerRecord]:
    """MNIST, psdk's own workload, trains on TensorFlow with this plugin's trainer."""
    return [TrainerRecord("mnist", FRAMEWORK, "psdk_tf.mnist:TfClassifier")]
