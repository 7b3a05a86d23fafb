"""psdk's entry point for this plugin: registers the backend and its trainers without importing TensorFlow."""

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
    """psdk's MNIST and click-through (``ctr``) workloads name no framework: their TensorFlow trainers are here."""
    return [
        TrainerRecord("mnist", FRAMEWORK, "psdk_tf.mnist:TfClassifier"),
        TrainerRecord("ctr", FRAMEWORK, "psdk_tf.ctr:TfCtr"),
    ]
