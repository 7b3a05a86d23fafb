"""psdk's entry point for this plugin: registers the backend and MNIST's torch trainer without importing torch."""

from __future__ import annotations

from psdk.plugins.hookspecs import BackendRecord, TrainerRecord, hookimpl


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


@hookimpl
def psdk_register_trainers() -> list[TrainerRecord]:
    """psdk's MNIST workload names no framework: its torch trainer is this plugin's."""
    return [TrainerRecord("mnist", "torch", "psdk_torch.mnist:TorchClassifier")]
