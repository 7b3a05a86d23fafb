"""``torch.optim`` optimizers to and from the ps's update rules.

The optimizer a worker wraps is never stepped: its type and hyper-parameters
select the rule the ps runs. psdk's rules follow ``torch.optim`` (they are
tested against it, 20 steps each), so each supported optimizer is its rule
field for field. Options the ps cannot run (``dampening``, ``amsgrad``,
``maximize``, Adam's ``decoupled_weight_decay``, ...) are refused by name;
so are parameter groups with different settings, since the ps runs one rule.

What ``torch.optim`` has no place for, learning-rate decay and warmup (torch's
LR schedulers are not mapped) and TensorFlow's Adam epsilon, is kept by the
rule :func:`make_optimizer` remembers beside the optimizer
(:func:`psdk.plugins.backends.kit.remember_rule`); it answers for the optimizer as
long as torch's own settings still agree with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from psdk.errors import ConfigError
from psdk.plugins.backends import kit
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

PSDK_ONLY = frozenset({"decay", "decay_rate", "decay_steps", "warmup_steps", "epsilon_mode"})
"""Rule fields torch.optim cannot express; the remembered rule supplies them."""

Reader = Callable[[Mapping[str, Any]], UpdateRule]


def _sgd(g: Mapping[str, Any]) -> UpdateRule:
    return SGD(lr=float(g["lr"]), momentum=float(g["momentum"]), nesterov=bool(g["nesterov"]), weight_decay=_l2(g))


def _adam(g: Mapping[str, Any]) -> UpdateRule:
    beta1, beta2 = g["betas"]
    return Adam(lr=float(g["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(g["eps"]), weight_decay=_l2(g))


def _adagrad(g: Mapping[str, Any]) -> UpdateRule:
    accumulator = float(g["initial_accumulator_value"])
    return Adagrad(lr=float(g["lr"]), eps=float(g["eps"]), initial_accumulator_value=accumulator, weight_decay=_l2(g))


def _rmsprop(g: Mapping[str, Any]) -> UpdateRule:
    return RMSProp(
        lr=float(g["lr"]),
        alpha=float(g["alpha"]),
        eps=float(g["eps"]),
        momentum=float(g["momentum"]),
        centered=bool(g["centered"]),
        weight_decay=_l2(g),
    )


def _l2(g: Mapping[str, Any]) -> float:
    return float(g.get("weight_decay", 0.0))


# Per optimizer class: its rule, and its settings for the options the ps cannot run (refused when changed).
RULES: dict[type, tuple[Reader, dict[str, Any]]] = {
    torch.optim.SGD: (_sgd, {"dampening": 0, "maximize": False}),
    torch.optim.Adam: (_adam, {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}),
    torch.optim.Adagrad: (_adagrad, {"lr_decay": 0, "maximize": False}),
    torch.optim.RMSprop: (_rmsprop, {"maximize": False}),
}
SUPPORTED = tuple(f"torch.optim.{kind.__name__}" for kind in RULES)


def make_optimizer(params: Iterable[torch.nn.Parameter], rule: UpdateRule) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer a torch user would write for ``rule``, remembering the rule."""
    l2 = getattr(rule, "weight_decay", 0.0)
    optimizer: torch.optim.Optimizer
    if isinstance(rule, SGD):
        optimizer = torch.optim.SGD(params, lr=rule.lr, momentum=rule.momentum, nesterov=rule.nesterov, weight_decay=l2)
    elif isinstance(rule, Adam):
        optimizer = torch.optim.Adam(params, lr=rule.lr, betas=(rule.beta1, rule.beta2), eps=rule.eps, weight_decay=l2)
    elif isinstance(rule, Adagrad):
        accumulator = rule.initial_accumulator_value
        optimizer = torch.optim.Adagrad(
            params, lr=rule.lr, eps=rule.eps, initial_accumulator_value=accumulator, weight_decay=l2
        )
    elif isinstance(rule, RMSProp):
        optimizer = torch.optim.RMSprop(
            params,
            lr=rule.lr,
            alpha=rule.alpha,
            eps=rule.eps,
            momentum=rule.momentum,
            centered=rule.centered,
            weight_decay=l2,
        )
    else:
        raise ConfigError(
            "optimizer",
            f"torch.optim has no optimizer for the ps rule {rule.name!r}; pass the rule itself: "
            "DistributedOptimizer(None, model, session, rule=...)",
        )
    kit.remember_rule(optimizer, rule)
    return optimizer


def optimizer_rule(optimizer: Any) -> UpdateRule:
    """The ps rule a ``torch.optim`` optimizer stands for; optimizers and options without one are refused."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer",
            f"expected a torch.optim optimizer, got {type(optimizer).__name__}; or pass the ps rule itself: "
            "DistributedOptimizer(None, model, session, rule=psdk.rules.SGD(lr=...))",
        )
    kind = type(optimizer)
    if kind not in RULES:  # exact types: AdamW is an Adam whose decoupled decay the ps cannot run
        raise kit.no_rule_for(_qualified(kind), SUPPORTED)
    read, neutral = RULES[kind]
    group = _only_group(optimizer)
    kit.refuse_options(kind.__name__, group, neutral)
    return kit.kept_if_same(read(group), kit.remembered_rule(optimizer), PSDK_ONLY)


def _only_group(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    groups = optimizer.param_groups
    keys = [k for k in groups[0] if k != "params"]
    if any(any(g.get(k) != groups[0].get(k) for k in keys) for g in groups[1:]):
        raise ConfigError(
            "optimizer",
            "parameter groups with different hyper-parameters cannot run on the ps, which runs one rule; use one group",
        )
    return groups[0]


def _qualified(kind: type) -> str:
    """``torch.optim.AdamW`` for torch's own optimizers (not ``torch.optim.adamw.AdamW``), else module and name."""
    if kind.__module__.startswith("torch.optim") and getattr(torch.optim, kind.__name__, None) is kind:
        return f"torch.optim.{kind.__name__}"
    return f"{kind.__module__}.{kind.__qualname__}"
