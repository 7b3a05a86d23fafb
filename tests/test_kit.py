"""psdk.plugins.backends.kit: what every backend shares, tested once here rather than in each plugin."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import NamedTuple

import numpy as np
import pytest

from psdk.errors import ConfigError
from psdk.plugins.backends import kit
from psdk.ps.rules import SGD, Adam


def test_device_strings_parse_and_a_missing_gpu_falls_back_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert [kit.gpu_index(d) for d in ("cpu", "cuda", "cuda:3")] == [None, 0, 3]
    with pytest.raises(ConfigError, match=r"placement\.device: cannot place a worker on 'tpu:0'"):
        kit.gpu_index("tpu:0")
    assert kit.fall_back_to_cpu("cuda:1", 2, "mylib") == "cuda:1"
    with caplog.at_level(logging.WARNING):
        assert kit.fall_back_to_cpu("cuda:2", 2, "mylib") == "cpu"
        assert kit.fall_back_to_cpu("cuda", 0, "mylib") == "cpu"
    assert "mylib sees 2 GPU(s), so there is no cuda:2" in caplog.text and "mylib sees no GPU" in caplog.text


def test_options_the_ps_cannot_run_are_refused_by_name() -> None:
    kit.refuse_options(
        "SGD", {"dampening": 0, "maximize": False, "weight_decay": 0.0}, {"dampening": 0, "maximize": False}
    )
    kit.refuse_options("Adam", {"clipnorm": None}, {"clipnorm": None})
    with pytest.raises(ConfigError, match=r"optimizer\.dampening: SGD\(dampening=0\.5\) has no ps update rule"):
        kit.refuse_options("SGD", {"dampening": 0.5}, {"dampening": 0})
    assert "rule=psdk.rules" in str(kit.no_rule_for("mylib.LBFGS", ["mylib.SGD"]))


class Closures(NamedTuple):
    """Like an optax optimizer: no attributes can be set, no weak reference taken."""

    init: object
    update: object


def test_a_remembered_rule_survives_objects_without_attributes_and_dies_with_them() -> None:
    def update() -> None: ...

    optimizer = Closures(init=None, update=update)
    rule = Adam(lr=1e-3, epsilon_mode="tf")
    kit.remember_rule(optimizer, rule)
    assert kit.remembered_rule(optimizer) == rule
    assert kit.remembered_rule(Closures(init=None, update=lambda: None)) is None
    alive = weakref.ref(update)
    del optimizer, update
    gc.collect()
    assert alive() is None  # the table held it weakly


def test_a_kept_rule_answers_only_while_the_framework_agrees_in_float32() -> None:
    kept = SGD(lr=0.05, momentum=0.9, decay="cosine", decay_rate=0.0, decay_steps=100)
    seen = SGD(lr=float(np.float32(0.05)), momentum=0.9)  # what a framework holding float32 reports
    assert kit.kept_if_same(seen, kept, frozenset({"decay", "decay_rate", "decay_steps"})) is kept
    changed = SGD(lr=0.1, momentum=0.9)
    assert kit.kept_if_same(changed, kept, frozenset({"decay", "decay_rate", "decay_steps"})) is changed
    assert kit.kept_if_same(seen, Adam(lr=0.05), frozenset()) is seen
