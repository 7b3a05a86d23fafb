"""Where the Hydra config tree is, and what psdk registers with Hydra before composing."""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_dir", "prepare_hydra", "register_configs"]


def config_dir() -> Path:
    """``conf/``: inside the installed package, or at the top of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"psdk's config tree (conf/config.yaml) is neither in {package} nor beside it; reinstall psdk"
    )


def _task_suffix(job_name: object, task_index: object) -> str:
    """Per-task runs get their own output folder, so tasks started together never share one."""
    return "" if job_name in (None, "None", "null", "") else f"-{job_name}{task_index}"


def _fraction_of(fraction: object, total: object) -> int:
    """``${psdk_fraction:0.1,${train.steps}}``: a share of a step count, as whole steps (a recipe's warmup)."""
    return round(float(str(fraction)) * int(str(total)))


def register_configs() -> None:
    """The schemas in Hydra's ConfigStore (:mod:`psdk.config.schema`, imported only here: it imports Hydra)."""
    from psdk.config.schema import register_configs as register

    register(config_dir())


def prepare_hydra() -> None:
    """Register the schemas and resolvers (idempotent)."""
    from omegaconf import OmegaConf  # here: the transport and the client import psdk.config.options without it

    register_configs()
    if not OmegaConf.has_resolver("psdk_task_suffix"):
        OmegaConf.register_new_resolver("psdk_task_suffix", _task_suffix)
    if not OmegaConf.has_resolver("psdk_fraction"):
        OmegaConf.register_new_resolver("psdk_fraction", _fraction_of)
