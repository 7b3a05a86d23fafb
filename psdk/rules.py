"""The ps's update rules under their public name: ``psdk.rules.Adam(lr=1e-3)``.

Pass one to :class:`psdk.DistributedOptimizer` as ``rule=`` when your
framework's optimizer cannot be inspected (optax's are closures) or when you
want the ps's rule stated outright. Rules that plugins add are found with
:func:`psdk.plugins.installed_rules`; see :mod:`psdk.ps.rules` for the semantics.
"""

from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, RuleState, UpdateRule, floor_key

__all__ = ["SGD", "Adagrad", "Adam", "RMSProp", "RuleState", "UpdateRule", "floor_key"]
