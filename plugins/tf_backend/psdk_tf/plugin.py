"""psdk's entry point for this plugin: registers the backend without importing TensorFlow."""

from __future__ import annotations

from psdk.plugins.hookspecs import BackendRecord, hookimpl


@hookimpl
def psdk_register_backends() -> list[BackendRecord]:
    return [
        BackendRecord(
            name="tf",
            target="psdk_tf.backend:TfBackend",
            framework="tensorflow",
            description="TensorFlow 2 with Keras 3 optimizers (CPU or GPU)",
            modules=("keras",),
            aliases=("tensorflow", "tensorflow2", "keras"),
            install="pip install -e 'plugins/tf_backend[cpu]' installs tensorflow-cpu with the plugin "
            "([gpu] for tensorflow[and-cuda]), or pip install tensorflow-cpu",
        )
    ]
