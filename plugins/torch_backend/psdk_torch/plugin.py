"""psdk's entry point for this plugin: registers the backend without importing torch."""

from __future__ import annotations

from psdk.plugins.hookspecs import BackendRecord, hookimpl


@hookimpl
def psdk_register_backends() -> list[BackendRecord]:
    return [
        BackendRecord(
            name="torch",
            target="psdk_torch.backend:TorchBackend",
            framework="torch",
            description="PyTorch (CPU or CUDA)",
            aliases=("pytorch",),
            install="pip install torch (the CPU build: --index-url https://download.pytorch.org/whl/cpu), "
            "or `make setup` in a psdk checkout",
        )
    ]
