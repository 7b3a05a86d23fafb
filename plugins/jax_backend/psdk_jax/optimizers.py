"""psdk update rules as the optax transformations a JAX user would write, and the way back.

An optax optimizer is a NamedTuple of two closures (``init``, ``update``): its
learning rate, its schedule and its kind cannot be read back, and it takes
no attributes. So the way from an optax optimizer to the ps's rule exists
only for transformations :func:`make_optimizer` made (it remembers the rule
it was given, :func:`psdk.plugins.backends.kit.remember_rule`); any other is refused
with what to write instead: the rule itself,
``psdk.DistributedOptimizer(None, model, session, rule=psdk.rules.Adam(lr=1e-3))``.

What each rule becomes (``weight_decay`` is psdk's L2, ``g + wd * p``, which
is ``optax.add_decayed_weights(wd)`` chained *before* the rule; the learning
rate is a float, or an optax schedule when the rule decays):

=====================================  ==================================================================
psdk rule                              optax
=====================================  ==================================================================
``SGD(lr, momentum, nesterov)``        ``optax.sgd(lr, momentum or None, nesterov)``
``Adam(lr, beta1, beta2, eps)``        ``optax.adam(lr, b1, b2, eps)``
``Adagrad(lr, initial_acc., eps)``     ``optax.adagrad(lr, initial_accumulator_value, eps)``
``RMSProp(lr, alpha, eps, momentum,    ``optax.rmsprop(lr, decay=alpha, eps, eps_in_sqrt=False, centered,
centered)``                            momentum or None)``
``decay="exponential"``                ``optax.exponential_decay(lr, decay_steps, decay_rate)``
``decay="cosine"``                     ``optax.cosine_decay_schedule(lr, decay_steps, alpha=decay_rate)``
=====================================  ==================================================================

Where optax computes differently (the ps runs the psdk rule whatever the
optax object does, so these matter only to a script stepping optax itself):

* **Adagrad's epsilon** is inside the root in optax, ``g / sqrt(sum + eps)``,
  outside in psdk and torch, ``g / (sqrt(sum) + eps)``; they agree to
  ``eps / sum`` relative, nothing at psdk's default ``eps=1e-10``.
* **RMSProp with momentum and a decaying rate**: optax scales by the rate
  before its momentum trace, psdk (as torch) after, so past steps keep the
  rate they were taken at in optax; with a constant rate they are the same.
  (``eps_in_sqrt=False`` puts epsilon outside the root, as psdk does; optax's
  default puts it inside.)
* **Adam with** ``epsilon_mode="tf"``: ``optax.adam`` adds ``eps`` to the
  bias-corrected root, which is psdk's default ``epsilon_mode="torch"``;
  TensorFlow's convention has no optax spelling, so the transformation
  keeps optax's and the remembered rule keeps ``"tf"``. They agree when
  ``eps`` is negligible against ``sqrt(v)``.

Every other case updates as the ps does, within float32 rounding: the
plugin's tests run both for 20 steps (:class:`psdk.testing.RuleAgreement`).
"""

from __future__ import annotations

from typing import Any

import optax

from psdk.errors import ConfigError
from psdk.plugins.backends import kit
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

SUPPORTED = ("psdk.rules.SGD", "psdk.rules.Adam", "psdk.rules.Adagrad", "psdk.rules.RMSProp")


def learning_rate(rule: UpdateRule) -> float | optax.Schedule:
    """The rule's rate: a float, or the optax schedule that gives ``rule.lr_at(t)`` at update ``t``."""
    decayed = _decayed(rule)
    if rule.warmup_steps <= 1:  # a warmup of one update scales nothing
        return decayed
    warmup = optax.linear_schedule(1.0 / rule.warmup_steps, 1.0, transition_steps=rule.warmup_steps - 1)
    if callable(decayed):
        return lambda step: decayed(step) * warmup(step)
    return lambda step: decayed * warmup(step)


def _decayed(rule: UpdateRule) -> float | optax.Schedule:
    """The decay schedule alone (``rule.decayed_lr_at``)."""
    if rule.decay_rate == 1.0:
        return rule.lr
    if rule.decay == "cosine":
        return optax.cosine_decay_schedule(rule.lr, rule.decay_steps, alpha=rule.decay_rate)
    return optax.exponential_decay(rule.lr, transition_steps=rule.decay_steps, decay_rate=rule.decay_rate)


def transformation(rule: UpdateRule) -> optax.GradientTransformation:
    """The optax transformation for ``rule`` (see the module docstring), remembering nothing."""
    lr = learning_rate(rule)
    tx: optax.GradientTransformation
    if isinstance(rule, SGD):
        tx = optax.sgd(lr, momentum=rule.momentum or None, nesterov=rule.nesterov)
    elif isinstance(rule, Adam):
        tx = optax.adam(lr, b1=rule.beta1, b2=rule.beta2, eps=rule.eps)
    elif isinstance(rule, Adagrad):
        tx = optax.adagrad(lr, initial_accumulator_value=rule.initial_accumulator_value, eps=rule.eps)
    elif isinstance(rule, RMSProp):
        tx = optax.rmsprop(
            lr,
            decay=rule.alpha,
            eps=rule.eps,
            eps_in_sqrt=False,
            centered=rule.centered,
            momentum=rule.momentum or None,
        )
    else:
        raise ConfigError(
            "optimizer",
            f"the jax backend has no optax optimizer for the rule {rule.name!r}; pass the rule to "
            "DistributedOptimizer(None, model, session, rule=...) and no optax optimizer",
            SUPPORTED,
        )
    weight_decay = getattr(rule, "weight_decay", 0.0)
    return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx


def make_optimizer(rule: UpdateRule) -> optax.GradientTransformation:
    """The optax transformation for ``rule``; :func:`optimizer_rule` gives ``rule`` back for it."""
    tx = transformation(rule)
    kit.remember_rule(tx, rule)
    return tx


def optimizer_rule(optimizer: Any) -> UpdateRule:
    """The rule :func:`make_optimizer` made ``optimizer`` from; any other optax optimizer is refused."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(
            "optimizer",
            f"expected an optax GradientTransformation, got {type(optimizer).__name__}; or pass the rule "
            "itself: DistributedOptimizer(None, model, session, rule=psdk.rules.Adam(lr=...))",
        )
    rule = kit.remembered_rule(optimizer)
    if rule is None:
        raise ConfigError(
            "optimizer",
            "an optax optimizer is a pair of closures: its kind, learning rate and schedule cannot be read, "
            "so psdk cannot tell which rule the ps should run. Pass the rule instead of the optimizer: "
            "DistributedOptimizer(None, model, session, rule=psdk.rules.Adam(lr=1e-3)) "
            "(psdk.rules has SGD, Adam, Adagrad and RMSProp, each with weight_decay and a decay schedule); "
            "backend.make_optimizer(model, rule) gives the matching optax optimizer",
            SUPPORTED,
        )
    return rule
