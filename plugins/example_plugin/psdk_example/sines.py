"""The ``sines`` workload: regress a noisy sum of sines it generates itself, no download, no images.

A second workload beside psdk's MNIST, written on the public hooks only
(:mod:`psdk_example.plugin` registers it). From ``x`` in R^d (standard
normal) it predicts::

    y = c + sum_k a_k sin(w_k . x + b_k) + noise

with ``workload.sines`` terms whose ``w_k``, ``b_k`` and ``a_k`` are drawn
from ``workload.seed`` (``a`` and ``c`` scaled so that the noiseless ``y``
has mean 0 and variance 1). So predicting 0 scores a mean squared error of
about ``1 + noise^2``, a linear fit about 0.68 (the defaults), and a network
that learns the function the noise's variance, ``noise^2`` (0.01).

This module is the workload's framework-free part: its options, its data,
each worker's shard, the score and the check of the model. Its trainers,
one per framework, are in ``regression_<framework>.py`` and its model spec
in :mod:`psdk_example.regressor`. The batch convention every trainer follows:
``Batch({"x": float32 [n, d]}, targets=float32 [n])``; the loss is the mean
squared error; predictions are float32 ``[n]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from psdk import ArrayShard, Batch, MetricSpec, ShardRequest, WorkloadOptions
from psdk.errors import ConfigError
from psdk_example.regressor import RegressorSpec

INPUTS = "x"
"""The one input of every batch: float32 [n, input_dim]."""

METRICS = (
    MetricSpec("loss", higher_is_better=False, held_out=False),
    MetricSpec("mse", label="MSE", higher_is_better=False, primary=True, format=".5f", target=0.03),
    MetricSpec("r2", label="R²", higher_is_better=True, format=".4f"),
)
"""The training batch's loss (its mean squared error), and on held-out data the mean squared error
(primary: a target of 0.03 is three times the default noise's variance) and the coefficient of
determination, 1 - mse / var(y)."""


@dataclass(frozen=True)
class SinesOptions(WorkloadOptions):
    """The workload's ``workload.*`` keys and their defaults: the data, fixed by ``seed``."""

    examples: int = 50_000
    """Training examples of the whole job, split between the workers."""
    input_dim: int = 8
    sines: int = 4
    """Terms in the sum."""
    frequency: float = 2.0
    """Each ``w_k . x`` is normal with this standard deviation: higher is wigglier, harder."""
    noise: float = 0.1
    """Standard deviation of the noise added to each target (training, validation and test alike)."""
    seed: int = 0
    """The data's seed (the function and the three sets), apart from the job's ``seed`` (the model's)."""
    validation_size: int = 5_000
    test_size: int = 10_000

    def __post_init__(self) -> None:
        self.check_whole(examples=1, input_dim=1, sines=1, validation_size=1, test_size=1, seed=0)
        for key in ("frequency", "noise"):
            self.check_number(key, lambda v: v >= 0, ">= 0")


OPTIONS = SinesOptions().as_dict()
"""The defaults, as the workload record declares them (``workload.<key>=...`` overrides each)."""


@dataclass(frozen=True)
class SineSum:
    """The function the workload learns: ``y = offset + sum_k amplitude_k sin(weights_k . x + phase_k)``."""

    weights: np.ndarray
    phases: np.ndarray
    amplitudes: np.ndarray
    offset: float

    @classmethod
    def draw(cls, options: SinesOptions, rng: np.random.Generator) -> SineSum:
        """Random terms, then ``amplitudes`` and ``offset`` scaled so ``y`` has mean 0, variance 1 on 4096 draws."""
        d, k = options.input_dim, options.sines
        weights = rng.standard_normal((k, d)) * options.frequency / math.sqrt(d)
        phases = rng.uniform(0.0, 2.0 * math.pi, k)
        raw = cls(weights, phases, rng.standard_normal(k), 0.0)
        values = raw(rng.standard_normal((4096, d)))
        scale = 1.0 / max(float(values.std()), 1e-12)
        return cls(weights, phases, raw.amplitudes * scale, -float(values.mean()) * scale)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.sin(x @ self.weights.T + self.phases) @ self.amplitudes + self.offset


def generate(options: SinesOptions) -> tuple[Batch, Batch, Batch]:
    """The job's training, validation and test sets, the same in every worker for the same options.

    The function and each set come from their own stream of ``options.seed``,
    so a bigger training set leaves the function and the test set as they were.
    """
    function_rng, train_rng, validation_rng, test_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(options.seed).spawn(4)
    )
    function = SineSum.draw(options, function_rng)

    def examples(rng: np.random.Generator, n: int) -> Batch:
        x = rng.standard_normal((n, options.input_dim))
        y = function(x) + options.noise * rng.standard_normal(n)
        return Batch({INPUTS: x.astype(np.float32)}, y.astype(np.float32))

    return (
        examples(train_rng, options.examples),
        examples(validation_rng, options.validation_size),
        examples(test_rng, options.test_size),
    )


