"""Registers the numpy reference backend through the same hook as outside plugins."""

from __future__ import annotations

from psdk.plugins.hookspecs import BackendRecord, hookimpl


@hookimpl
def psdk_register_backends() -> list[BackendRecord]:
    return [
        BackendRecord(
            name="numpy",
            target="psdk.plugins.backends.numpy_backend:NumpyBackend",
            framework="psdk",
            description="reference backend in plain numpy (CPU only); documents the contract",
            aliases=("np",),
        )
    ]
