"""Model specs every backend builds the same way, and their framework-neutral initial weights.

A backend turns a :class:`ModelSpec` into its own framework's model, but the
initial weights come from :func:`init_weights` in numpy, so the same seed
starts a torch worker, a TensorFlow worker and the numpy reference from the
same point. How the kernels are drawn is the model's ``init`` (``model.init=normal
model.init_stddev=1.0`` in the config, as TensorFlow 1.x's ``tf.random_normal``);
the chief's initial weights are the ps's, so backends never draw their own.
Variable names and layouts are canonical: ``<layer>/kernel`` of
shape (in, out) and ``<layer>/bias`` of shape (out,).

Plugins add models (:class:`~psdk.plugins.hookspecs.ModelRecord`): a spec of the
same shape as :class:`ModelSpec` (``name``, ``input_dim``, ``num_classes``,
``variables()``, ``init_weights(seed)``) and, per backend, a builder;
:func:`build_model` picks the builder for a backend, or the backend's own
dense stack for :class:`ModelSpec`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from psdk.errors import ConfigError, PluginError, PsdkError, closest

log = logging.getLogger(__name__)

# How the kernels are drawn (``model.init``): Glorot-uniform is the default, and what psdk always drew before.
INITIALIZERS = ("glorot_uniform", "normal", "truncated_normal", "zeros")
WITH_STDDEV = ("normal", "truncated_normal")  # read model.init_stddev (1.0 unless given)
# Other frameworks' names for them, suggested when given.
INIT_ALIASES = {
    "glorot": "glorot_uniform",
    "xavier": "glorot_uniform",
    "xavier_uniform": "glorot_uniform",
    "random_normal": "normal",
    "gaussian": "normal",
    "normal_": "normal",
    "trunc_normal": "truncated_normal",
    "trunc_normal_": "truncated_normal",
    "zero": "zeros",
    "zeros_": "zeros",
}


@dataclass(frozen=True)
class ModelSpec:
    """A stack of dense layers (ReLU between them) ending in softmax logits.

    ``hidden=()`` is softmax regression (784-10); ``hidden=(100,)`` the MLP
    of the classic distributed MNIST examples (784-100-10).
    """

    name: str = "mlp"
    hidden: Sequence[int] = field(default=(100,))
    input_dim: int = 784
    num_classes: int = 10
    init: str = "glorot_uniform"
    init_stddev: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        if any(h < 1 for h in self.hidden) or self.input_dim < 1 or self.num_classes < 2:
            raise ConfigError("model", f"layer sizes must be positive: {self}")
        check_init(self.init, self.init_stddev)

    def layers(self) -> list[tuple[str, int, int]]:
        """(name, fan_in, fan_out) of each dense layer, input to output."""
        sizes = [self.input_dim, *self.hidden, self.num_classes]
        names = [f"hidden{i + 1}" for i in range(len(self.hidden))] + ["logits"]
        return [(names[i], sizes[i], sizes[i + 1]) for i in range(len(names))]

    def variables(self) -> list[tuple[str, tuple[int, ...]]]:
        """Canonical (name, shape) of every variable, in creation order."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, fan_in, fan_out in self.layers():
            out += [(f"{name}/kernel", (fan_in, fan_out)), (f"{name}/bias", (fan_out,))]
        return out

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.variables())

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        return init_weights(self, seed)


def check_init(init: str, stddev: float | None) -> None:
    """Refuse an initialiser psdk does not know, or a stddev it would not use or cannot draw with."""
    if init not in INITIALIZERS:
        meant = INIT_ALIASES.get(init.lower()) or closest(init, INITIALIZERS)
        hint = f"; did you mean model.init={meant}?" if meant is not None else ""
        raise ConfigError("model.init", f"unknown initialiser {init!r}{hint}", INITIALIZERS)
    if stddev is None:
        return
    if init not in WITH_STDDEV:
        raise ConfigError(
            "model.init_stddev",
            f"is {stddev}, but model.init={init} draws no normal: it is read by model.init=normal or "
            "truncated_normal only (drop it, or pick one of those)",
        )
    if isinstance(stddev, bool) or not isinstance(stddev, (int, float)) or not math.isfinite(stddev) or stddev <= 0:
        raise ConfigError("model.init_stddev", f"must be a positive number, got {stddev}; e.g. model.init_stddev=1.0")


