"""psdk's backend conformance suite, run against the TensorFlow backend."""

from __future__ import annotations

from psdk.testing import BackendConformance


class TestTfBackendConformance(BackendConformance):
    backend_name = "tf"
