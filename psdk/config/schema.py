"""Schemas of the Hydra config tree: a typo in a key fails at composition, naming it.

Each config group's YAML files extend one of these dataclasses (stored in
Hydra's ConfigStore as ``base_<name>`` in that group) and carry a
``_target_`` that :func:`hydra.utils.instantiate` turns into the object the
code uses. Every option of the ``sync`` group shares one schema, so a sweep
such as ``-m sync=sync,async sync.replicas_to_aggregate=2`` never fails on
one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    _target_: str = "psdk.models.ModelSpec"
    name: str = MISSING
    hidden: list[int] = field(default_factory=list)
    input_dim: int = 784
    num_classes: int = 10


@dataclass
class SGDConfig:
    _target_: str = "psdk.optim.SGD"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decay_rate: float = 1.0
    decay_steps: int = 1000
    decay: str = "exponential"


@dataclass
class AdamConfig:
    _target_: str = "psdk.optim.Adam"
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    epsilon_mode: str = "torch"
    decay_rate: float = 1.0
    decay_steps: int = 1000
    decay: str = "exponential"


@dataclass
class AdagradConfig:
    _target_: str = "psdk.optim.Adagrad"
    lr: float = 0.01
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0
    decay_rate: float = 1.0
    decay_steps: int = 1000
    decay: str = "exponential"


@dataclass
class RMSPropConfig:
    _target_: str = "psdk.optim.RMSProp"
    lr: float = 0.01
    alpha: float = 0.99
    eps: float = 1e-8
    momentum: float = 0.0
    centered: bool = False
    weight_decay: float = 0.0
    decay_rate: float = 1.0
    decay_steps: int = 1000
    decay: str = "exponential"


@dataclass
class SyncConfig:
    _target_: str = "psdk.consistency.SyncSpec"
    mode: str = "async"
    replicas_to_aggregate: Any = None  # int, or null for "all workers"
    staleness: int = 0


@dataclass
class TopologyConfig:
    _target_: str = "psdk.cluster.Topology"
    num_ps: int = 1
    num_workers: int = 2
    host: str = "127.0.0.1"
    sharding: str = "round_robin"
    worker_backends: Any = None


@dataclass
class LocalLauncherConfig:
    _target_: str = "psdk.launch.local.LocalLauncher"
    ready_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0


@dataclass
class RayLauncherConfig:
    _target_: str = "psdk.launch.ray.RayLauncher"
    address: Any = None
    num_cpus: Any = None
    cpus_per_ps: float = 1.0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    ready_timeout_s: float = 120.0
    shutdown_timeout_s: float = 30.0


@dataclass
class TrainConfig:
    steps: int = 6000
    batch_size: int = 100
    validate_every: int = 500
    log_every: int = 100
    threads: int = 1
    overlap: bool = False
    final_wait_s: float = 120.0


@dataclass
class RecoveryConfig:
    enabled: bool = True
    max_restarts: int = 3
    timeout_s: float = 120.0


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    every_steps: int = 0
    every_seconds: float = 60.0
    keep: int = 5
    final: bool = True


@dataclass
class DataConfig:
    dir: Any = None
    cache_dir: Any = None
    download: bool = True
    validation_size: int = 5000
    mirrors: list[str] = field(
        default_factory=lambda: [
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ]
    )


@dataclass
class TransportConfig:
    secure: bool = True
    keys_dir: Any = None
    shared_memory: bool = True
    doorbells: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    init_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    max_message_bytes: int = 1 << 30
    io_threads: int = 1


@dataclass
class PsConfig:
    bind: Any = None
    announce_file: Any = None
    io_threads: Any = None
    log_every_s: float = 10.0
    idle_timeout_s: Any = 60.0  # seconds, or null: never
    progress_file: Any = None
    max_connections: Any = None  # null: 4 per worker + 16
    pause_lease_s: Any = None  # null: 3 heartbeat intervals


@dataclass
class PlacementConfig:
    device: str = "auto"
    gpu_memory_fraction: Any = None
    isolate_gpus: bool = True
    pin_cpus: bool = False
    compute_nice: int = 0


@dataclass
class ProgressConfig:
    mode: str = "auto"
    every_s: float = 10.0


@dataclass
class ReportConfig:
    plot: bool = True
    tensorboard: bool = False
    target_accuracy: float = 0.97


@dataclass
class PsdkConfig:
    """The primary config (``conf/config.yaml`` extends it)."""

    model: Any = MISSING
    optimizer: Any = MISSING
    sync: Any = MISSING
    topology: Any = MISSING
    launcher: Any = MISSING
    backend: str = "torch"
    seed: int = 0
    job_name: Any = None
    task_index: int = 0
    ps_hosts: Any = None
    ps_hosts_from: Any = None
    worker_hosts: Any = None
    output_dir: Any = None
    resume: Any = None
    weights: Any = None
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    ps: PsConfig = field(default_factory=PsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    report: ReportConfig = field(default_factory=ReportConfig)


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"base_model": ModelConfig},
    "optimizer": {
        "base_sgd": SGDConfig,
        "base_adam": AdamConfig,
        "base_adagrad": AdagradConfig,
        "base_rmsprop": RMSPropConfig,
    },
    "sync": {"base_sync": SyncConfig},
    "topology": {"base_topology": TopologyConfig},
    "launcher": {"base_local": LocalLauncherConfig, "base_ray": RayLauncherConfig},
}


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=PsdkConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)
