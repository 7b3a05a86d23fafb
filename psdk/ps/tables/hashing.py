"""Counter-based hashing of int64 ids: index positions, initial values, sketch columns.

Everything here is a pure function of (key, id, column), computed for a whole
batch at once in uint64 numpy arithmetic (which wraps, as the mixer wants). That
is what makes a row's initial value independent of the order rows are touched
in, of which shard holds the row, and of a restore: no random generator state.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_COLUMN = np.uint64(0xD6E8FEB86659FD93)
INITIALIZERS = ("normal", "uniform", "zeros")


def mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (in place, and returned): every input bit reaches every output bit."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def table_key(seed: int, name: str = "") -> np.uint64:
    """One 64-bit key per (job seed, table name), so two tables of one job start differently."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def hash_ids(ids: np.ndarray, key: np.uint64 | int = 0) -> np.ndarray:
    """A uint64 hash of each id under ``key`` (ids int64, non-negative)."""
    with np.errstate(over="ignore"):
        return mix(ids.astype(np.uint64) * _GOLDEN + np.uint64(key))


def initial_rows(ids: np.ndarray, dim: int, key: np.uint64, initializer: str, scale: float) -> np.ndarray:
    """The initial rows of ``ids`` (float32, ``len(ids) x dim``), a function of (key, id, column) only.

    One 64-bit hash per pair of columns; its top and bottom 24 bits are two
    uniforms. ``normal``: N(0, scale²) by Box-Muller (both its outputs, in
    float32: seven times faster than float64 per value, and an initial value
    needs no more); ``uniform``: U(-scale, scale); ``zeros``: zeros.
    """
    if initializer == "zeros" or len(ids) == 0:
        return np.zeros((len(ids), dim), np.float32)
    pairs = (dim + 1) // 2
    with np.errstate(over="ignore"):
        bits = mix(hash_ids(ids, key)[:, None] + np.arange(1, pairs + 1, dtype=np.uint64)[None, :] * _COLUMN)
    unit = np.float32(2.0**-24)
    high = ((bits >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * unit  # in (0, 1)
    low = ((bits & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * unit
    out = np.empty((len(ids), 2 * pairs), np.float32)
    if initializer == "uniform":
        out[:, 0::2], out[:, 1::2] = high, low
        return ((out[:, :dim] * 2 - 1) * np.float32(scale)).astype(np.float32)
    radius = np.sqrt(np.float32(-2.0) * np.log(high)) * np.float32(scale)
    angle = low * np.float32(2.0 * np.pi)
    out[:, 0::2], out[:, 1::2] = radius * np.cos(angle), radius * np.sin(angle)
    return np.ascontiguousarray(out[:, :dim])


class CountMinSketch:
    """Approximate counts of ids in ``depth x width`` uint32 counters: never under, sometimes over.

    Each id adds to one counter per row (its own hash per row); its estimate is
    the smallest of them. Colliding ids only ever add, so the estimate is at
    least the true count. Fixed size, whatever the number of distinct ids: the
    tail ids that admission keeps out of the index never cost a row.
    """

    def __init__(self, depth: int = 4, width: int = 1 << 18) -> None:
        if depth < 1 or width < 1 or width & (width - 1):
            raise ValueError(f"a sketch needs depth >= 1 and a power-of-two width, not {depth} x {width}")
        self.counts = np.zeros((depth, width), np.uint32)
        self._keys = [np.uint64((row + 1) * int(_COLUMN) % 2**64) for row in range(depth)]

    def _columns(self, ids: np.ndarray) -> list[np.ndarray]:
        mask = np.uint64(self.counts.shape[1] - 1)
        return [(hash_ids(ids, key) & mask).astype(np.intp) for key in self._keys]

    def add(self, ids: np.ndarray, times: np.ndarray) -> None:
        """Count each of ``ids`` ``times`` more times (saturating at uint32's top)."""
        top = np.iinfo(np.uint32).max
        for row, columns in zip(self.counts, self._columns(ids), strict=True):
            before = row[columns]
            np.add.at(row, columns, np.minimum(times, top).astype(np.uint32))
            # np.add.at wraps on overflow: put back the saturated value where it did.
            wrapped = row[columns] < before
            row[columns[wrapped]] = top

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Each id's count, at least its true one."""
        found = np.full(len(ids), np.iinfo(np.uint32).max, np.uint32)
        for row, columns in zip(self.counts, self._columns(ids), strict=True):
            np.minimum(found, row[columns], out=found)
        return found
