"""Update rules in numpy (their match with torch.optim is tested in the torch plugin)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from psdk.errors import ConfigError
from psdk.plugins import installed_rules
from psdk.plugins.registry import rule_from_json
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule

RULES = installed_rules()


def run(rule: UpdateRule, grads: list[np.ndarray], start: np.ndarray) -> np.ndarray:
    params = start.copy()
    state = rule.new_state(params.size)
    for g in grads:
        g = g.copy()
        g.flags.writeable = False  # rules must never write into a received gradient
        rule.apply(params, g, state)
    return params


def test_plain_sgd_is_p_minus_lr_g() -> None:
    g = np.array([1.0, -2.0, 0.5], np.float32)
    out = run(SGD(lr=0.1), [g, g], np.zeros(3, np.float32))
    np.testing.assert_allclose(out, -0.2 * g, rtol=1e-6, atol=1e-7)


def test_momentum_matches_its_closed_form() -> None:
    g = np.array([1.0, 2.0], np.float32)
    out = run(SGD(lr=0.1, momentum=0.9), [g, g, g], np.zeros(2, np.float32))
    # buffers: g, 1.9 g, 2.71 g
    np.testing.assert_allclose(out, -0.1 * (1 + 1.9 + 2.71) * g, rtol=1e-6, atol=1e-6)


def test_adam_first_step_moves_each_weight_by_lr() -> None:
    g = np.array([3.0, -0.5, 1e-3], np.float32)
    out = run(Adam(lr=0.01, eps=1e-12), [g], np.zeros(3, np.float32))
    np.testing.assert_allclose(out, -0.01 * np.sign(g), rtol=1e-4, atol=1e-7)


def test_adam_epsilon_conventions_differ_only_through_eps() -> None:
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=50).astype(np.float32) * 1e-4 for _ in range(5)]
    start = np.zeros(50, np.float32)
    torch_style = run(Adam(lr=0.01, eps=1e-3), grads, start)
    tf_style = run(Adam(lr=0.01, eps=1e-3, epsilon_mode="tf"), grads, start)
    assert not np.allclose(torch_style, tf_style, rtol=1e-3, atol=1e-6)  # apart by more than is allowed below
    np.testing.assert_allclose(
        run(Adam(lr=0.01, eps=1e-14), grads, start),
        run(Adam(lr=0.01, eps=1e-14, epsilon_mode="tf"), grads, start),
        rtol=1e-3,
        atol=1e-6,  # the weights end 3e-4 .. 5e-2 from 0
    )


def test_weight_decay_adds_l2_gradient() -> None:
    start = np.array([2.0, -4.0], np.float32)
    zero = np.zeros(2, np.float32)
    np.testing.assert_allclose(run(SGD(lr=0.5, weight_decay=0.1), [zero], start), start * (1 - 0.05), atol=1e-6)


def test_exponential_decay_lowers_the_learning_rate() -> None:
    rule = SGD(lr=1.0, decay_rate=0.5, decay_steps=2)
    assert [rule.lr_at(t) for t in (0, 2, 4)] == [1.0, 0.5, 0.25]
    g = np.ones(1, np.float32)
    np.testing.assert_allclose(run(rule, [g, g], np.zeros(1, np.float32)), [-(1.0 + 0.5**0.5)], rtol=1e-6, atol=1e-6)


def test_cosine_decay_falls_by_half_a_cosine_to_its_floor_and_stays() -> None:
    rule = SGD(lr=1.0, decay="cosine", decay_rate=0.2, decay_steps=4)
    assert [rule.lr_at(t) for t in (0, 2, 4, 9)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    assert SGD(lr=1.0, decay="cosine", decay_rate=0.0, decay_steps=4).lr_at(4) == 0.0  # a cosine may end at 0
    g = np.ones(1, np.float32)  # the rule's own updates follow it: 1.0, then 0.2 + 0.8 * (1 + cos(pi/4)) / 2
    np.testing.assert_allclose(
        run(rule, [g, g], np.zeros(1, np.float32)), [-(1.0 + 0.6 + 0.4 * 0.5**0.5)], rtol=1e-6, atol=1e-6
    )


def test_warmup_climbs_linearly_onto_the_decay_schedule() -> None:
    rule = SGD(lr=1.0, decay="cosine", decay_rate=0.2, decay_steps=4, warmup_steps=2)
    assert [rule.lr_at(t) for t in (0, 2, 4)] == pytest.approx([0.5, 0.6, 0.2])  # t=0 at half its rate
    constant = SGD(lr=0.1, warmup_steps=4)
    assert [constant.lr_at(t) for t in range(6)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    g = np.ones(1, np.float32)  # the rule's own updates follow it: 0.5 * 1.0, then 0.2 + 0.8 * (1 + cos(pi/4)) / 2
    np.testing.assert_allclose(
        run(rule, [g, g], np.zeros(1, np.float32)), [-(0.5 + 0.6 + 0.4 * 0.5**0.5)], rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ConfigError, match=r"optimizer\.warmup_steps"):
        SGD(lr=0.1, warmup_steps=-1)


@pytest.mark.parametrize(
    "rule",
    [
        SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        Adam(weight_decay=0.01),
        Adagrad(initial_accumulator_value=0.1),
        RMSProp(momentum=0.9, centered=True, weight_decay=0.01),
    ],
)
def test_every_rule_descends_a_quadratic(rule: UpdateRule) -> None:
    target = np.linspace(-1, 1, 20, dtype=np.float32)
    params = np.zeros(20, np.float32)
    state = rule.new_state(20)
    for _ in range(300):
        rule.apply(params, params - target, state)
    assert np.abs(params - target).max() < np.abs(target).max()


@pytest.mark.parametrize("name", sorted(RULES))
def test_rules_survive_the_trip_to_the_ps(name: str) -> None:
    rule = RULES[name](lr=0.123)
    assert rule_from_json(rule.to_json()) == rule


@pytest.mark.parametrize(
    "data, key",
    [
        ({"name": "lbfgs", "lr": 1.0}, "optimizer"),
        ({"name": "sgd", "lr": 1.0, "betas": 2}, "betas"),
        ({"name": "sgd", "lr": -1.0}, "optimizer.lr"),
        ({"name": "sgd", "lr": float("nan")}, "optimizer.lr"),
        ({"name": "adam", "lr": 0.1, "beta1": 1.5}, "optimizer.beta1"),
        ({"name": "adam", "lr": 0.1, "epsilon_mode": "keras"}, "optimizer.epsilon_mode"),
        ({"name": "sgd", "lr": 0.1, "nesterov": True}, "optimizer.nesterov"),
        ({"name": "sgd", "lr": 0.1, "decay_rate": 2.0}, "optimizer.decay_rate"),
        ({"name": "sgd", "lr": 0.1, "decay_rate": 0.0}, "optimizer.decay_rate"),  # exponential never reaches 0
        ({"name": "sgd", "lr": 0.1, "decay": "linear"}, "optimizer.decay"),
        ({"name": "sgd", "lr": 0.1, "decay": ["cosine"]}, "optimizer.decay"),
    ],
)
def test_bad_rules_are_refused_with_the_key(data: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        rule_from_json(data)
    assert key in str(info.value)


def test_slots_are_flat_buffers_beside_the_parameters() -> None:
    state = RMSProp(momentum=0.9, centered=True).new_state(7)
    assert sorted(state.slots) == ["grad_avg", "momentum", "square_avg"]
    assert all(s.shape == (7,) and s.dtype == np.float32 for s in state.slots.values())
    assert dataclasses.is_dataclass(SGD())
