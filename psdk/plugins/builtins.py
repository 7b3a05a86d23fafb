"""psdk's own update rules and models, registered through the same hooks as any plugin's.

Like pytest's built-in plugins, these go through :mod:`psdk.plugins.hookspecs`: a
rule, model or dataset that a plugin adds is found, listed and configured
exactly as these are, and nothing in the core knows the built-ins by name.
"""

from __future__ import annotations

from psdk.plugins.hookspecs import DatasetRecord, ModelRecord, hookimpl
from psdk.ps.rules import SGD, Adagrad, Adam, NoOp, RMSProp, UpdateRule


@hookimpl
def psdk_register_rules() -> list[type[UpdateRule]]:
    return [SGD, Adam, Adagrad, RMSProp, NoOp]


@hookimpl
def psdk_register_models() -> list[ModelRecord]:
    spec = "psdk.plugins.models:ModelSpec"
    return [
        ModelRecord("mlp", spec, description="784-100-10 with ReLU, the classic distributed MNIST network"),
        ModelRecord("softmax", spec, description="softmax regression, 784-10"),
    ]


@hookimpl
def psdk_register_datasets() -> list[DatasetRecord]:
    return [
        DatasetRecord(
            "mnist",
            "psdk.data.datasets:mnist_dataset",
            "MNIST: the four IDX files, checksummed, downloaded when missing",
        ),
        DatasetRecord(
            "idx",
            "psdk.data.datasets:idx_folder",
            "any folder of MNIST-format IDX files (Fashion-MNIST, KMNIST, ...); classes and image size read from it",
        ),
    ]
