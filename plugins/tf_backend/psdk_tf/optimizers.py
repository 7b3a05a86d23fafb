"""Keras optimizers and psdk's update rules, both ways.

The Keras optimizer a worker wraps is never stepped: its type and
hyper-parameters select the rule the ps runs. Keras 3's updates equal psdk's
(which follow ``torch.optim``) for constant learning rates, with these
differences, each handled here:

* **Adam's epsilon** is TensorFlow's, added to the uncorrected root: a Keras
  Adam maps to ``Adam(epsilon_mode="tf")``.
* **Adagrad and RMSprop** add epsilon inside the square root; psdk (and torch)
  outside. They agree when epsilon is small against the accumulated squares,
  as it is with the defaults; the rule keeps Keras's value.
* **weight_decay** is decoupled in Keras (AdamW style) but an L2 term on the
  gradient in psdk, so a Keras optimizer with ``weight_decay`` is refused.
* **Learning-rate decay**: ``keras.optimizers.schedules.ExponentialDecay``
  (not staircase) is psdk's ``decay_rate``/``decay_steps``, and ``CosineDecay``
  (no warm-up) its ``decay="cosine"`` with ``alpha`` as ``decay_rate``; other
  schedules are refused. psdk's ``warmup_steps`` scales the decayed rate,
  where Keras's ``CosineDecay`` warm-up comes before the decay and adds to
  its steps: the remembered rule keeps psdk's.
* **Momentum under a decaying rate**: Keras scales each step by the rate
  before adding it to the velocity, the ps (as torch) after, so in Keras past
  steps keep the rate they were taken at. The ps runs its own rule; a constant
  rate makes the two the same.

An optimizer made by :func:`make_optimizer` carries its exact psdk rule
(:func:`psdk.plugins.backends.kit.remember_rule`), so options Keras cannot express
(L2 ``weight_decay``, ``epsilon_mode="torch"``, ``warmup_steps``) survive the round trip,
unless the optimizer has been changed since.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psdk.errors import ConfigError
from psdk.plugins.backends import kit
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk_tf._tf import keras

# Keras's defaults for options the ps cannot run; anything else is refused by name.
NEUTRAL: dict[str, Any] = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
    "amsgrad": False,
}
# What Keras has no place for; the kept rule supplies it.
PSDK_ONLY = frozenset({"weight_decay", "epsilon_mode", "warmup_steps"})


def make_optimizer(rule: UpdateRule) -> Any:
    """The Keras optimizer a TensorFlow user would write for ``rule``, carrying the rule itself."""
    lr: Any = rule.lr
    if rule.decay_rate != 1.0 and rule.decay == "cosine":
        lr = keras.optimizers.schedules.CosineDecay(rule.lr, rule.decay_steps, alpha=rule.decay_rate)
    elif rule.decay_rate != 1.0:
        lr = keras.optimizers.schedules.ExponentialDecay(rule.lr, rule.decay_steps, rule.decay_rate)
    optimizer: Any
    if isinstance(rule, SGD):
        optimizer = keras.optimizers.SGD(lr, momentum=rule.momentum, nesterov=rule.nesterov)
    elif isinstance(rule, Adam):
        optimizer = keras.optimizers.Adam(lr, beta_1=rule.beta1, beta_2=rule.beta2, epsilon=rule.eps)
    elif isinstance(rule, Adagrad):
        optimizer = keras.optimizers.Adagrad(
            lr, initial_accumulator_value=rule.initial_accumulator_value, epsilon=rule.eps
        )
    elif isinstance(rule, RMSProp):
        optimizer = keras.optimizers.RMSprop(
            lr, rho=rule.alpha, momentum=rule.momentum, epsilon=rule.eps, centered=rule.centered
        )
    else:
        raise ConfigError(
            "optimizer",
            f"Keras has no optimizer for the ps rule {rule.name!r}; pass the rule itself: "
            "DistributedOptimizer(None, model, session, rule=...)",
        )
    kit.remember_rule(optimizer, rule)
    return optimizer


def _sgd(c: Mapping[str, Any], lr: dict[str, Any]) -> UpdateRule:
    return SGD(momentum=float(c["momentum"]), nesterov=bool(c["nesterov"]), **lr)


def _adam(c: Mapping[str, Any], lr: dict[str, Any]) -> UpdateRule:
    return Adam(
        beta1=float(c["beta_1"]),
        beta2=float(c["beta_2"]),
        eps=float(c["epsilon"]),
        epsilon_mode="tf",
        **lr,
    )


def _adagrad(c: Mapping[str, Any], lr: dict[str, Any]) -> UpdateRule:
    accumulator = float(c["initial_accumulator_value"])
    return Adagrad(initial_accumulator_value=accumulator, eps=float(c["epsilon"]), **lr)


def _rmsprop(c: Mapping[str, Any], lr: dict[str, Any]) -> UpdateRule:
    return RMSProp(
        alpha=float(c["rho"]),
        momentum=float(c["momentum"]),
        eps=float(c["epsilon"]),
        centered=bool(c["centered"]),
        **lr,
    )


RULE_OF: dict[type, Callable[[Mapping[str, Any], dict[str, Any]], UpdateRule]] = {
    keras.optimizers.SGD: _sgd,
    keras.optimizers.Adam: _adam,
    keras.optimizers.Adagrad: _adagrad,
    keras.optimizers.RMSprop: _rmsprop,
}
SUPPORTED = tuple(f"keras.optimizers.{kind.__name__}" for kind in RULE_OF)
WEIGHT_DECAY_NOTE = (
    " (Keras decays weights decoupled, as AdamW; the ps's weight_decay is L2 on the "
    "gradient: set optimizer.weight_decay in psdk's config or add the L2 term to the loss)"
)


def optimizer_rule(optimizer: Any) -> UpdateRule:
    """The ps rule a Keras optimizer stands for; optimizers and options without one are refused."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            "optimizer",
            f"expected a Keras optimizer (keras.optimizers.SGD, ...), got {type(optimizer).__name__}; or pass "
            "the ps rule itself: DistributedOptimizer(None, model, session, rule=psdk.rules.SGD(lr=...))",
        )
    kind = type(optimizer)
    if kind not in RULE_OF:  # exact types: AdamW is an Adam whose decoupled decay the ps cannot run
        raise kit.no_rule_for(_qualified(kind), SUPPORTED)
    config = optimizer.get_config()
    try:
        kit.refuse_options(kind.__name__, config, NEUTRAL)
    except ConfigError as exc:
        if exc.key != "optimizer.weight_decay":
            raise
        raise ConfigError(exc.key, exc.problem + WEIGHT_DECAY_NOTE) from None
    rule = RULE_OF[kind](config, _learning_rate(config["learning_rate"]))
    return kit.kept_if_same(rule, kit.remembered_rule(optimizer), PSDK_ONLY)


