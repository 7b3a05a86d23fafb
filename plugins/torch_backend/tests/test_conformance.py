"""psdk's backend conformance suite, run against the torch backend."""

from __future__ import annotations

from psdk.testing import BackendConformance


class TestTorchBackendConformance(BackendConformance):
    backend_name = "torch"
