"""Embedding tables inside a checkpoint file: written chunk by chunk, read lazily, checked as they are read.

A checkpoint is a zip of ``.npy`` entries (what ``np.savez`` writes, so
``np.load`` opens it). :class:`CheckpointWriter` writes it entry by entry
into a temporary file beside the target: the chief streams each table chunk
it reads from a shard straight into it (``tables/<name>/<chunk>/ids.npy``,
``rows.npy``, ``last_used.npy``, ``slot.<slot>.npy``, or ``sketch.npy``), so
it never holds more than one chunk per shard; the dense arrays and the
``__meta__`` record follow, and the file is renamed into place. The meta's
``tables`` record says, per table, its spec, the number of ps it was saved
from, the slots, and per saved shard its header (``config``, ``counters``)
and which chunks hold its rows and its sketch pieces (at which offset).

:class:`TableChunks` reads them back one chunk at a time: loading a
checkpoint reads the meta, checks every chunk it names is in the zip, and
streams every table entry through the zip's CRC check in blocks
(:func:`check_crcs`: the file's size in reads, a block in memory), so a
damaged table makes the checkpoint invalid before resume or recovery picks
it; each chunk's values are checked when it is read for a restore (int64
non-negative ids, float32 finite rows and slots of the table's width).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psdk.errors import DataError
from psdk.protocol.numerics import all_finite
from psdk.protocol.tables import TableSpec
from psdk.runtime.access import file_mode

SLOT = "slot."
DAMAGE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)
"""What reading a damaged chunk can raise (a CRC mismatch is a ``BadZipFile``)."""
ROW_KEYS = ("ids", "rows", "last_used")


class CheckpointWriter:
    """A checkpoint file being written entry by entry into a temporary file; :meth:`finish` renames it into place."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ckpt-", suffix=".tmp")
        self.tmp = Path(tmp)
        os.fchmod(fd, file_mode())  # mkstemp's 0600, widened only where file_access says so
        self._file = os.fdopen(fd, "wb")
        self._zip: zipfile.ZipFile | None = zipfile.ZipFile(self._file, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.tables: dict[str, dict[str, Any]] = {}
        """The meta's ``tables`` record, as far as written."""
        self._chunks: dict[str, int] = {}
        self._finished = False

    def array(self, name: str, value: np.ndarray) -> None:
        """One ``.npy`` entry, written through (the zip holds no copy)."""
        assert self._zip is not None, "the checkpoint file is closed"
        with self._zip.open(name + ".npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, np.asarray(value), allow_pickle=False)

    # ------------------------------------------------------------ tables
    def table(self, spec: TableSpec, num_ps: int, slots: list[str], chunk_rows: int) -> None:
        shards: list[dict[str, Any]] = [
            {"config": None, "counters": None, "rows": [], "sketch": []} for _ in range(num_ps)
        ]
        record = {"spec": spec.to_json(), "num_ps": num_ps, "slots": slots, "chunk_rows": chunk_rows, "shards": shards}
        self.tables[spec.name] = record
        self._chunks[spec.name] = 0

    def header(self, name: str, shard: int, config: list[int], counters: list[int]) -> None:
        self.tables[name]["shards"][shard].update(config=list(config), counters=list(counters))

    def _next_chunk(self, name: str) -> int:
        number = self._chunks[name]
        self._chunks[name] = number + 1
        return number

    def rows(self, name: str, shard: int, chunk: Mapping[str, np.ndarray]) -> None:
        """One chunk of rows of one saved shard: ``ids``, ``rows``, ``last_used``, ``slot.<name>``."""
        number = self._next_chunk(name)
        for key, value in chunk.items():
            self.array(f"tables/{name}/{number}/{key}", value)
        self.tables[name]["shards"][shard]["rows"].append(number)

    def sketch(self, name: str, shard: int, offset: int, piece: np.ndarray) -> None:
        number = self._next_chunk(name)
        self.array(f"tables/{name}/{number}/sketch", piece)
        self.tables[name]["shards"][shard]["sketch"].append([number, offset])

    # ------------------------------------------------------------ the end
    def finish(self, path: Path, arrays: Mapping[str, np.ndarray]) -> Path:
        """Write ``arrays`` (the dense state and ``__meta__``), make the file durable and rename it to ``path``."""
        for name, value in arrays.items():
            self.array(name, value)
        assert self._zip is not None
        self._zip.close()
        self._zip = None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        source = self.tmp
        if source.parent.resolve() != path.parent.resolve():  # spooled elsewhere: copied beside the target first
            fd, moved = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            shutil.copyfile(source, moved)
            with open(moved, "rb+") as copy:
                os.fsync(copy.fileno())
            os.unlink(source)
            self.tmp = source = Path(moved)
        os.replace(source, path)
        self._finished = True
        return path

    def discard(self) -> None:
        """Leave nothing behind (a cut that failed, a write the disk refused); nothing to do once finished."""
        if self._finished:
            return
        with contextlib.suppress(Exception):
            if self._zip is not None:
                self._zip.close()
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class TableChunks:
    """The tables of a checkpoint file, read one chunk at a time (never whole)."""

    def __init__(self, path: Path, tables: Mapping[str, Any]) -> None:
        self.path = path
        self.meta = dict(tables)
        self.specs = {name: TableSpec.from_json(record["spec"]) for name, record in self.meta.items()}

    @property
    def names(self) -> list[str]:
        return list(self.meta)

    def num_ps(self, name: str) -> int:
        return int(self.meta[name]["num_ps"])

    def slots(self, name: str) -> list[str]:
        return [str(slot) for slot in self.meta[name]["slots"]]

    def shards(self, name: str) -> list[dict[str, Any]]:
        """Per saved shard: ``config``, ``counters``, ``rows`` (chunk numbers), ``sketch`` ([chunk, offset])."""
        return list(self.meta[name]["shards"])

    def rows(self, name: str) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(saved shard, chunk) for every row chunk of table ``name``, each checked as it is read."""
        spec, slots = self.specs[name], self.slots(name)
        with np.load(self.path, allow_pickle=False) as data:
            for shard, record in enumerate(self.shards(name)):
                for number in record["rows"]:
                    where = f"tables/{name}/{number}"
                    try:
                        chunk = {
                            key: np.array(data[f"{where}/{key}"]) for key in (*ROW_KEYS, *(SLOT + s for s in slots))
                        }
                    except DAMAGE as exc:
                        raise DataError(
                            f"{self.path}: chunk {where} cannot be read ({type(exc).__name__}: {exc})"
                        ) from None
                    problem = row_chunk_problem(chunk, spec.dim, slots)
                    if problem is not None:
                        raise DataError(f"{self.path}: chunk {where} is damaged or not from a real job: {problem}")
                    yield shard, chunk

    def sketch(self, name: str, shard: int) -> Iterator[tuple[int, np.ndarray]]:
        """(offset, counters) of each sketch piece saved shard ``shard`` held."""
        with np.load(self.path, allow_pickle=False) as data:
            for number, offset in self.shards(name)[shard]["sketch"]:
                where = f"tables/{name}/{number}/sketch"
                try:
                    piece = np.array(data[where])
                except DAMAGE as exc:
                    raise DataError(
                        f"{self.path}: chunk {where} cannot be read ({type(exc).__name__}: {exc})"
                    ) from None
                if piece.dtype != np.uint32 or piece.ndim != 1:
                    raise DataError(f"{self.path}: chunk {where} is {piece.dtype}{list(piece.shape)}, not uint32")
                yield int(offset), piece


CRC_BLOCK = 1 << 20


def check_crcs(path: Path, prefix: str = "tables/") -> None:
    """Read every entry under ``prefix`` to its end in blocks: a damaged one raises ``BadZipFile`` (bad CRC)."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.startswith(prefix):
                with archive.open(info) as entry:
                    while entry.read(CRC_BLOCK):
                        pass


def row_chunk_problem(chunk: Mapping[str, np.ndarray], dim: int, slots: list[str]) -> str | None:
    """What no table could have saved in a row chunk (``None``: nothing)."""
    ids = chunk["ids"]
    if ids.dtype != np.int64 or ids.ndim != 1:
        return f"ids are {ids.dtype}{list(ids.shape)}, not 1-D int64"
    if len(ids) and int(ids.min()) < 0:
        return "negative ids"
    for key in ("rows", *(SLOT + s for s in slots)):
        values = chunk[key]
        if values.dtype != np.float32 or values.shape != (len(ids), dim):
            return f"{key} is {values.dtype}{list(values.shape)}, not float32{[len(ids), dim]}"
        if not all_finite(values):
            return f"{key} holds NaN or Inf"
    stamps = chunk["last_used"]
    if stamps.dtype != np.uint32 or stamps.shape != (len(ids),):
        return f"last_used is {stamps.dtype}{list(stamps.shape)}, not uint32[{len(ids)}]"
    return None


def tables_problem(tables: Any, files: set[str]) -> str | None:
    """What is wrong with a meta's ``tables`` record (``None``: nothing), checking only that the entries exist."""
    if not isinstance(tables, dict):
        return "its tables record is not an object"
    for name, record in tables.items():
        try:
            spec = TableSpec.from_json(record["spec"])
            shards, slots = record["shards"], [SLOT + str(s) for s in record["slots"]]
            if spec.name != name or not isinstance(shards, list) or len(shards) != int(record["num_ps"]):
                return f"table {name!r} has a spec or shard list that does not fit it"
            for shard in shards:
                config, counters = shard["config"], shard["counters"]
                if not (isinstance(config, list) and len(config) == 3 and config[0] == spec.dim):
                    return f"table {name!r} has a shard config {config} that is not of dim {spec.dim}"
                if not (
                    isinstance(counters, list) and len(counters) == 4 and all(isinstance(c, int) for c in counters)
                ):
                    return f"table {name!r} has shard counters {counters}"
                for number in shard["rows"]:
                    missing = [k for k in (*ROW_KEYS, *slots) if f"tables/{name}/{number}/{k}.npy" not in files]
                    if missing:
                        return f"table {name!r} misses chunk {number}'s {missing}"
                for number, _offset in shard["sketch"]:
                    if f"tables/{name}/{number}/sketch.npy" not in files:
                        return f"table {name!r} misses sketch chunk {number}"
        except (KeyError, TypeError, ValueError) as exc:
            return f"table {name!r} has a damaged record ({type(exc).__name__}: {exc})"
        except Exception as exc:  # a ProtocolError from the spec
            return f"table {name!r} has a bad spec ({exc})"
    return None
