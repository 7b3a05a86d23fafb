"""psdk's entry point for this plugin: registers the backend and its trainers, without importing JAX or optax."""

from __future__ import annotations

from typing import Any

from psdk.plugins.hookspecs import BackendRecord, TrainerRecord, hookimpl

OPTIONS: dict[str, Any] = {
    "jit": True,
    "matmul_precision": "highest",
    "compilation_cache_dir": None,
}
"""The plugin's options and their defaults; a job sets them as ``backend_options.jax.<key>=...``.

* ``jit``: compile the training step, the evaluation and the weight loads with
  ``jax.jit`` (``false`` runs them op by op, for stepping through in a debugger).
* ``matmul_precision``: the precision of the dense layers' matmuls, any value
  ``jax.lax.dot`` takes (``highest``, ``high``, ``default``, ``tensorfloat32``,
  ``bfloat16``, ...). ``highest`` is full float32, what torch, TensorFlow and the
  numpy reference compute, so workers of a mixed job agree; JAX's own default
  lets a GPU use TF32.
* ``compilation_cache_dir``: a folder for JAX's persistent compilation cache
  (``jax_compilation_cache_dir``), shared by the workers and kept between jobs;
  ``null`` (the default) leaves the cache off.
"""


@hookimpl
def psdk_register_backends() -> list[BackendRecord]:
    return [
        BackendRecord(
            name="jax",
            target="psdk_jax.backend:JaxBackend",
            framework="jax",
            description="JAX with optax optimizers, jax.jit (CPU or GPU)",
            modules=("optax",),
            install="pip install -e plugins/jax_backend (plain jax from PyPI is the CPU build; "
            "pip install 'jax[cuda12]' for NVIDIA GPUs), or pip install jax optax",
            options=OPTIONS,
        )
    ]


@hookimpl
def psdk_register_trainers() -> list[TrainerRecord]:
    """MNIST and click-through (``ctr``) on JAX (their losses and predictions on this backend's bridge), each
    imported only when a job uses it."""
    return [
        TrainerRecord("mnist", "jax", "psdk_jax.mnist:JaxClassifier"),
        TrainerRecord("ctr", "jax", "psdk_jax.ctr:JaxCtr"),
    ]
