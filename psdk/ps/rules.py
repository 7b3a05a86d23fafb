"""Update rules: the optimizers that run on the ps, in numpy, in place.

A rule works on one shard's parameters as a single flat float32 buffer, so an
update is a handful of vectorised numpy calls whatever the number of
variables; its slots (momentum, Adam's moments, ...) are flat buffers of the
same size held on the ps beside the parameters. Rules never write into the
gradient they are given: it may be a read-only view of a received frame.

Semantics follow ``torch.optim`` (tested against it). Where TensorFlow
differs, the difference is a documented option:

* **Learning-rate decay.** Every rule takes ``decay``, ``decay_rate`` and
  ``decay_steps``; ``decay_rate`` is the factor the rate has fallen by after
  ``decay_steps`` updates. ``decay="exponential"`` (default) uses
  ``lr * decay_rate ** (t / decay_steps)`` at the t-th update, as
  ``tf.train.exponential_decay`` did with the global step (``decay_rate=1``:
  constant); ``decay="cosine"`` follows half a cosine from ``lr`` down to
  ``lr * decay_rate`` at ``decay_steps`` and stays there, as
  ``tf.train.cosine_decay`` with ``alpha=decay_rate``. torch expresses these
  with LR schedulers, which are not mapped.
* **Warmup.** ``warmup_steps=W`` scales the rate of the t-th update by
  ``min(1, (t + 1) / W)``: it climbs linearly over the first W updates onto
  the schedule above (Goyal et al. 2017, "Accurate, Large Minibatch SGD"),
  which lets many async workers start from a random model without
  overshooting while their gradients are stalest relative to its change.
* **Adam epsilon.** torch adds ``eps`` to the bias-corrected root,
  ``p -= lr * m_hat / (sqrt(v_hat) + eps)``; TensorFlow/Keras adds it to the
  uncorrected root, ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``
  (the paper's "epsilon hat"). ``epsilon_mode="torch"`` (default) or ``"tf"``
  picks one; they agree when ``eps`` is negligible against ``sqrt(v)``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from psdk.errors import ConfigError
from psdk.protocol.numerics import SAFE_MAGNITUDE, all_finite

Bounds = tuple[float, dict[str, float]]
"""Upper bounds on ``|x|`` for a shard's parameters and for each of its slots, by name.

The slots' dict may also hold lower bounds on a slot's values, under
:func:`floor_key`, for the rules that ask for them (:meth:`UpdateRule.slot_floors`).
"""


def floor_key(slot: str) -> str:
    """Where :data:`Bounds` keeps a lower bound on the values of ``slot`` (not on their magnitude)."""
    return f"{slot}:floor"


DECAYS = ("exponential", "cosine")
"""The learning-rate schedules a rule follows over its updates (see the module docstring)."""

ROUNDING = 1 + 1e-5
"""float32 rounds each operation by up to 2^-24 of its result; an update makes a handful, hence this slack."""
TINY = 1e-30
"""And an absolute slack, for values near zero (subnormal results round by more than their relative error)."""


SMALLEST_EPS = float(np.finfo(np.float32).tiny)
"""An eps below float32's smallest normal number may round to 0 in float32: no denominator bound then."""


def _within(params: float, slots: dict[str, float], *intermediates: float) -> Bounds | None:
    """The bounds after an update if it and everything computed on the way stay far from float32's limit."""
    values = [params, *slots.values(), *intermediates]
    if all(math.isfinite(v) and 0 <= v * ROUNDING < SAFE_MAGNITUDE for v in values):  # NaN fails isfinite
        return params * ROUNDING + TINY, {name: bound * ROUNDING + TINY for name, bound in slots.items()}
    return None


@dataclass
class RuleState:
    """Everything a rule keeps between updates of one shard."""

    step: int = 0
    slots: dict[str, np.ndarray] = field(default_factory=dict)
    scratch: list[np.ndarray] = field(default_factory=list)


