"""The CTR workload's examples: a synthetic Criteo-shaped click log from a seed, or Criteo TSV files.

Synthetic: 26 categorical fields whose values are Zipf-distributed ranks over
per-field vocabularies (10 to ``vocab`` values, spread geometrically as
Criteo's are), 13 dense features (log1p of exponential counts, as DLRM
normalises Criteo's), and a click drawn from a hidden logistic model: a
weight per (field, value) taken from a hash of (seed, field, value), plus a
dense weight vector. Nothing is materialised: each batch is generated when
cut, from (seed, stream, worker, batch number), in vectorised numpy. The
hidden model's own AUC on the test set is the best any model can score
(:func:`best_auc`).

Either way, each field's raw value is hashed with its own salt into
``[0, capacity)``: the ids of the one shared table ``emb``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psdk.plugins.batches import Batch, JaggedIds

FIELDS = 26
"""Categorical fields, as Criteo's."""
DENSE = 13
"""Dense (integer count) features, as Criteo's."""
TABLE = "emb"
"""The one table every field's ids index."""
DENSE_INPUT, CAT_INPUT = "dense", "cat"
"""A batch's inputs: float32 [B, :data:`DENSE`] features and int64 [B, :data:`FIELDS`] ids into :data:`TABLE`."""
TRAIN, VALIDATION, TEST = 1, 2, 3
"""Seed streams: each set is its own, so the training data never overlaps the held-out sets."""

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64: a cheap, well-spread hash (wraps modulo 2**64 on purpose)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def field_salts(seed: int = 0) -> np.ndarray:
    """Each field's salt (uint64 [26]): the same raw value in two fields lands on unrelated ids."""
    return mix64(np.arange(1, FIELDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed))


def hash_ids(raw: np.ndarray, capacity: int) -> np.ndarray:
    """Raw values uint64 [n, 26] -> ids int64 [n, 26] in ``[0, capacity)``, each field with its salt."""
    with np.errstate(over="ignore"):
        mixed = mix64(raw.astype(np.uint64) ^ field_salts())
    return (mixed % np.uint64(capacity)).astype(np.int64)


def make_batch(dense: np.ndarray, cat: np.ndarray, labels: np.ndarray) -> Batch:
    """The contract's batch: ``dense`` float32 [B, 13], ``cat`` int64 [B, 26], ids of ``emb``, labels float32."""
    n = len(labels)
    offsets = np.arange(0, FIELDS * n + 1, FIELDS, dtype=np.int64)
    ids = {TABLE: JaggedIds(values=cat.reshape(-1), offsets=offsets)}
    return Batch({DENSE_INPUT: dense.astype(np.float32), CAT_INPUT: cat}, labels.astype(np.float32), ids)


