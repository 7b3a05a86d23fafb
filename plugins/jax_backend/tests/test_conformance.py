"""psdk's conformance suites, run against the JAX bridge and psdk's MNIST trainer on JAX."""

from __future__ import annotations

from psdk.testing import BridgeConformance, TrainerConformance


class TestJaxBridgeConformance(BridgeConformance):
    backend_name = "jax"


class TestJaxMnistTrainerConformance(TrainerConformance):
    backend_name = "jax"