def draw_kernel(rng: np.random.Generator, init: str, stddev: float, fan_in: int, fan_out: int) -> np.ndarray:
    """One (fan_in, fan_out) float32 kernel drawn as ``init`` says (:data:`INITIALIZERS`)."""
    shape = (fan_in, fan_out)
    if init == "glorot_uniform":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape).astype(np.float32)
    if init == "normal":
        return (rng.standard_normal(shape) * stddev).astype(np.float32)
    if init == "truncated_normal":
        # As tf.truncated_normal: a draw beyond two standard deviations is dropped and drawn again.
        values = rng.standard_normal(shape)
        while (outside := np.abs(values) > 2.0).any():
            values[outside] = rng.standard_normal(int(outside.sum()))
        return (values * stddev).astype(np.float32)
    if init == "zeros":
        return np.zeros(shape, np.float32)
    raise ConfigError("model.init", f"unknown initialiser {init!r}", INITIALIZERS)


class LayeredSpec(Protocol):
    """Any model spec whose dense layers :func:`init_weights` can draw: ``(name, fan_in, fan_out)`` each."""

    def layers(self) -> list[tuple[str, int, int]]: ...


def init_weights(spec: LayeredSpec, seed: int) -> dict[str, np.ndarray]:
    """Kernels drawn as ``spec.init`` says (Glorot-uniform, Keras' default, unless told) and zero biases, from ``seed``.

    Any spec with ``layers()`` will do (a workload's own model's too); ``init`` and ``init_stddev`` are
    read when it has them.

    A normal's stddev is ``spec.init_stddev``, 1.0 when not given (as
    ``tf.random_normal`` and ``tf.truncated_normal``). Biases start at zero
    whatever the kernels do, as in Keras and the TensorFlow 1.x examples.
    """
    init = str(getattr(spec, "init", "glorot_uniform"))
    given = getattr(spec, "init_stddev", None)
    stddev = 1.0 if given is None else float(given)
    if init == "zeros" and len(spec.layers()) > 1:
        log.warning(
            "model.init=zeros with hidden layers: every hidden unit computes the same output, so none ever differs "
            "from another and the hidden layers do not learn; zeros suits model=softmax (no hidden layer)"
        )
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, fan_in, fan_out in spec.layers():
        weights[f"{name}/kernel"] = draw_kernel(rng, init, stddev, fan_in, fan_out)
        weights[f"{name}/bias"] = np.zeros(fan_out, np.float32)
    return weights


def supporting_backends(model_name: str) -> tuple[str, ...] | None:
    """The backends a registered model has builders for; None when every backend builds it itself."""
    from psdk.plugins.registry import installed_models

    record = installed_models().get(model_name)
    return tuple(sorted(record.builders)) if record is not None and record.builders else None


def check_supported(model_name: str, backends: Sequence[str]) -> None:
    """Refuse a job whose backends cannot all build ``model_name`` (a mixed job needs every one)."""
    supported = supporting_backends(model_name)
    if supported is None:
        return
    missing = sorted(set(backends) - set(supported))
    if missing:
        raise ConfigError(
            "model",
            f"model={model_name} has no builder for the {', '.join(missing)} backend(s) of this job; "
            f"it builds on {', '.join(supported)}",
            supported,
        )


class Builder(Protocol):
    """What :func:`build_model` needs of a backend; a :class:`~psdk.plugins.backend.Backend` has it.

    Named here rather than imported: the backend contract imports this module for
    :class:`ModelSpec`, and a circle of imports, even of annotations, is one to untangle.
    """

    @property
    def name(self) -> str: ...

    def build_model(self, spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> Any: ...


def build_model(backend: Builder, spec: Any, weights: Mapping[str, np.ndarray]) -> Any:
    """``spec`` built on ``backend`` holding ``weights``: by the model's plugin, or by the backend itself."""
    from psdk.plugins.registry import installed_models, load_target

    record = installed_models().get(str(spec.name))
    if record is not None and record.builders:
        check_supported(record.name, [backend.name])
        target = record.builders[backend.name]
        builder = load_target(target, f"the {backend.name} builder of model {record.name!r}")
        try:
            return builder(backend, spec, weights)
        except PsdkError:
            raise
        except Exception as exc:  # the plugin's own code failed: say whose it is
            raise PluginError(f"the {backend.name} builder of model {record.name!r} ({target}) failed: {exc}") from exc
    if not isinstance(spec, ModelSpec):
        raise ConfigError("model", f"model {spec.name!r} is not a dense stack and names no builder for {backend.name}")
    return backend.build_model(spec, weights)
