"""Each ps update rule against the framework's own optimizer, 20 steps on random tensors.

A backend's :meth:`~psdk.plugins.backend.Backend.make_optimizer` claims that the
framework optimizer it returns updates as the ps's rule does. This harness
checks the claim the same way for every backend: the rule, in numpy, and the
framework, from the same start over the same 20 gradients, must end at the
same parameters. A plugin subclasses :class:`RuleAgreement`::

    class TestMyRules(RuleAgreement):
        def framework_steps(self, rule, start, grads):
            ...  # the framework's optimizer for ``rule``, stepped once per gradient
            return final_params

(each case gets its own test id, from the class's own ``pytest_generate_tests``) and lists in
``skipped`` (case id -> reason) the cases its framework computes differently
on purpose, so the difference is written down.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

CASES: dict[str, UpdateRule] = {
    "sgd": SGD(lr=0.1),
    "momentum": SGD(lr=0.05, momentum=0.9),
    "nesterov-l2": SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": Adam(lr=0.01),
    "adam-options": Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
    "adagrad": Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "rmsprop": RMSProp(lr=0.01),
    "rmsprop-centered-momentum": RMSProp(lr=0.01, momentum=0.9, centered=True, weight_decay=0.01),
}
"""The rules compared, by case id: every built-in rule, plain and with its options."""


class RuleAgreement:
    cases: ClassVar[dict[str, UpdateRule]] = CASES
    steps: ClassVar[int] = 20
    size: ClassVar[int] = 1000
    rtol: ClassVar[float] = 1e-5
    atol: ClassVar[float] = 1e-6
    skipped: ClassVar[dict[str, str]] = {}
    """Case ids the framework computes differently, with the reason (shown as the skip reason)."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One test per case of :attr:`cases`: pytest calls a test class's own hook for that class's tests
        only, so installing psdk adds no hook to anyone else's session."""
        if "rule_case" in metafunc.fixturenames:
            metafunc.parametrize("rule_case", list(self.cases))

    def framework_steps(self, rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        """The framework's own optimizer for ``rule``, from ``start``, stepped once per gradient: the result."""
        raise NotImplementedError

    @staticmethod
    def rule_steps(rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        params = start.copy()
        state = rule.new_state(params.size)
        for grad in grads:
            rule.apply(params, grad, state)
        return params

    def test_the_framework_updates_as_the_ps_rule_does(self, rule_case: str) -> None:
        if rule_case in self.skipped:
            pytest.skip(self.skipped[rule_case])
        rule = self.cases[rule_case]
        rng = np.random.default_rng(3)
        start = rng.normal(size=self.size).astype(np.float32)
        grads = [rng.normal(size=self.size).astype(np.float32) for _ in range(self.steps)]
        expected = self.rule_steps(rule, start, grads)
        got = np.asarray(self.framework_steps(rule, start.copy(), [g.copy() for g in grads]), np.float32)
        np.testing.assert_allclose(got, expected, rtol=self.rtol, atol=self.atol, err_msg=f"{rule_case}: {rule}")
