"""psdk's entry point for this plugin: a rule and a model, registered without importing any framework."""

from __future__ import annotations

from psdk.plugins.hookspecs import ModelRecord, hookimpl
from psdk.rules import UpdateRule
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
        )
    ]
