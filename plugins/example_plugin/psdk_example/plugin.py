"""psdk's entry point for this plugin: a rule, two models and a workload, registered without importing any framework."""

from __future__ import annotations

from psdk import ModelRecord, WorkloadRecord, hookimpl
from psdk.rules import UpdateRule
from psdk_example import sines
from psdk_example.lion import Lion


@hookimpl
def psdk_register_rules() -> list[type[UpdateRule]]:
    return [Lion]


@hookimpl
def psdk_register_models() -> list[ModelRecord]:
    return [
        ModelRecord(
            name="resmlp",
            target="psdk_example.resmlp:ResMlpSpec",
            builders={
                "torch": "psdk_example.torch_model:build",
                "tf": "psdk_example.tf_model:build",
                "jax": "psdk_example.jax_model:build",
            },
            description="a residual MLP: a ReLU stem, residual ReLU blocks, softmax logits",
        ),
        ModelRecord(
            name="regressor",
            target="psdk_example.regressor:RegressorSpec",
            builders={
                "numpy": "psdk_example.regression_numpy:build",
                "torch": "psdk_example.regression_torch:build",
                "tf": "psdk_example.regression_tf:build",
                "jax": "psdk_example.regression_jax:build",
            },
            description="dense ReLU layers ending in linear outputs, for workload=sines",
        ),
    ]


@hookimpl
def psdk_register_workloads() -> list[WorkloadRecord]:
    return [
        WorkloadRecord(
            "sines",
            "regress a noisy sum of sines of x in R^d, generated from a seed (use model=regressor)",
            trainers={
                "psdk": "psdk_example.regression_numpy:NumpyRegressor",
                "torch": "psdk_example.regression_torch:TorchRegressor",
                "tensorflow": "psdk_example.regression_tf:TfRegressor",
                "jax": "psdk_example.regression_jax:JaxRegressor",
            },
            shard="psdk_example.sines:shard",
            score="psdk_example.sines:score",
            check="psdk_example.sines:check",
            train_size="psdk_example.sines:train_size",
            options=sines.OPTIONS,
            metrics=sines.METRICS,
        )
    ]
