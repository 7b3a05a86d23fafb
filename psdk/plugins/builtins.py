"""psdk's own update rules, models, datasets and the MNIST workload, registered through the same hooks as any plugin's.

Like pytest's built-in plugins, these go through :mod:`psdk.plugins.hookspecs`: a
rule, model, dataset or workload that a plugin adds is found, listed and configured
exactly as these are, and nothing in the core knows the built-ins by name.
"""

from __future__ import annotations

from psdk.plugins.hookspecs import DatasetRecord, ModelRecord, WorkloadRecord, hookimpl
from psdk.plugins.metrics import MetricSpec
from psdk.ps.rules import SGD, Adagrad, Adam, NoOp, RMSProp, UpdateRule
from psdk.workloads.ctr import workload as ctr

MNIST_METRICS = (
    MetricSpec("loss", higher_is_better=False, held_out=False),
    MetricSpec("accuracy", short="acc", primary=True, target=0.97),
)
"""MNIST's metrics: the training batch's cross-entropy, and accuracy (on the validation split while it
trains, on the test set at the end); ``test_accuracy`` in ``summary.json`` is the last's old name."""


@hookimpl
def psdk_register_rules() -> list[type[UpdateRule]]:
    return [SGD, Adam, Adagrad, RMSProp, NoOp]


@hookimpl
def psdk_register_models() -> list[ModelRecord]:
    spec = "psdk.plugins.models:ModelSpec"
    return [
        ModelRecord("mlp", spec, description="784-100-10 with ReLU, the classic distributed MNIST network"),
        ModelRecord("softmax", spec, description="softmax regression, 784-10"),
        ModelRecord(
            "dlrm",
            "psdk.workloads.ctr.model:DlrmSpec",
            description="DLRM-style click model: an embedding table, bottom and top MLPs, pairwise dot products",
        ),
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


@hookimpl
def psdk_register_workloads() -> list[WorkloadRecord]:
    # MNIST's own trainer is the numpy reference's; the torch, TensorFlow and JAX plugins give it
    # theirs (psdk_register_trainers), as any framework plugin would, so psdk names none of them.
    return [
        WorkloadRecord(
            "mnist",
            "the distributed MNIST job: classify 28x28 digits, test accuracy at the end",
            trainers={"psdk": "psdk.workloads.mnist.trainers:NumpyClassifier"},
            shard="psdk.workloads.mnist.workload:shard",
            score="psdk.workloads.mnist.workload:score",
            check="psdk.workloads.mnist.checks:check",
            train_size="psdk.workloads.mnist.checks:train_size",
            prepare="psdk.workloads.mnist.data:prepare",
            data="psdk.workloads.mnist.data:check_data",
            metrics=MNIST_METRICS,
        ),
        WorkloadRecord(
            "ctr",
            "click-through rate on a Criteo-shaped click log (generated, or Criteo TSV files): AUC (use model=dlrm)",
            trainers={"psdk": "psdk.workloads.ctr.trainers:NumpyDlrm"},
            shard="psdk.workloads.ctr.workload:shard",
            score="psdk.workloads.ctr.workload:score",
            check="psdk.workloads.ctr.workload:check",
            train_size="psdk.workloads.ctr.workload:train_size",
            options=ctr.OPTIONS,
            metrics=ctr.METRICS,
        ),
    ]
