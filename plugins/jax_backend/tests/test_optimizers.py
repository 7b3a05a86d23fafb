"""optax optimizers and ps update rules: the same updates, the round trip, and clear refusals."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from psdk_jax.optimizers import learning_rate, make_optimizer, optimizer_rule

import psdk
from psdk import plugins
from psdk.errors import ConfigError
from psdk.ps.rules import NoOp
from psdk.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing import RuleAgreement
from psdk.testing.rule_agreement import CASES

pytestmark = pytest.mark.timeout(120)

DIFFERS = {
    "adagrad-big-eps": "optax adds Adagrad's eps inside the root, sqrt(sum + eps); psdk outside, sqrt(sum) + eps",
    "rmsprop-momentum-decay": "optax.rmsprop scales by the decaying rate before its momentum trace, psdk after",
    "adam-tf-eps": "optax.adam's eps is torch's convention; epsilon_mode='tf' has no optax spelling",
}


def steps(tx: optax.GradientTransformation, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    params = jnp.asarray(start)
    state = tx.init(params)
    for grad in grads:
        updates, state = tx.update(jnp.asarray(grad), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params)


class TestOptaxUpdatesAsThePsRuleDoes(RuleAgreement):
    """20 steps of each rule in numpy against its optax transformation (psdk.testing.RuleAgreement)."""

    cases = {
        **CASES,
        "sgd-exponential": SGD(lr=0.1, decay_rate=0.5, decay_steps=5),
        "nesterov-cosine-l2": SGD(
            lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, decay="cosine", decay_rate=0.1, decay_steps=15
        ),
        "adam-decay": Adam(lr=0.01, decay_rate=0.5, decay_steps=10),
        "adagrad-l2": Adagrad(lr=0.1, weight_decay=0.01),
        "rmsprop-momentum": RMSProp(lr=0.01, alpha=0.9, momentum=0.5),
        # The differences the module docstring documents, big enough to show (see the test below).
        "adagrad-big-eps": Adagrad(lr=0.1, eps=0.5),
        "rmsprop-momentum-decay": RMSProp(lr=0.01, momentum=0.9, decay_rate=0.1, decay_steps=10),
        "adam-tf-eps": Adam(lr=0.01, eps=0.1, epsilon_mode="tf"),
    }
    skipped = DIFFERS

    def framework_steps(self, rule: UpdateRule, start: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
        return steps(make_optimizer(rule), start, grads)


@pytest.mark.parametrize("case", sorted(DIFFERS))
def test_the_documented_differences_are_real(case: str) -> None:
    """Each skipped case does differ (so the skip is not hiding a bug it could have caught)."""
    rule = TestOptaxUpdatesAsThePsRuleDoes.cases[case]
    rng = np.random.default_rng(3)
    start = rng.normal(size=1000).astype(np.float32)
    grads = [rng.normal(size=1000).astype(np.float32) for _ in range(20)]
    got, expected = steps(make_optimizer(rule), start, grads), RuleAgreement.rule_steps(rule, start, grads)
    assert not np.allclose(got, expected, rtol=1e-5, atol=1e-6)
    # ... and only in a detail: both moved the parameters the same way.
    assert np.corrcoef(got - start, expected - start)[0, 1] > 0.9


@pytest.mark.parametrize(
    "rule",
    [
        SGD(lr=0.1, decay_rate=0.25, decay_steps=100),
        SGD(lr=0.05, momentum=0.9, decay="cosine", decay_rate=0.0, decay_steps=100),
        SGD(lr=0.05, decay="cosine", decay_rate=0.25, decay_steps=100),
        SGD(lr=0.1, momentum=0.9, decay="cosine", decay_rate=0.0, decay_steps=100, warmup_steps=30),
        Adam(lr=1e-3, warmup_steps=50),
    ],
    ids=["exponential", "cosine-to-0", "cosine-alpha", "cosine-warmup", "constant-warmup"],
)
def test_the_optax_schedule_is_the_rules_decay(rule: UpdateRule) -> None:
    schedule = learning_rate(rule)
    assert callable(schedule)
    for step in (0, 1, 30, 50, 99, 100, 250):
        assert float(schedule(step)) == pytest.approx(rule.lr_at(step), rel=1e-4, abs=1e-9)  # optax runs float32


def test_a_constant_rate_is_a_float_not_a_schedule() -> None:
    assert learning_rate(Adam(lr=1e-3)) == 1e-3


ROUND_TRIP = [
    SGD(lr=0.05, momentum=0.9),
    SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, decay="cosine", decay_rate=0.0, decay_steps=6000),
    Adam(lr=1e-3, eps=1e-7, epsilon_mode="tf", decay_rate=0.5, decay_steps=100),
    Adagrad(lr=0.1, initial_accumulator_value=0.1),
    RMSProp(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=1e-3),
]


@pytest.mark.parametrize("rule", ROUND_TRIP, ids=lambda r: r.name)
def test_an_optimizer_made_here_maps_back_to_its_rule(rule: UpdateRule) -> None:
    tx = make_optimizer(rule)
    assert optimizer_rule(tx) == rule
    assert plugins.backend_for(tx).name == "jax"  # as DistributedOptimizer finds it


def test_each_optimizer_answers_with_its_own_rule() -> None:
    """Many transformations alive at once, each with its rule: nothing is keyed by a reused id."""
    rules = [SGD(lr=0.01 * (i + 1)) for i in range(50)]
    made = [make_optimizer(rule) for rule in rules]
    assert [optimizer_rule(tx) for tx in made] == rules
    for _ in range(50):  # made and dropped: their ids may be reused
        make_optimizer(Adam(lr=0.5))
    assert [optimizer_rule(tx) for tx in made] == rules


REFUSED: list[tuple[Any, str]] = [
    (optax.adam(1e-3), r"^optimizer: an optax optimizer is a pair of closures.*rule=psdk\.rules\.Adam\(lr=1e-3\)"),
    (optax.sgd(0.1, momentum=0.9), "cannot be read"),
    (optax.chain(make_optimizer(SGD(lr=0.1)), optax.clip(1.0)), "cannot be read"),  # clipping: not the rule
    ("adam", r"^optimizer: expected an optax GradientTransformation, got str"),
]


@pytest.mark.parametrize("optimizer, message", REFUSED, ids=["adam", "sgd", "chained", "string"])
def test_optimizers_without_a_known_rule_are_refused_with_what_to_write(optimizer: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        optimizer_rule(optimizer)


def test_a_rule_without_an_optax_optimizer_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no optax optimizer for the rule 'noop'"):
        make_optimizer(NoOp())


def test_distributed_optimizer_refuses_an_optax_optimizer_it_cannot_read(psdk_ps: Any) -> None:
    """What a user who passes optax.adam sees: the rule= path, before anything reaches the ps."""
    backend = plugins.load_backend("jax")
    model = backend.build_model(psdk.ModelSpec(hidden=(4,), input_dim=3, num_classes=2), _weights())
    with psdk.connect(psdk_ps.cluster(1), 0, steps=1, transport=psdk_ps.transport) as session:
        with pytest.raises(ConfigError, match=r"DistributedOptimizer\(None, model, session, rule=psdk\.rules"):
            psdk.DistributedOptimizer(optax.adam(1e-3), model, session)
        session.finish(wait_s=5)


def _weights() -> dict[str, np.ndarray]:
    return psdk.init_weights(psdk.ModelSpec(hidden=(4,), input_dim=3, num_classes=2), 0)