def worker_part(train: Batch, task: int, num_workers: int) -> Batch:
    """Worker ``task``'s contiguous slice of the training set: the slices of all workers partition it."""
    bounds = np.linspace(0, len(train), num_workers + 1).astype(int)
    return train.take(int(bounds[task]), int(bounds[task + 1]))


def options_of(cfg: Any) -> SinesOptions:
    """The options of a job's config (its ``workload`` node)."""
    return SinesOptions.of(cfg.workload)


def check_model(model: Any, options: SinesOptions) -> None:
    """Refuse a model (a spec, or the config's ``model`` node) that does not take ``input_dim`` inputs to one output."""
    name, input_dim, outputs = (getattr(model, key, None) for key in ("name", "input_dim", "outputs"))
    if outputs is None:
        fix = "" if options.input_dim == RegressorSpec.input_dim else f" model.input_dim={options.input_dim}"
        raise ConfigError(
            "model",
            f"model={name} is no regression model (it has no model.outputs); workload=sines predicts one "
            f"number from {options.input_dim} inputs: use model=regressor{fix}",
        )
    if int(outputs) != 1:
        raise ConfigError("model.outputs", f"is {outputs}, but workload=sines predicts one number: use 1")
    if input_dim is None or int(input_dim) != options.input_dim:
        raise ConfigError(
            "model.input_dim",
            f"is {input_dim}, but workload.input_dim={options.input_dim}: give "
            f"model.input_dim={options.input_dim} (or workload.input_dim={input_dim})",
        )


# ----------------------------------------------------------------------------- the record's entries
def shard(request: ShardRequest) -> ArrayShard:
    """This worker's slice of the training set, and the validation and test sets every worker shares."""
    options = SinesOptions.of(request.options)
    check_model(request.model, options)  # a worker started by hand was not checked by a launcher
    if options.examples < request.num_workers:
        raise ConfigError(
            "workload.examples", f"is {options.examples}, fewer than the {request.num_workers} workers: each needs some"
        )
    train, validation, test = generate(options)
    part = worker_part(train, request.task, request.num_workers)
    return ArrayShard(part, test, validation=validation, train_size=len(train))


def score(predictions: np.ndarray, batch: Batch) -> dict[str, float]:
    """Mean squared error and R² of ``predictions`` (any framework's, float [n] or [n, 1]) for ``batch``."""
    predicted = np.asarray(predictions, np.float64).reshape(len(batch))
    targets = np.asarray(batch.targets, np.float64)
    mse = float(np.mean((predicted - targets) ** 2)) if len(batch) else math.nan
    variance = float(np.var(targets)) if len(batch) else math.nan
    return {"mse": mse, "r2": 1.0 - mse / variance if variance > 0 else math.nan}


def train_size(cfg: Any) -> int:
    """The training examples of the whole job: what ``train.epochs`` counts passes over."""
    return options_of(cfg).examples


def check(cfg: Any) -> None:
    """Refuse, before any task starts, options no data can come from and a model that does not fit the data."""
    check_model(cfg.model, options_of(cfg))