def own_lookups(batch: Batch, cat: np.ndarray) -> JaggedIds | None:
    """The batch's own ids of :data:`TABLE` when they are its ``cat`` input's (as :func:`make_batch` makes every
    batch): a trainer takes their distinct ids and positions from it, sorted once per batch. ``None`` otherwise."""
    lookups = batch.ids.get(TABLE)
    return lookups if lookups is not None and np.array_equal(lookups.values, cat.reshape(-1)) else None


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (ties count a half), by ranks: the probability a click outscores a non-click."""
    labels = np.asarray(labels) > 0.5
    positives, n = int(labels.sum()), len(labels)
    if positives == 0 or positives == n:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(n, np.float64)
    sorted_scores = np.asarray(scores)[order]
    # average ranks over ties
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], n]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * (n - positives)))


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``sigmoid(logits)`` against 0/1 labels, computed stably from the logits."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))) if len(y) else math.nan


@dataclass(frozen=True)
class ClickLog:
    """The synthetic log's shape and its hidden model, all fixed by ``seed``."""

    seed: int = 0
    vocab: int = 1_000_000
    """The largest field's vocabulary; the others spread geometrically down to 10 values."""
    zipf: float = 1.1
    """The exponent of each field's Zipf law: the value of rank r is drawn with probability ~ r**-zipf."""
    capacity: int = 1_000_000
    """The table's ids: each field's values are hashed into [0, capacity)."""
    id_scale: float = 0.5
    """The hidden per-value weights are uniform in [-id_scale, id_scale]."""
    bias: float = -1.5
    """The hidden model's intercept: about a quarter of the examples are clicks."""

    def vocab_sizes(self) -> np.ndarray:
        """Each field's vocabulary (int64 [26]), from 10 to ``vocab``."""
        return np.geomspace(10, max(self.vocab, 10), FIELDS).astype(np.int64)

    def dense_weights(self) -> np.ndarray:
        return np.random.default_rng([self.seed, 0]).standard_normal(DENSE) * (0.6 / math.sqrt(DENSE))

    def ranks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Zipf ranks uint64 [n, 26] in [0, vocab_f), by inverting a continuous power law's CDF (vectorised)."""
        sizes = self.vocab_sizes().astype(np.float64) + 1.0
        u = rng.random((n, FIELDS))
        s = self.zipf
        if abs(s - 1.0) < 1e-9:
            x = np.power(sizes, u)
        else:
            x = np.power(1.0 + u * (np.power(sizes, 1.0 - s) - 1.0), 1.0 / (1.0 - s))
        return np.minimum(np.floor(x) - 1.0, sizes - 2.0).astype(np.uint64)

    def id_weights(self, ranks: np.ndarray) -> np.ndarray:
        """The hidden weight of each (field, value), from a hash of (seed, field, value): float64 [n, 26]."""
        with np.errstate(over="ignore"):
            key = mix64(ranks * np.uint64(0x9E3779B97F4A7C15) ^ field_salts(self.seed + 7919))
        u = (key >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        return (2.0 * u - 1.0) * self.id_scale

    def examples(self, rng: np.random.Generator, n: int) -> tuple[Batch, np.ndarray]:
        """``n`` examples and their hidden logits (float64 [n]): what the best model would predict."""
        ranks = self.ranks(rng, n)
        scales = np.geomspace(1.0, 1000.0, DENSE)
        dense = np.log1p(np.floor(rng.exponential(scales, (n, DENSE))))
        logits = self.bias + self.id_weights(ranks).sum(axis=1) + (dense - np.log1p(scales)) @ self.dense_weights()
        clicks = rng.random(n) < 1.0 / (1.0 + np.exp(-logits))
        return make_batch(dense, hash_ids(ranks, self.capacity), clicks), logits

    def batch(self, stream: int, worker_seed: int, number: int, size: int) -> Batch:
        """Training batch ``number`` of a worker: the same for the same (seed, stream, worker_seed, number)."""
        return self.examples(np.random.default_rng([self.seed, stream, worker_seed, number]), size)[0]

    def held_out(self, stream: int, n: int) -> tuple[Batch, np.ndarray]:
        """A fixed held-out set of ``n`` examples (its own stream) and its hidden logits."""
        return self.examples(np.random.default_rng([self.seed, stream]), n)


def best_auc(log: ClickLog, n: int) -> float:
    """The hidden model's AUC on the test set of ``n`` examples: the best any model can score there."""
    batch, logits = log.held_out(TEST, n)
    return auc(logits, batch.targets)


# ----------------------------------------------------------------------------- Criteo TSV files
def parse_tsv(lines: list[bytes], capacity: int) -> Batch:
    """Criteo lines (``label``, 13 integers, 26 hex values; tab-separated, any may be empty) -> a batch.

    An empty integer is 0 (log1p(0) = 0), a negative one counts as 0 (Criteo has a few -1s); an empty
    categorical value is hashed as the value 0 of its field, as DLRM's preprocessing maps it.
    """
    n = len(lines)
    labels = np.zeros(n, np.float32)
    counts = np.zeros((n, DENSE), np.float64)
    raw = np.zeros((n, FIELDS), np.uint64)
    for row, line in enumerate(lines):
        parts = line.rstrip(b"\r\n").split(b"\t")
        if len(parts) != 1 + DENSE + FIELDS:
            raise ValueError(f"a Criteo line has {1 + DENSE + FIELDS} tab-separated fields, this one {len(parts)}")
        labels[row] = float(parts[0] or 0)
        for j, value in enumerate(parts[1 : 1 + DENSE]):
            counts[row, j] = max(int(value), 0) if value else 0
        for f, value in enumerate(parts[1 + DENSE :]):
            raw[row, f] = int(value, 16) + 1 if value else 0
    return make_batch(np.log1p(counts), hash_ids(raw, capacity), labels)


def tsv_files(folder: str | Path) -> list[Path]:
    """The folder's Criteo files (``*.tsv``, ``*.txt``, ``day_*``), sorted; an error names a folder without any."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}")
    found = sorted(
        p for p in root.iterdir() if p.is_file() and (p.suffix in (".tsv", ".txt") or p.name.startswith("day_"))
    )
    if not found:
        raise FileNotFoundError(f"no Criteo TSV files (*.tsv, *.txt, day_*) in {root}")
    return found


def read_tsv(files: list[Path], capacity: int, chunk: int, keep: Callable[[int], bool]) -> Iterator[Batch]:
    """The files' examples, ``chunk`` at a time, streamed (never loaded whole): line ``i`` (counted over
    all files, blank lines included) when ``keep(i)``."""
    lines: list[bytes] = []
    index = 0
    for path in files:
        with open(path, "rb") as handle:
            for line in handle:
                if keep(index) and line.strip():
                    lines.append(line)
                    if len(lines) == chunk:
                        yield parse_tsv(lines, capacity)
                        lines = []
                index += 1
    if lines:
        yield parse_tsv(lines, capacity)
