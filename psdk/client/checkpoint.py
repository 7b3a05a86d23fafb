"""Checkpoints: a consistent cut of every ps shard, stored by variable name.

A checkpoint holds the variables, the update rule's slots and step, the
global step and the config that made the job, in one ``.npz`` file (no
pickle): ``params/<variable>``, ``slots/<slot>/<variable>`` and a JSON
``__meta__`` record. Storing by variable name, not by shard, lets a job resume
with another number of ps tasks, and canonical names and layouts let a
checkpoint written by torch workers resume on TensorFlow workers. The chief
collects the state over the transport (no shared file system is assumed) and
writes the file atomically: a reader sees the old file or the new one, and
the folder is fsynced so the rename survives a power cut. Embedding tables
go into the same file by name, chunk by chunk (``tables/<name>/<chunk>/...``,
see :mod:`psdk.client.tablefile`): the chief streams them in while the
shards are paused, and a load reads them only when they are restored.

Every checkpoint belongs to one run: it records the run's id (the launcher
gives each run one, kept across task restarts) and the fingerprint of the
config that made it, and its file name carries the id
(``ckpt-<run id>-<step>.npz``). Recovery and pruning take only their own
run's files, so a folder shared by several runs (a run folder used twice, a
common ``checkpoint.dir``) never restores, prunes or overwrites another
run's checkpoints; ``resume=`` takes another run's checkpoint when it names
the file, or a folder that holds one run's checkpoints only.

A checkpoint is trusted only once checked (:func:`load`): the zip's CRCs
catch flipped or missing bytes, and the contents must be plausible (finite
float values, slots shaped like their variables and usable by the update
rule, a global step the file's own config allows). Resume and recovery take
the newest checkpoint that passes (:func:`latest_valid`), saying which files
they skipped and why, and ``keep`` counts only those that pass.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from psdk.client.tablefile import CheckpointWriter, TableChunks, check_crcs, tables_problem
from psdk.errors import DataError, PsdkError
from psdk.plugins.registry import rule_from_json
from psdk.protocol.numerics import all_finite
from psdk.runtime.disks import WriteError, probe_folder

if TYPE_CHECKING:
    from psdk.config.options import CheckpointOptions

log = logging.getLogger(__name__)

FORMAT = "psdk-checkpoint"
FORMAT_VERSION = 1
META = "__meta__"
_NAME = re.compile(r"^ckpt-(?:(?P<run>.+)-)?(?P<step>\d+)\.npz$")
ANY_RUN = "*"
"""Stands for every run, where a function takes a run id."""
WHAT_TO_RESUME = (
    "resume= takes a checkpoint the chief wrote (outputs/<run>/checkpoints/ckpt-<run id>-<step>.npz) or a "
    "folder of one run's checkpoints (outputs/<run>/checkpoints: its newest valid one)"
)


def new_run_id() -> str:
    """A run id no other run has: when it started, and some random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


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
    run_id: str | None = None
    """The run that wrote it (``None``: written before runs had ids)."""
    fingerprint: str = ""
    """A digest of the config that made the job (:func:`psdk.config.build.fingerprint`), when it had one."""
    tables: TableChunks | None = None
    """The embedding tables by name, in the checkpoint's file, read chunk by chunk (never held whole)."""
    writer: CheckpointWriter | None = None
    """A file the chief's cut has begun (the table chunks streamed in while paused): :func:`save` finishes it."""

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


def check_folder(options: CheckpointOptions) -> None:
    """A ``checkpoint.dir`` that cannot be written is refused before training, not found out at its end."""
    if options.final or options.every_steps > 0 or options.every_seconds > 0:
        probe_folder(options.dir, "checkpoint.dir")