def _qualified(kind: type) -> str:
    """``keras.optimizers.AdamW`` for Keras's own optimizers, else the class's module and name."""
    if getattr(keras.optimizers, kind.__name__, None) is kind:
        return f"keras.optimizers.{kind.__name__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _learning_rate(value: Any) -> dict[str, Any]:
    """``lr`` (and ``decay_rate``/``decay_steps``) from a Keras ``learning_rate`` config entry."""
    if not isinstance(value, Mapping):
        # Keras holds the rate in a float32 variable: 0.05 comes back as 0.05000000074505806.
        return {"lr": float(str(np.float32(value)))}
    schedule, config = value.get("class_name"), value.get("config", {})
    if schedule == "CosineDecay" and not config.get("warmup_steps"):
        return {
            "lr": float(config["initial_learning_rate"]),
            "decay": "cosine",
            "decay_rate": float(config["alpha"]),
            "decay_steps": int(config["decay_steps"]),
        }
    if schedule != "ExponentialDecay" or config.get("staircase"):
        detail = " (staircase)" if config.get("staircase") else " (warm-up)" if config.get("warmup_steps") else ""
        raise ConfigError(
            "optimizer.learning_rate",
            f"the schedule {schedule}{detail} has no ps equivalent; use a constant, "
            "ExponentialDecay(staircase=False) or CosineDecay without warm-up",
        )
    return {
        "lr": float(config["initial_learning_rate"]),
        "decay_rate": float(config["decay_rate"]),
        "decay_steps": int(config["decay_steps"]),
    }