@dataclass(frozen=True)
class UpdateRule(ABC):
    """A server-side optimizer; its fields are its hyper-parameters."""

    name: ClassVar[str]
    nonnegative_slots: ClassVar[tuple[str, ...]] = ()
    """Slots the rule takes a square root of: a negative value there would make NaN."""
    lr: float
    decay_rate: float = 1.0
    decay_steps: int = 1000
    decay: str = "exponential"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"optimizer.{f.name}", f"must be finite, got {value}")
        if self.lr <= 0:
            raise ConfigError("optimizer.lr", f"must be positive, got {self.lr}")
        if self.decay not in DECAYS:
            raise ConfigError("optimizer.decay", f"must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        low = 0.0 if self.decay == "cosine" else math.ulp(0.0)  # a cosine may fall to 0; exponential never can
        if not low <= self.decay_rate <= 1.0:
            interval = "[0, 1]" if self.decay == "cosine" else "(0, 1]"
            raise ConfigError("optimizer.decay_rate", f"must be in {interval} for {self.decay}, got {self.decay_rate}")
        if self.decay_steps < 1:
            raise ConfigError("optimizer.decay_steps", f"must be >= 1, got {self.decay_steps}")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", f"must be >= 0, got {self.warmup_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that follows ``step`` earlier ones."""
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.decayed_lr_at(step) * warm

    def decayed_lr_at(self, step: int) -> float:
        """The rate the decay schedule alone gives, before warmup scales it."""
        if self.decay_rate == 1.0:
            return self.lr
        if self.decay == "cosine":
            done = min(step, self.decay_steps) / self.decay_steps
            return self.lr * (self.decay_rate + (1.0 - self.decay_rate) * 0.5 * (1.0 + math.cos(math.pi * done)))
        return self.lr * self.decay_rate ** (step / self.decay_steps)

    @abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-parameter buffers this rule keeps."""

    def scratch_count(self) -> int:
        return 2

    def check_slots(self, slots: dict[str, np.ndarray]) -> str | None:
        """What makes restored slots unusable (non-finite, or negative where a root is taken); ``None`` if fine."""
        for name, values in slots.items():
            if not all_finite(values):
                return f"slot {name!r} holds NaN or Inf"
            if name in self.nonnegative_slots and values.size and float(values.min()) < 0.0:
                return f"slot {name!r} holds negative values ({self.name} takes its square root)"
        return None

    def slot_floors(self, slots: dict[str, np.ndarray]) -> dict[str, float]:
        """Lower bounds on slots' values that :meth:`bounds_after` relies on, by :func:`floor_key`.

        The store measures them from the slots themselves whenever it
        measures its bounds (after ``initialize``, a restore and every
        checked apply), so a floor holds for whatever the slots hold, a
        checkpoint's included; :meth:`bounds_after` carries it over applies
        that cannot lower it. None by default.
        """
        return {}

    def new_state(self, size: int) -> RuleState:
        slots = {name: np.zeros(size, np.float32) for name in self.slot_names()}
        scratch = [np.empty(size, np.float32) for _ in range(self.scratch_count())]
        return RuleState(step=0, slots=slots, scratch=scratch)

    @abstractmethod
    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        """Update ``params`` in place with ``grad``; advance ``state``."""

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        """Bounds on ``|x|`` after one :meth:`apply`, from bounds before it and on the gradient's ``|g|``.

        ``None`` when the rule cannot tell, or when a value on the way could
        come near float32's limit: the store then backs its state up, applies
        and checks the result instead (see :mod:`psdk.ps.store`). A rule that
        answers lets the store skip that copy and that check: the interval
        arithmetic of a few scalars proves the result finite.
        """
        return None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}

    def _decayed(self, params: np.ndarray, grad: np.ndarray, state: RuleState, wd: float) -> np.ndarray:
        """``grad + wd * params`` in a scratch buffer (L2 decay as torch applies it)."""
        if wd == 0.0:
            return grad
        out = state.scratch[1]
        np.multiply(params, wd, out=out)
        out += grad
        return out


@dataclass(frozen=True)
class SGD(UpdateRule):
    """Plain gradient descent, with optional (Nesterov) momentum and L2 decay."""

    name: ClassVar[str] = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.momentum < 0:
            raise ConfigError("optimizer.momentum", f"must be >= 0, got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optimizer.nesterov", "needs optimizer.momentum > 0")

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        g = grad + abs(self.weight_decay) * params
        step, after = g, {}
        if self.momentum:
            buf = after["momentum"] = self.momentum * slots["momentum"] + g
            step = self.momentum * buf + g if self.nesterov else buf
        return _within(params + self.lr * step, after, g, step)

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        g = self._decayed(params, grad, state, self.weight_decay)
        if self.momentum:
            buf = state.slots["momentum"]
            if state.step == 0:
                np.copyto(buf, g)  # torch starts the buffer at the first gradient
            else:
                buf *= self.momentum
                buf += g
            if self.nesterov:
                step = state.scratch[0]
                np.multiply(buf, self.momentum, out=step)
                step += g
                g = step
            else:
                g = buf
        tmp = state.scratch[0]
        np.multiply(g, self.lr_at(state.step), out=tmp)
        params -= tmp
        state.step += 1


@dataclass(frozen=True)
class Adam(UpdateRule):
    """Adam with L2 decay; see the module docstring for ``epsilon_mode``."""

    name: ClassVar[str] = "adam"
    nonnegative_slots: ClassVar[tuple[str, ...]] = ("v",)
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    epsilon_mode: str = "torch"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optimizer.{key}", f"must be in [0, 1), got {getattr(self, key)}")
        if self.epsilon_mode not in ("torch", "tf"):
            raise ConfigError("optimizer.epsilon_mode", f"got {self.epsilon_mode!r}", ["torch", "tf"])
        if self.eps < 0:
            raise ConfigError("optimizer.eps", f"must be >= 0, got {self.eps}")

    def slot_names(self) -> tuple[str, ...]:
        return ("m", "v")

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        if self.eps < SMALLEST_EPS:
            return None  # a zero denominator is possible: only the check can tell
        g = grad + abs(self.weight_decay) * params
        m = self.beta1 * slots["m"] + (1 - self.beta1) * g
        v = self.beta2 * slots["v"] + (1 - self.beta2) * g * g
        root = math.sqrt(v / (1 - self.beta2))  # sqrt(v_t) / sqrt(1 - beta2^t), t >= 1
        # Every denominator is at least eps, and the bias correction divides by at most 1 - beta1.
        ratio = m / self.eps
        update = self.lr / (1 - self.beta1) * ratio
        return _within(params + update, {"m": m, "v": v}, g * g, root + self.eps, ratio, update)

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        g = self._decayed(params, grad, state, self.weight_decay)
        m, v = state.slots["m"], state.slots["v"]
        tmp = state.scratch[0]
        lr = self.lr_at(state.step)
        state.step += 1
        t = state.step
        m *= self.beta1
        np.multiply(g, 1.0 - self.beta1, out=tmp)
        m += tmp
        v *= self.beta2
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - self.beta2
        v += tmp
        bias1 = 1.0 - self.beta1**t
        bias2 = 1.0 - self.beta2**t
        np.sqrt(v, out=tmp)
        if self.epsilon_mode == "torch":
            tmp /= math.sqrt(bias2)
            tmp += self.eps
            step_size = lr / bias1
        else:
            tmp += self.eps
            step_size = lr * math.sqrt(bias2) / bias1
        np.divide(m, tmp, out=tmp)
        tmp *= step_size
        params -= tmp


@dataclass(frozen=True)
class Adagrad(UpdateRule):
    """Adagrad as torch applies it: ``p -= lr * g / (sqrt(sum g^2) + eps)``.

    TensorFlow 1.x's ``AdagradOptimizer`` is the same rule with
    ``initial_accumulator_value=0.1, eps=0``: its bounds then come from the
    smallest accumulator (:meth:`slot_floors`), so its applies stay cheap.
    """

    name: ClassVar[str] = "adagrad"
    nonnegative_slots: ClassVar[tuple[str, ...]] = ("sum",)
    lr: float = 0.01
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0

    def slot_names(self) -> tuple[str, ...]:
        return ("sum",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.initial_accumulator_value < 0:
            raise ConfigError(
                "optimizer.initial_accumulator_value", f"must be >= 0, got {self.initial_accumulator_value}"
            )
        if self.eps < 0:
            raise ConfigError("optimizer.eps", f"must be >= 0, got {self.eps}")

    def slot_floors(self, slots: dict[str, np.ndarray]) -> dict[str, float]:
        """The smallest accumulator: sums only grow, so every later denominator is at least its root."""
        acc = slots["sum"]
        return {floor_key("sum"): float(acc.min())} if acc.size else {}

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        floor = slots.get(floor_key("sum"), 0.0)
        # sqrt(sum) + eps, with sum >= its floor (TensorFlow 1.x's eps=0 with initial_accumulator_value > 0
        # is bounded by the floor alone); float32's rounding of the root and the sum taken off.
        low = (math.sqrt(max(floor, 0.0)) + self.eps) / ROUNDING
        if not low >= SMALLEST_EPS:  # also NaN
            return None  # a zero denominator is possible: only the check can tell
        g = grad + abs(self.weight_decay) * params
        total = slots["sum"] + g * g
        ratio = g / low
        after = _within(params + self.lr * ratio, {"sum": total}, g * g, math.sqrt(total) + self.eps, ratio)
        if after is not None and floor_key("sum") in slots:
            after[1][floor_key("sum")] = floor  # adding squares never lowers a float32 sum
        return after

    def new_state(self, size: int) -> RuleState:
        state = super().new_state(size)
        state.slots["sum"].fill(self.initial_accumulator_value)
        return state

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        g = self._decayed(params, grad, state, self.weight_decay)
        acc, tmp = state.slots["sum"], state.scratch[0]
        np.multiply(g, g, out=tmp)
        acc += tmp
        np.sqrt(acc, out=tmp)
        tmp += self.eps
        np.divide(g, tmp, out=tmp)
        tmp *= self.lr_at(state.step)
        params -= tmp
        state.step += 1


@dataclass(frozen=True)
class RMSProp(UpdateRule):
    """RMSprop as torch applies it (``alpha`` is TensorFlow's ``rho``)."""

    name: ClassVar[str] = "rmsprop"
    nonnegative_slots: ClassVar[tuple[str, ...]] = ("square_avg",)
    lr: float = 0.01
    alpha: float = 0.99
    eps: float = 1e-8
    momentum: float = 0.0
    centered: bool = False
    weight_decay: float = 0.0

    def slot_names(self) -> tuple[str, ...]:
        names = ["square_avg"]
        if self.momentum:
            names.append("momentum")
        if self.centered:
            names.append("grad_avg")
        return tuple(names)

    def scratch_count(self) -> int:
        return 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha < 1.0:
            raise ConfigError("optimizer.alpha", f"must be in [0, 1), got {self.alpha}")
        if self.momentum < 0:
            raise ConfigError("optimizer.momentum", f"must be >= 0, got {self.momentum}")
        if self.eps < 0:
            raise ConfigError("optimizer.eps", f"must be >= 0, got {self.eps}")

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        if self.centered or self.eps < SMALLEST_EPS:
            return None  # centered: sqrt(square_avg - grad_avg^2) can go NaN by rounding; only the check can tell
        g = grad + abs(self.weight_decay) * params
        square = self.alpha * slots["square_avg"] + (1 - self.alpha) * g * g
        ratio = g / self.eps
        after = {"square_avg": square}
        step = ratio
        if self.momentum:
            step = after["momentum"] = self.momentum * slots["momentum"] + ratio
        return _within(params + self.lr * step, after, g * g, math.sqrt(square) + self.eps, ratio)

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        g = self._decayed(params, grad, state, self.weight_decay)
        sq, tmp, denom = state.slots["square_avg"], state.scratch[0], state.scratch[2]
        sq *= self.alpha
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - self.alpha
        sq += tmp
        if self.centered:
            avg = state.slots["grad_avg"]
            avg *= self.alpha
            np.multiply(g, 1.0 - self.alpha, out=tmp)
            avg += tmp
            np.multiply(avg, avg, out=tmp)
            np.subtract(sq, tmp, out=denom)
            np.sqrt(denom, out=denom)
        else:
            np.sqrt(sq, out=denom)
        denom += self.eps
        lr = self.lr_at(state.step)
        if self.momentum:
            buf = state.slots["momentum"]
            buf *= self.momentum
            np.divide(g, denom, out=tmp)
            buf += tmp
            np.multiply(buf, lr, out=tmp)
        else:
            np.divide(g, denom, out=tmp)
            tmp *= lr
        params -= tmp
        state.step += 1


@dataclass(frozen=True)
class NoOp(UpdateRule):
    """Counts updates and changes nothing: measures the transport and the ps alone."""

    name: ClassVar[str] = "noop"
    lr: float = 1.0

    def slot_names(self) -> tuple[str, ...]:
        return ()

    def scratch_count(self) -> int:
        return 0

    def bounds_after(self, params: float, slots: dict[str, float], grad: float) -> Bounds | None:
        return params, dict(slots)

    def apply(self, params: np.ndarray, grad: np.ndarray, state: RuleState) -> None:
        state.step += 1