def save(checkpoint: Checkpoint, path: Path) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temporary file, fsync, rename).

    A write the file system refuses (full, read-only, forbidden) raises
    :class:`~psdk.runtime.disks.WriteError` naming the file and the fix, and leaves
    nothing behind: no partial file, and every older checkpoint as it was.
    """
    try:
        return _save(checkpoint, path)
    except OSError as exc:
        raise WriteError(path, exc, "checkpoint.dir") from None


def _save(checkpoint: Checkpoint, path: Path) -> Path:
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
        "run_id": checkpoint.run_id,
        "fingerprint": checkpoint.fingerprint,
        **checkpoint.extra,
    }
    arrays: dict[str, Any] = {f"params/{n}": np.asarray(v) for n, v in checkpoint.variables.items()}
    for slot, values in checkpoint.slots.items():
        arrays.update({f"slots/{slot}/{n}": np.asarray(v) for n, v in values.items()})
    writer = checkpoint.writer or CheckpointWriter(path.parent)
    try:
        if checkpoint.writer is None and checkpoint.tables is not None:
            copy_tables(checkpoint.tables, writer)
        if writer.tables:
            meta["tables"] = writer.tables
        arrays[META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        writer.finish(path, arrays)
        _fsync_folder(path.parent)
    finally:
        writer.discard()  # a write that failed leaves no partial file (a finished one has nothing left to discard)
    checkpoint.writer = None
    checkpoint.tables = TableChunks(path, writer.tables) if writer.tables else None
    _checked[path] = _stamp(path)  # written from memory this process holds: known good
    return path


def copy_tables(tables: TableChunks, writer: CheckpointWriter) -> None:
    """Another checkpoint's tables into ``writer``, one chunk at a time."""
    for name in tables.names:
        writer.table(tables.specs[name], tables.num_ps(name), tables.slots(name), int(tables.meta[name]["chunk_rows"]))
        for shard, record in enumerate(tables.shards(name)):
            writer.header(name, shard, record["config"], record["counters"])
            for offset, piece in tables.sketch(name, shard):
                writer.sketch(name, shard, offset, piece)
        for shard, chunk in tables.rows(name):
            writer.rows(name, shard, chunk)


def _fsync_folder(folder: Path) -> None:
    """The rename is durable only once the folder's entry is on disk too."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DAMAGE = (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile, zlib.error)
"""What reading a damaged or foreign file can raise: numpy, zipfile and json name no common base."""


def load(path: Path | str) -> Checkpoint:
    """Read and check a checkpoint (or the newest valid one of a folder); a refusal names the file and why."""
    path = Path(path).expanduser()
    if path.is_dir():
        runs = runs_in(path)
        if len(runs) > 1:
            listed = "; ".join(
                f"run {run or '(no id)'}: {len(files)} checkpoint(s), newest {files[0][1].name}"
                for run, files in sorted(runs.items(), key=lambda item: -item[1][0][0])
            )
            raise DataError(
                f"{path} holds the checkpoints of {len(runs)} runs ({listed}); name the file to resume from, "
                "e.g. resume=" + str(next(iter(runs.values()))[0][1])
            )
        found, skipped = latest_valid(path)
        if found is None:
            if skipped:
                raise DataError(f"{path} holds no valid checkpoint ({_skipped_text(skipped)}); {WHAT_TO_RESUME}")
            raise DataError(f"{path} holds no checkpoint (ckpt-<run id>-<step>.npz); {WHAT_TO_RESUME}")
        return found
    if not path.is_file():
        raise DataError(f"no checkpoint at {path}: no such file or folder; {WHAT_TO_RESUME}")
    problem, checkpoint = _load_file(path)
    if checkpoint is None:
        raise DataError(f"{problem}; {WHAT_TO_RESUME}")
    return checkpoint


ZIP_PREFIXES = (b"PK\x03\x04", b"PK\x05\x06")
"""How an .npz file (a zip archive) starts, as :func:`numpy.load` tells one (an empty archive: the second)."""


def _load_file(path: Path) -> tuple[str, Checkpoint | None]:
    """The checkpoint in file ``path``, or why there is none (naming the file): a folder's scan skips such a file."""
    try:
        with path.open("rb") as file:
            if file.read(4) not in ZIP_PREFIXES:
                return f"{path} cannot be read as a psdk checkpoint (not an .npz file)", None
        checkpoint = _read(path)
    except DataError as exc:
        return str(exc), None
    except DAMAGE as exc:
        return f"{path} cannot be read as a psdk checkpoint ({type(exc).__name__}: {exc})", None
    problem = implausible(checkpoint)
    if problem is not None:
        return f"{path} is damaged or not from a real job: {problem}", None
    return "", checkpoint


