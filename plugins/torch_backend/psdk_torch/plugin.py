"""psdk's entry point for this plugin: registers the backend and its trainers for psdk's workloads, no torch."""

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
    """psdk's MNIST and click-through (``ctr``) workloads name no framework: their torch trainers are this plugin's."""
    return [
        TrainerRecord("mnist", "torch", "psdk_torch.mnist:TorchClassifier"),
        TrainerRecord("ctr", "torch", "psdk_torch.ctr:TorchCtr"),
    ]
