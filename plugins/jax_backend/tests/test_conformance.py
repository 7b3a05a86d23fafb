"""psdk's conformance suites, run against the JAX bridge and psdk's MNIST and ctr trainers on JAX."""

from __future__ import annotations

from psdk.testing import BridgeConformance, TrainerConformance


class TestJaxBridgeConformance(BridgeConformance):
    backend_name = "jax"


class TestJaxMnistTrainerConformance(TrainerConformance):
    backend_name = "jax"


class TestJaxCtrTrainerConformance(TrainerConformance):
    """The ctr trainer through a worker's path: rows written before each batch, row gradients summed per id."""

    backend_name = "jax"
    workload = "ctr"