def _read(path: Path) -> Checkpoint:
    """Every array read in full, so the zip's CRC of each is checked."""
    with np.load(path, allow_pickle=False) as data:
        if META not in data.files:
            raise DataError(
                f"{path} cannot be read as a psdk checkpoint (no {META} record: a params.npz holds the "
                "final weights only)"
            )
        meta = json.loads(data[META].tobytes())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DataError(f"{path} is not a psdk checkpoint")
        variables = {str(n): np.array(data[f"params/{n}"]) for n in meta["variables"]}
        slots = {
            str(slot): {str(n): np.array(data[f"slots/{slot}/{n}"]) for n in names}
            for slot, names in dict(meta["slots"]).items()
        }
        tables = None
        if meta.get("tables"):  # the record, and every chunk's CRC; the values are checked when restored
            problem = tables_problem(meta["tables"], {f + ".npy" for f in data.files})
            if problem is not None:
                raise DataError(f"{path} is damaged or not from a real job: {problem}")
            check_crcs(path)
            tables = TableChunks(path, meta["tables"])
    known = {"format", "format_version", "global_step", "variables", "slots", "rule", "rule_step", "config"}
    known |= {"run_id", "fingerprint", "tables"}
    run_id = meta.get("run_id")
    return Checkpoint(
        global_step=_count(meta["global_step"], "global_step"),
        variables=variables,
        slots=slots,
        rule=dict(meta["rule"]),
        rule_step=_count(meta["rule_step"], "rule_step"),
        config=str(meta.get("config", "")),
        extra={k: v for k, v in meta.items() if k not in known},
        run_id=str(run_id) if run_id is not None else None,
        fingerprint=str(meta.get("fingerprint") or ""),
        tables=tables,
    )


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a count")
    return value


def implausible(checkpoint: Checkpoint) -> str | None:
    """What no job could have written into ``checkpoint`` (``None``: nothing)."""
    if not checkpoint.variables:
        return "no variables"
    for name, values in checkpoint.variables.items():
        if values.dtype.kind != "f":
            return f"variable {name} holds {values.dtype}, not floats"
        if not all_finite(values):
            return f"variable {name} holds NaN or Inf"
    for slot, by_name in checkpoint.slots.items():
        if set(by_name) != set(checkpoint.variables):
            return f"slot {slot} does not cover the same variables as the checkpoint"
        for name, values in by_name.items():
            if values.shape != checkpoint.variables[name].shape or values.dtype.kind != "f":
                return f"slot {slot} of {name} has shape {values.shape} ({values.dtype}), not its variable's"
    if checkpoint.rule:
        try:
            rule = rule_from_json(checkpoint.rule)
        except (PsdkError, ValueError, TypeError, KeyError) as exc:
            return f"its update rule {checkpoint.rule} is unusable ({exc})"
        flat = {
            slot: np.concatenate([v.ravel() for v in by_name.values()]) for slot, by_name in checkpoint.slots.items()
        }
        problem = rule.check_slots(flat)
        if problem is not None:
            return f"its {rule.name} slots are unusable: {problem}"
    steps = _configured_steps(checkpoint.config)
    if steps is not None and checkpoint.global_step > steps:
        return f"global step {checkpoint.global_step} is beyond the train.steps={steps} of the config it holds"
    return None


def _configured_steps(config: str) -> int | None:
    """``train.steps`` of the config a checkpoint carries (``None``: none, e.g. one written through the API)."""
    if not config:
        return None
    from omegaconf import OmegaConf

    try:
        steps = OmegaConf.select(OmegaConf.create(config), "train.steps")
    except Exception:  # text from a file: unreadable means no bound to check, not a crash
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def path_for(folder: Path, global_step: int, run_id: str | None = None) -> Path:
    return folder / (f"ckpt-{run_id}-{global_step}.npz" if run_id else f"ckpt-{global_step}.npz")


