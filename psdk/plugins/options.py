"""A workload's own ``workload.*`` keys, as a frozen dataclass that reads, checks and lists them.

A workload record declares its defaults (``WorkloadRecord.options``) and its
entries get the job's ``workload`` node, which also carries ``name`` and
whatever else the job set. Subclassing :class:`WorkloadOptions` gives a
workload one typed place for its keys: ``of`` keeps the keys it knows,
``as_dict`` is the record's defaults, and the checks word a bad value the
same way in every workload, naming ``workload.<key>``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from psdk.errors import ConfigError

Options = TypeVar("Options", bound="WorkloadOptions")


@dataclass(frozen=True)
class WorkloadOptions:
    """Subclass with ``@dataclass(frozen=True)`` and the keys as fields with defaults; check in ``__post_init__``."""

    @classmethod
    def of(cls: type[Options], options: Mapping[str, Any]) -> Options:
        """The options from the job's ``workload`` node (its ``name`` and keys of no field left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in dict(options).items() if key in known})

    def as_dict(self) -> dict[str, Any]:
        """Every key and its value: with the defaults, what the workload record declares."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_whole(self, **least: int) -> None:
        """Each named key is a whole number (not a bool) of at least its value."""
        for key, low in least.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"workload.{key}", f"must be a whole number >= {low}, got {value!r}")

    def check_number(self, key: str, ok: Callable[[float], bool], wanted: str) -> None:
        """``key`` is a finite number (not a bool) for which ``ok`` holds; ``wanted`` words it ("in (0, 10)")."""
        value = getattr(self, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ConfigError(f"workload.{key}", f"must be a number {wanted}, got {value!r}")
