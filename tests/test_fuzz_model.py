"""The stateful fuzzer's reference model: its arithmetic by hand against psdk.ps.rules, its sync rounds, its pauses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from psdk.fuzz.model import Model, Pushed, RuleModel
from psdk.protocol.jobspec import JobSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adagrad, Adam, NoOp, RMSProp, UpdateRule

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("rule", "after"),
    [
        ({"name": "sgd", "lr": 0.1}, [0.95, 0.9]),
        # torch's momentum: the buffer starts at the first gradient, then buf = mu * buf + g.
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, [0.95, 0.855]),
        # Nesterov: the step is mu * buf + g.
        ({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, [0.905, 0.7695]),
    ],
    ids=["sgd", "momentum", "nesterov"],
)
def test_sgd_by_hand(rule: dict[str, Any], after: list[float]) -> None:
    """Two steps of gradient 0.5 from 1.0, worked out on paper."""
    model = RuleModel(rule)
    p, slots = np.ones(1), model.initial_slots(1)
    for t, want in enumerate(after):
        p, slots = model.step(p, np.full(1, 0.5), slots, t)
        assert p[0] == pytest.approx(want, rel=1e-12, abs=1e-12)


RULES: list[UpdateRule] = [
    SGD(lr=0.1),
    SGD(lr=0.5, momentum=0.9, weight_decay=0.01),
    SGD(lr=0.1, momentum=0.8, nesterov=True, decay_rate=0.5, decay_steps=3),
    Adam(lr=0.01),
    Adam(lr=0.01, epsilon_mode="tf", weight_decay=0.1, decay="cosine", decay_rate=0.1, decay_steps=4),
    Adagrad(lr=0.1, initial_accumulator_value=0.1),
    SGD(lr=0.1, momentum=0.9, decay="cosine", decay_rate=0.0, decay_steps=6, warmup_steps=3),
    RMSProp(lr=0.01),
    RMSProp(lr=0.01, momentum=0.9, centered=True),
    NoOp(),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.name}-{abs(hash(r.to_json().__repr__())) % 1000}")
def test_the_models_formulas_agree_with_psdk_optim(rule: UpdateRule) -> None:
    """Two independent statements of each rule (psdk.ps.rules in place in float32, the model's in float64) agree."""
    rng = np.random.default_rng(0)
    model = RuleModel(rule.to_json())
    params = rng.normal(size=50).astype(np.float32)
    state = rule.new_state(50)
    p, slots = params.astype(np.float64), model.initial_slots(50)
    for t in range(6):
        grad = rng.normal(size=50).astype(np.float32)
        rule.apply(params, grad, state)
        p, slots = model.step(p, grad.astype(np.float64), slots, t)
        np.testing.assert_allclose(params, p, rtol=1e-4, atol=1e-6)
        assert set(slots) == set(state.slots)
        for name, slot in state.slots.items():
            np.testing.assert_allclose(slot, slots[name], rtol=1e-4, atol=1e-6)


def _model(mode: str, replicas: int | None = None, steps: int = 100) -> Model:
    model = Model()
    job = JobSpec(SyncSpec(mode, replicas_to_aggregate=replicas).resolved(3), steps, 3).to_json()
    fields = {"names": ["w"], "job": job, "rule": SGD(lr=1.0).to_json()}
    model.init(fields, [np.zeros(2, np.float32)])
    return model


def test_a_sync_round_applies_the_mean_once_and_drops_stale_and_second_gradients() -> None:
    model = _model("sync", replicas=2)
    assert model.submit(Pushed(0, 0, np.array([1.0, 2.0]))) == []
    assert model.submit(Pushed(0, 0, np.array([5.0, 5.0]))) == [(0, "dropped")]  # a second one from worker 0
    assert model.submit(Pushed(1, 0, np.array([3.0, 4.0]))) == [(0, "applied"), (1, "applied")]
    assert model.version == 1 and model.params.tolist() == [-2.0, -3.0]
    assert model.submit(Pushed(2, 0, np.array([1.0, 1.0]))) == [(2, "dropped")]  # computed from version 0


def test_a_pause_holds_pushes_and_the_resume_applies_them_in_order() -> None:
    model = _model("async")
    model.pause_at(1)
    assert model.submit(Pushed(0, 0, np.array([1.0, 1.0]))) == [(0, "applied")]
    assert model.submit(Pushed(1, 1, np.array([2.0, 2.0]))) == []  # at the pause version: held
    assert model.version == 1
    assert model.resume() == [(1, "applied")]
    assert model.version == 2 and model.params.tolist() == [-3.0, -3.0]


def test_an_update_that_would_overflow_float32_is_refused_and_changes_nothing() -> None:
    model = _model("async")
    assert model.submit(Pushed(0, 0, np.array([-3e38, 0.0]))) == [(0, "applied")]
    assert model.submit(Pushed(1, 1, np.array([-3e38, 0.0]))) == [(1, "refused")]
    assert model.version == 1 and model.params[0] == 3e38


def test_the_model_reports_where_a_store_differs() -> None:
    model = _model("async")
    model.submit(Pushed(0, 0, np.array([1.0, 1.0])))
    assert model.compare(1, np.array([-1.0, -1.0], np.float32), {}, 1) == []
    problems = model.compare(2, np.array([-1.0, 1.0], np.float32), {}, 1)
    assert problems[0] == "the ps is at version 2, the model at 1"
    assert problems[1].startswith("parameters differ at 1 of 2 values, e.g. [1]: ps 1, model -1")


def test_a_pause_at_a_later_version_lets_the_pushes_held_so_far_go_on() -> None:
    model = _model("async")
    model.pause_at(0)
    assert model.submit(Pushed(0, 0, np.array([1.0, 1.0]))) == []
    model.pause_at(2)  # the ps submits what it held: it may reach the new target
    assert model.version == 1 and model.held == []