def step_of(path: Path) -> int | None:
    """The global step a checkpoint's file name carries (``None``: not a checkpoint's name)."""
    match = _NAME.match(path.name)
    return int(match.group("step")) if match else None


def _by_step(folder: Path, run_id: str | None = ANY_RUN) -> list[tuple[int, Path]]:
    """The checkpoint files of ``folder`` by global step, newest first: run ``run_id``'s, or every run's."""
    found = []
    for path in folder.glob("ckpt-*.npz"):
        match = _NAME.match(path.name)
        if match and (run_id == ANY_RUN or match.group("run") == run_id):
            found.append((int(match.group("step")), path))
    return sorted(found, reverse=True)


def runs_in(folder: Path) -> dict[str | None, list[tuple[int, Path]]]:
    """The checkpoint files of ``folder`` by the run that wrote them (``None``: files without a run id)."""
    runs: dict[str | None, list[tuple[int, Path]]] = {}
    for step, path in _by_step(folder):
        match = _NAME.match(path.name)
        assert match is not None
        runs.setdefault(match.group("run"), []).append((step, path))
    return runs


def latest(folder: Path, run_id: str | None = ANY_RUN) -> Path | None:
    """The checkpoint file of the highest global step in ``folder``, unchecked (see :func:`latest_valid`)."""
    found = _by_step(folder, run_id)
    return found[0][1] if found else None


def latest_valid(folder: Path, run_id: str | None = ANY_RUN) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint of ``folder`` (of run ``run_id``, or of any run) that loads and passes the checks,
    and the newer ones skipped (why).

    Each file skipped is logged: a resume or a recovery that falls back to an
    older checkpoint says so.
    """
    skipped: list[tuple[Path, str]] = []
    for _, path in _by_step(folder, run_id):
        why, checkpoint = _load_file(path)
        if checkpoint is None:
            skipped.append((path, why))
            log.warning("skipping checkpoint %s", why)
            continue
        _checked[path] = _stamp(path)
        if skipped:
            log.warning("using %s, the newest valid checkpoint in %s", path.name, folder)
        return checkpoint, skipped
    return None, skipped


def _skipped_text(skipped: list[tuple[Path, str]]) -> str:
    return "skipped: " + "; ".join(why for _, why in skipped)


_checked: dict[Path, tuple[int, int]] = {}
"""Files this process wrote or loaded and found valid, with their (size, mtime): not read again by prune."""


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def is_valid(path: Path) -> bool:
    """Whether ``path`` is a checkpoint that passes :func:`load`'s checks (remembered while unchanged)."""
    try:
        if _checked.get(path) == _stamp(path):
            return True
        load(path)
    except (DataError, OSError):
        return False
    _checked[path] = _stamp(path)
    return True


def prune(folder: Path, keep: int, run_id: str | None = ANY_RUN) -> list[Path]:
    """Delete every checkpoint of run ``run_id`` older than its ``keep`` newest valid ones (``keep <= 0``: none).

    A damaged file never counts toward ``keep``: it would leave fewer good
    checkpoints than asked for. Damaged files newer than those kept stay for
    a look; resume and recovery skip them. Other runs' files are never touched.
    """
    if keep <= 0:
        return []
    found = _by_step(folder, run_id)
    valid = 0
    for position, (_, path) in enumerate(found):
        if is_valid(path):
            valid += 1
            if valid == keep:
                doomed = [p for _, p in found[position + 1 :]]
                for old in doomed:
                    old.unlink(missing_ok=True)
                    _checked.pop(old, None)
                return doomed
    return []


def load_weights(path: Path | str) -> dict[str, np.ndarray]:
    """Variables from a checkpoint or from a run's ``params.npz``."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if META not in data.files:
                return {n: np.array(data[n]) for n in data.files}
    return load(path).variables
