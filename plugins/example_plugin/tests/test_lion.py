"""The Lion rule, in numpy, against the paper's update written out element by element."""

from __future__ import annotations

import math

import numpy as np
import pytest
from psdk_example.lion import Lion

from psdk.errors import ConfigError
from psdk.plugins.registry import rule_from_json


def reference(rule: Lion, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    params, m = [float(v) for v in start], [0.0] * len(start)
    for t, g in enumerate(grads):
        lr = rule.lr_at(t)
        for i, gi in enumerate(g.tolist()):
            c = rule.beta1 * m[i] + (1 - rule.beta1) * gi
            params[i] -= lr * (math.copysign(1.0, c) * (c != 0) + rule.weight_decay * params[i])
            m[i] = rule.beta2 * m[i] + (1 - rule.beta2) * gi
    return np.array(params, np.float32)


@pytest.mark.parametrize(
    "rule",
    [
        Lion(lr=0.01),
        Lion(lr=0.003, beta1=0.8, beta2=0.95, weight_decay=0.1),
        Lion(lr=0.01, decay="cosine", decay_rate=0.1, decay_steps=10),
    ],
    ids=["plain", "options", "cosine"],
)
def test_twenty_steps_match_the_paper(rule: Lion) -> None:
    rng = np.random.default_rng(0)
    start = rng.normal(size=200).astype(np.float32)
    grads = [rng.normal(size=200).astype(np.float32) for _ in range(20)]
    params, state = start.copy(), rule.new_state(start.size)
    for g in grads:
        rule.apply(params, g, state)
    np.testing.assert_allclose(params, reference(rule, start, grads), rtol=1e-5, atol=1e-6)
    assert state.step == 20 and set(state.slots) == {"m"}


def test_the_bounds_it_claims_hold() -> None:
    """The store skips its finiteness check when a rule's bounds prove the result finite: they must be true."""
    rule, rng = Lion(lr=0.05, weight_decay=0.2), np.random.default_rng(1)
    params = rng.normal(scale=3, size=500).astype(np.float32)
    state = rule.new_state(params.size)
    for _ in range(10):
        g = rng.normal(scale=5, size=500).astype(np.float32)
        before = (float(np.abs(params).max()), {"m": float(np.abs(state.slots["m"]).max())}, float(np.abs(g).max()))
        bounds = rule.bounds_after(*before)
        rule.apply(params, g, state)
        assert bounds is not None
        assert np.abs(params).max() <= bounds[0] and np.abs(state.slots["m"]).max() <= bounds[1]["m"]


def test_bad_hyper_parameters_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.beta2"):
        Lion(beta2=1.0)
    with pytest.raises(ConfigError, match=r"optimizer\.weight_decay"):
        Lion(weight_decay=-1.0)


def test_the_ps_rebuilds_it_by_name_once_the_plugin_is_installed() -> None:
    """What the chief sends and a checkpoint stores: the rule's JSON, found again through the plugin."""
    rule = Lion(lr=0.002, weight_decay=0.01)
    assert rule_from_json(rule.to_json()) == rule
