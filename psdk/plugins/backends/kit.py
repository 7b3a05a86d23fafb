"""What every backend needs and none should write again: device strings, optimizer mapping.

Every backend maps its framework's optimizers to the ps's update rules, refuses
the options the ps cannot run and falls back to the CPU
when the GPU it was given is not there. The torch, TensorFlow and JAX plugins
all do these the same way, through this module, so the messages a user reads
and the corner cases (float32 rounding of hyper-parameters, an optimizer
changed after it was made) are the same whatever the framework.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.ps.rules import UpdateRule

log = logging.getLogger(__name__)

DEVICE_FORMS = ("cpu", "cuda", "cuda:N")
"""What a user may name; towers also pass ``cpu:K``, the K-th CPU replica (:func:`cpu_index`)."""


# ------------------------------------------------------------------ devices
def gpu_index(device: str) -> int | None:
    """N of ``cuda:N`` (``cuda`` is ``cuda:0``); None for ``cpu`` and ``cpu:K``; anything else is refused."""
    if device == "cpu":
        return None
    if device == "cuda":
        return 0
    kind, _, index = device.partition(":")
    if kind in ("cuda", "cpu") and index.isdigit():
        return int(index) if kind == "cuda" else None
    raise ConfigError("placement.device", f"cannot place a worker on {device!r}", DEVICE_FORMS)


def cpu_index(device: str) -> int | None:
    """K of ``cpu:K`` (a tower's CPU replica; ``cpu`` is ``cpu:0``); None for a GPU."""
    if gpu_index(device) is not None:
        return None
    return int(device.partition(":")[2] or 0)


def fall_back_towers(devices: Sequence[str], gpus: int, framework: str) -> list[str]:
    """The devices this process can use for towers on ``devices``: each as :func:`fall_back_to_cpu` decides,
    a tower that falls back becoming CPU replica ``cpu:K`` (K its position), so the replicas stay distinct."""
    chosen = [fall_back_to_cpu(device, gpus, framework) for device in devices]
    return [f"cpu:{position}" if device == "cpu" else device for position, device in enumerate(chosen)]


def fall_back_to_cpu(device: str, gpus: int, framework: str) -> str:
    """The device this process can use for ``device`` when ``framework`` sees ``gpus`` GPUs.

    ``cuda:N`` with N < ``gpus``, else ``"cpu"`` with a warning, as TensorFlow's
    soft placement did: a job written for GPUs still runs on a laptop.
    """
    index = gpu_index(device)
    if index is None:
        return "cpu"
    if gpus == 0:
        log.warning("%s sees no GPU; %s falls back to the CPU", framework, device)
        return "cpu"
    if index >= gpus:
        log.warning("%s sees %d GPU(s), so there is no %s; falling back to the CPU", framework, gpus, device)
        return "cpu"
    return f"cuda:{index}"


# -------------------------------------------------------- optimizer mapping
def refuse_options(optimizer_name: str, settings: Mapping[str, Any], neutral: Mapping[str, Any]) -> None:
    """Refuse, by name, any option in ``settings`` the ps cannot run (one not at its ``neutral`` value).

    ``None`` and (for numbers) 0 count as neutral too, as frameworks spell "off" either way.
    """
    for key, off in neutral.items():
        value = settings.get(key, off)
        if value is None or value == off or (isinstance(value, (int, float)) and not value and not off):
            continue
        raise ConfigError(
            f"optimizer.{key}", f"{optimizer_name}({key}={value!r}) has no ps update rule; leave it at {off!r}"
        )


def no_rule_for(kind_name: str, supported: Sequence[str]) -> ConfigError:
    """The error for an optimizer type the ps has no rule for, listing those it has."""
    return ConfigError(
        "optimizer",
        f"{kind_name} has no ps update rule; use one of the optimizers below, or pass the rule itself: "
        "DistributedOptimizer(None, model, session, rule=psdk.rules.<Rule>(...))",
        supported,
    )


_REMEMBERED: weakref.WeakKeyDictionary[Any, UpdateRule] = weakref.WeakKeyDictionary()
_REMEMBERED_BY_ID: dict[int, tuple[Any, UpdateRule]] = {}


def _weak_key(optimizer: Any) -> Any:
    """What a rule can be kept beside, dying with the optimizer: the optimizer, or its ``update`` function.

    A NamedTuple of closures (optax's optimizers) takes no weak reference, but
    its ``update`` closure does and lives exactly as long as it.
    """
    for candidate in (optimizer, getattr(optimizer, "update", None)):
        if candidate is None:
            continue
        try:
            weakref.ref(candidate)
        except TypeError:
            continue
        return candidate
    return None


def remember_rule(optimizer: Any, rule: UpdateRule) -> None:
    """Keep the exact ``rule`` an optimizer was made from, for options its framework cannot express.

    Held beside the optimizer (an attribute, or a weak reference to it or to
    its ``update`` function), so it dies with it; an object that allows none
    of these is kept alive in a table with its rule.
    """
    try:
        optimizer.psdk_rule = rule
        return
    except (AttributeError, TypeError):
        pass
    key = _weak_key(optimizer)
    if key is not None:
        _REMEMBERED[key] = rule
    else:
        _REMEMBERED_BY_ID[id(optimizer)] = (optimizer, rule)


def remembered_rule(optimizer: Any) -> UpdateRule | None:
    """The rule :func:`remember_rule` kept for ``optimizer``, if any."""
    kept = getattr(optimizer, "psdk_rule", None)
    if isinstance(kept, UpdateRule):
        return kept
    key = _weak_key(optimizer)
    found = _REMEMBERED.get(key) if key is not None else None
    if found is not None:
        return found
    pair = _REMEMBERED_BY_ID.get(id(optimizer))
    return pair[1] if pair is not None and pair[0] is optimizer else None


def kept_if_same(rule: UpdateRule, kept: UpdateRule | None, psdk_only: frozenset[str]) -> UpdateRule:
    """``kept`` (the rule the optimizer was made from) while the framework's own settings still agree.

    ``rule`` is what the optimizer's hyper-parameters say now; fields in
    ``psdk_only`` are those the framework has no place for (torch.optim has no
    learning-rate decay, Keras no L2 ``weight_decay``), so only ``kept`` knows
    them. A user who changed the optimizer since gets ``rule``.
    Frameworks hold hyper-parameters in float32, so floats compare as float32.
    """
    if kept is None or type(kept) is not type(rule):
        return rule
    for field in dataclasses.fields(rule):
        if field.name in psdk_only:
            continue
        ours, theirs = getattr(kept, field.name), getattr(rule, field.name)
        if isinstance(ours, float) and isinstance(theirs, (int, float)):
            if np.float32(ours) != np.float32(theirs):
                return rule
        elif ours != theirs:
            return rule
    return kept
