"""The stateful fuzzer's reference model: its arithmetic by hand against psdk.ps.rules, its sync rounds, its pauses,
its embedding tables (rows created, admitted, updated lazily, averaged per round) against psdk's served table."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from psdk.fuzz.model import Model, Pushed, RuleModel
from psdk.fuzz.rows import RowRequest, TableState, row_request
from psdk.protocol.jobspec import JobSpec
from psdk.protocol.tables import TableSpec
from psdk.ps.consistency import SyncSpec
from psdk.ps.rules import SGD, Adagrad, Adam, NoOp, RMSProp, UpdateRule
from psdk.ps.tables.hashing import initial_rows, table_key
from psdk.ps.tables.served import RowGrad, ServedTable

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


# ------------------------------------------------------------------ tables
USERS = {"name": "users", "dim": 3, "capacity": 8, "init_scale": 0.05, "seed": 3, "max_ids": 16}


def _table_model(
    mode: str = "async", replicas: int | None = None, rule: UpdateRule | None = None, **spec: Any
) -> Model:
    model = Model()
    job = JobSpec(SyncSpec(mode, replicas_to_aggregate=replicas).resolved(3), 100, 3).to_json()
    tables = {"shard": 0, "num_ps": 1, "specs": [{**USERS, **spec}]}
    fields = {"names": ["w"], "job": job, "rule": (rule or SGD(lr=1.0)).to_json(), "tables": tables}
    model.init(fields, [np.zeros(2, np.float32)])
    return model


def _rows(pushes: dict[str, tuple[list[int], list[list[float]]]] | None = None, pulls: Any = ()) -> RowRequest:
    request = RowRequest()
    for name, (ids, rows) in (pushes or {}).items():
        request.pushes[name] = (np.array(ids, np.int64), np.array(rows, np.float64))
    request.pulls = [(name, np.array(ids, np.int64), create) for name, ids, create in pulls]
    return request


def test_a_training_pull_creates_rows_from_the_seed_and_a_read_creates_none() -> None:
    model = _table_model()
    table = model.tables["users"]
    read = table.lookup(np.array([4, 9], np.int64), create=False)
    assert read is not None and not read.any() and table.rows == {}
    pulled = table.lookup(np.array([4, 9], np.int64), create=True)
    key = table_key(3, "users")
    np.testing.assert_array_equal(pulled, initial_rows(np.array([4, 9], np.int64), 3, key, "normal", 0.05))
    assert sorted(table.rows) == [4, 9]


def test_an_id_is_admitted_on_its_nth_training_pull_and_reads_zeros_until_then() -> None:
    table = _table_model(admit_after=2).tables["users"]
    first = table.lookup(np.array([5], np.int64), create=True)
    assert first is not None and not first.any() and table.rows == {}
    second = table.lookup(np.array([5], np.int64), create=True)
    assert second is not None and second.any() and list(table.rows) == [5]


def test_a_push_moves_only_the_rows_it_touches_and_drops_ids_without_a_row() -> None:
    model = _table_model()
    table = model.tables["users"]
    table.lookup(np.array([1, 2], np.int64), create=True)
    before = {i: row.copy() for i, row in table.rows.items()}
    push = Pushed(0, 0, np.zeros(2), _rows({"users": ([1, 7], [[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])}))
    assert model.submit(push) == [(0, "applied")]
    np.testing.assert_allclose(table.rows[1], before[1] - [1.0, 2.0, 3.0])  # SGD, lr 1
    np.testing.assert_array_equal(table.rows[2], before[2])
    assert table.dropped == 1 and 7 not in table.rows


def test_a_sync_round_sums_rows_per_id_and_divides_by_replicas_to_aggregate() -> None:
    model = _table_model("sync", replicas=2)
    table = model.tables["users"]
    table.lookup(np.array([1, 2], np.int64), create=True)
    before = {i: row.copy() for i, row in table.rows.items()}
    one = Pushed(0, 0, np.zeros(2), _rows({"users": ([1, 2], [[2.0] * 3, [4.0] * 3])}), key=(0, 1))
    two = Pushed(1, 0, np.zeros(2), _rows({"users": ([1], [[6.0] * 3])}, pulls=[("users", [2, 3], True)]), key=(1, 1))
    assert model.submit(one) == []
    assert model.submit(two) == [(0, "applied"), (1, "applied")]
    np.testing.assert_allclose(table.rows[1], before[1] - 4.0)  # (2 + 6) / 2
    np.testing.assert_allclose(table.rows[2], before[2] - 2.0)  # 4 / 2: a row one gradient held
    request, replied = model.replied[(1, 1)]
    assert request is two.rows and 3 in table.rows  # its reply's pull created row 3, after the update
    np.testing.assert_array_equal(replied[0], np.array([table.rows[2], table.rows[3]]))


def test_a_table_whose_rows_pass_its_capacity_is_no_longer_followed() -> None:
    table = _table_model().tables["users"]
    assert table.lookup(np.arange(8, dtype=np.int64), create=True) is not None
    assert table.lookup(np.array([20], np.int64), create=True) is None and not table.followed


@pytest.mark.parametrize(
    "rule",
    [
        SGD(lr=0.1),
        SGD(lr=0.5, momentum=0.9),
        Adam(lr=0.01),
        Adagrad(lr=0.1, initial_accumulator_value=0.1),
        RMSProp(lr=0.01, centered=True),
    ],
    ids=lambda r: r.name,
)
def test_the_models_rows_agree_with_the_served_table(rule: UpdateRule) -> None:
    """Lazy updates of touched rows at the shard's step, by the model's formulas and by psdk's ServedTable."""
    spec = TableSpec(**{**USERS, "capacity": 16})
    served = ServedTable(spec, 0, 1, rule)
    table = _table_model(rule=rule, capacity=16).tables["users"]
    rng = np.random.default_rng(1)
    for step in range(6):
        ids = np.sort(rng.choice(10, size=4, replace=False)).astype(np.int64)
        served.pull(ids)
        table.lookup(ids, create=True)
        grad = rng.normal(size=(4, 3)).astype(np.float32)
        served.commit(served.stage_update(RowGrad(ids, grad), rule, step, scale=0.5))
        staged = table.stage(ids, grad.astype(np.float64) * 0.5, step)
        assert staged is not None
        table.commit(staged)
    ids, rows = served.rows.export()
    held = TableState(ids, rows, served.rows.gather(ids)[1], served.rows.evicted, served.dropped_rows)
    assert table.compare(held, 1e-4, 1e-6) == []
    held.rows[0, 0] += 0.01
    assert table.compare(held, 1e-4, 1e-6)[0].startswith("table 'users''s rows differ at 1 of")


def test_the_table_part_of_a_request_reads_as_the_ps_does() -> None:
    ids, rows, pulled = np.array([1, 4], np.int64), np.ones((2, 3), np.float32), np.array([2], np.int64)
    entries = [{"table": "users", "push": True, "pull": True, "read": True}]
    request = row_request(entries, [ids, rows, pulled])
    assert request is not None and list(request.pushes) == ["users"] and request.pulls[0][2] is False
    assert row_request(entries, [ids, rows]) is None  # a frame short
    assert row_request(None, [ids]) is None and row_request(None, []) == RowRequest()
