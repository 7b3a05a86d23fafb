"""TensorBoard event files, written without TensorFlow, torch or protobuf.

An event file is a TFRecord stream of ``Event`` protocol buffers. A scalar
needs only a handful of fields (wall time, step, and a summary holding
``tag``/``simple_value`` pairs), so they are encoded here by hand: the core
gains no dependency, and a worker on any backend can write one. TensorBoard
(``tensorboard --logdir outputs/<run>/tensorboard``) reads them as it reads
``tf.summary`` files. tests/test_report.py decodes what is written here
independently (the record framing with its masked CRC-32C, and the Event,
Summary and Value fields by number), as TensorBoard is no dependency.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from psdk.plugins.metrics import MetricSpec
from psdk.report.declared import workload_metrics
from psdk.runtime.disks import naming


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecord framing."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked(crc32c(length))) + data + struct.pack("<I", _masked(crc32c(data)))


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 fields encode negatives as ten-byte two's complement
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, file_version: str | None = None, summary: bytes | None = None) -> bytes:
    """An ``Event``: wall_time (1, double), step (2, int64), file_version (3) or summary (5)."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if summary is not None:
        out += _bytes_field(5, summary)
    return out


def scalar_summary(values: Mapping[str, float]) -> bytes:
    """A ``Summary`` of ``Value``s: tag (1, string) and simple_value (2, float)."""
    out = b""
    for tag, value in values.items():
        entry = _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", float(value))
        out += _bytes_field(1, entry)
    return out


class EventWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``folder``."""

    def __init__(self, folder: Path | str):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.psdk"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write(record(event(now, file_version="brain.Event:2")))

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        if values and self._fd >= 0:
            data = event(time.time() if wall_time is None else wall_time, step, summary=scalar_summary(values))
            self._write(record(data))

    def _write(self, data: bytes) -> None:
        try:
            os.write(self._fd, data)
        except OSError as exc:  # a full disk: the error names this file, not a descriptor
            raise naming(self.path, exc) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TensorBoardSink:
    """A worker's ``metrics.jsonl`` records as TensorBoard scalars against the global step.

    One tag for each metric the workload declares (``metrics``; None: the
    default workload's): its name, ``validation_<name>`` for one measured on
    held-out data (MNIST: ``loss``, ``validation_accuracy``).
    """

    def __init__(self, folder: Path | str, metrics: Sequence[MetricSpec] | None = None):
        self.writer = EventWriter(folder)
        specs = workload_metrics(None) if metrics is None else metrics
        self.TAGS = {s.name: f"validation_{s.name}" if s.held_out else s.name for s in specs}
        self.TAGS["steps_per_s"] = "local_steps_per_s"

    def write(self, point: Mapping[str, Any]) -> None:
        values = {tag: point[key] for key, tag in self.TAGS.items() if point.get(key) is not None}
        self.writer.scalars(int(point["global_step"]), values, point.get("time"))

    def close(self) -> None:
        self.writer.close()
