"""A command line as psdk takes it, turned into Hydra overrides: TensorFlow-style flags, host lists, TF_CONFIG.

TensorFlow 1.x programs were started as ``--job_name=ps --task_index=0
--ps_hosts=h1:2222,h2:2222``; Hydra alone would refuse the flags and read
the bare comma list as a sweep. Here both become the overrides they mean,
and ``TF_CONFIG`` (Kubeflow, Kubernetes) adds the role and the cluster,
refusing flags that say otherwise rather than ignoring either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psdk.config import flags
from psdk.errors import ConfigError
from psdk.launch import tf_config

DEFAULT_GROUPS = ("model", "optimizer", "sync", "topology", "launcher", "experiment")
HOST_KEYS = ("ps_hosts", "worker_hosts")


def normalize_args(args: Sequence[str], meant_key: Callable[[str], str | None] | None = None) -> list[str]:
    """TensorFlow-style ``--flag=value`` and bare host lists, turned into Hydra overrides.

    A ``--flag`` psdk does not take is refused (:mod:`psdk.config.flags`);
    ``meant_key`` (:func:`meant_config_key`) then says which override was meant.
    """
    out: list[str] = []
    for arg in flags.translate(args, meant_key):
        key, sep, value = arg.partition("=")
        if sep and key.startswith("+") and key.lstrip("+") in DEFAULT_GROUPS:
            key, arg = key.lstrip("+"), arg.lstrip("+")  # Hydra's docs say +experiment=...; here it is a choice
        if sep and key.lstrip("+") in HOST_KEYS and "," in value and value[:1] not in "[\"'":
            arg = f"{key}='{value}'"
        out.append(arg)
    return out


def meant_config_key(name: str) -> str | None:
    """The key of the shipped config ``name`` most likely means (to explain a flag psdk does not take)."""
    from psdk.config import config_dir, prepare_hydra
    from psdk.config.check import OverrideChecker, meant_key

    prepare_hydra()
    return meant_key(name, OverrideChecker(config_dir()).keys())


def given_text(args: Sequence[str], key: str) -> str | None:
    """The text after ``key=`` among ``args`` (a leading ``+`` ignored), or ``None``."""
    for arg in args:
        k, sep, v = arg.partition("=")
        if sep and k.lstrip("+") == key:
            return v
    return None


def _given_value(args: Sequence[str], key: str) -> object:
    """The value of ``key=...`` among ``args`` as Hydra parses it (a list, a string, a number)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for arg in args:
        k, sep, v = arg.lstrip("+").partition("=")
        if sep and k == key:
            try:
                return OverridesParser.create().parse_override(f"{k}={v}").value()
            except Exception:  # Hydra's parser says why later, with its own message
                return v
    return None


def _agrees(key: str, given: object, wanted: object) -> bool:
    from psdk.protocol.cluster import parse_hosts

    if key in HOST_KEYS:
        return parse_hosts(given, key, require_port=key == "ps_hosts") == wanted
    return str(given) == str(wanted)


def apply_tf_config(task: tf_config.TfConfigTask, command: str, args: list[str]) -> list[str]:
    """``args`` with the role and cluster of ``TF_CONFIG`` added; explicit ones must agree with it."""
    if command in ("ps", "worker") and command != task.job_name:
        raise ConfigError(
            "job_name",
            f"`python -m psdk {command}` runs a {command} task, but {task.origin} makes this "
            f"{task.job_name} {task.task_index}; run `python -m psdk task` to take the role from TF_CONFIG",
        )
    added = []
    for key, wanted in task.values().items():
        given = _given_value(args, key)
        if given is None:
            value = ",".join(wanted) if isinstance(wanted, tuple) else wanted
            added.append(f"{key}='{value}'" if key in HOST_KEYS else f"{key}={value}")
        elif not _agrees(key, given, wanted):
            shown = ",".join(wanted) if isinstance(wanted, tuple) else wanted
            raise ConfigError(
                key,
                f"is {given_text(args, key)} on the command line but {task.origin} says {shown} "
                f"(this task is {task.job_name} {task.task_index}); drop the flag, or unset TF_CONFIG "
                "to give the whole cluster by flags",
            )
    return [*added, *args]
