"""psdk's backend conformance suite, run against the JAX backend."""

from __future__ import annotations

from psdk.testing import BackendConformance


class TestJaxBackendConformance(BackendConformance):
    backend_name = "jax"
