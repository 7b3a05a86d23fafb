"""Checkpoints: a consistent cut of every ps shard, stored by variable name.

A checkpoint holds the variables, the update rule's slots and step, the
global step and the config that made the job, in one ``.npz`` file (no
pickle): ``params/<variable>``, ``slots/<slot>/<variable>`` and a JSON
``__meta__`` record. Storing by variable name, not by shard, lets a job resume
with another number of ps tasks, and canonical names and layouts let a
checkpoint written by torch workers resume on TensorFlow workers. The chief
collects the state over the transport (no shared file system is assumed) and
writes the file atomically: a reader sees the old file or the new one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psdk.errors import DataError

FORMAT = "psdk-checkpoint"
FORMAT_VERSION = 1
META = "__meta__"
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
WHAT_TO_RESUME = (
    "resume= takes a checkpoint the chief wrote (outputs/<run>/checkpoints/ckpt-<step>.npz) or a folder of "
    "them (outputs/<run>/checkpoints: its latest)"
)


@dataclass
class Checkpoint:
    """Everything needed to continue a job from ``global_step``."""

    global_step: int
    variables: dict[str, np.ndarray]
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    rule: dict[str, Any] = field(default_factory=dict)
    rule_step: int = 0
    config: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def check_matches(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse to restore into a model with other variables, naming the differences."""
        mine = {n: tuple(v.shape) for n, v in self.variables.items()}
        if mine != dict(shapes):
            missing = sorted(set(shapes) - set(mine))
            extra = sorted(set(mine) - set(shapes))
            differ = sorted(n for n in set(mine) & set(shapes) if mine[n] != tuple(shapes[n]))
            raise DataError(
                f"the checkpoint does not fit this model: missing {missing}, unexpected {extra}, "
                f"shapes differ {differ}; resume with the model that wrote it"
            )


def save(checkpoint: Checkpoint, path: Path) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temporary file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "global_step": checkpoint.global_step,
        "variables": list(checkpoint.variables),
        "slots": {slot: list(values) for slot, values in checkpoint.slots.items()},
        "rule": checkpoint.rule,
        "rule_step": checkpoint.rule_step,
        "config": checkpoint.config,
        **checkpoint.extra,
    }
    arrays: dict[str, Any] = {f"params/{n}": np.asarray(v) for n, v in checkpoint.variables.items()}
    for slot, values in checkpoint.slots.items():
        arrays.update({f"slots/{slot}/{n}": np.asarray(v) for n, v in values.items()})
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(path: Path | str) -> Checkpoint:
    """Read a checkpoint (or a directory's latest), checking its format."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = latest(path)
        if found is None:
            raise DataError(f"{path} holds no checkpoint (ckpt-<step>.npz); {WHAT_TO_RESUME}")
        path = found
    if not path.is_file():
        raise DataError(f"no checkpoint at {path}: no such file or folder; {WHAT_TO_RESUME}")
    try:
        with np.load(path, allow_pickle=False) as data:
            if META not in data.files:
                raise DataError(
                    f"{path} cannot be read as a psdk checkpoint (no {META} record: a params.npz holds the "
                    f"final weights only); {WHAT_TO_RESUME}"
                )
            meta = json.loads(data[META].tobytes())
            if meta.get("format") != FORMAT:
                raise DataError(f"{path} is not a psdk checkpoint; {WHAT_TO_RESUME}")
            variables = {n: np.array(data[f"params/{n}"]) for n in meta["variables"]}
            slots = {
                slot: {n: np.array(data[f"slots/{slot}/{n}"]) for n in names} for slot, names in meta["slots"].items()
            }
    except (OSError, ValueError, KeyError) as exc:
        reason = "not an .npz file" if "pickled" in str(exc) else str(exc)
        raise DataError(f"{path} cannot be read as a psdk checkpoint ({reason}); {WHAT_TO_RESUME}") from None
    known = {"format", "format_version", "global_step", "variables", "slots", "rule", "rule_step", "config"}
    return Checkpoint(
        global_step=int(meta["global_step"]),
        variables=variables,
        slots=slots,
        rule=dict(meta["rule"]),
        rule_step=int(meta["rule_step"]),
        config=str(meta.get("config", "")),
        extra={k: v for k, v in meta.items() if k not in known},
    )


def path_for(folder: Path, global_step: int) -> Path:
    return folder / f"ckpt-{global_step}.npz"


def latest(folder: Path) -> Path | None:
    """The checkpoint of the highest global step in ``folder``."""
    steps = [(int(m.group(1)), p) for p in folder.glob("ckpt-*.npz") if (m := _NAME.match(p.name))]
    return max(steps)[1] if steps else None


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` checkpoints of the highest global steps (``keep <= 0``: none)."""
    if keep <= 0:
        return []
    found = sorted((int(m.group(1)), p) for p in folder.glob("ckpt-*.npz") if (m := _NAME.match(p.name)))
    doomed = [p for _, p in found[:-keep]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def load_weights(path: Path | str) -> dict[str, np.ndarray]:
    """Variables from a checkpoint or from a run's ``params.npz``."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if META not in data.files:
                return {n: np.array(data[n]) for n in data.files}
    return load(path).variables
