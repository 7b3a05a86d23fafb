"""Overlap on the public API: a gradient computed during the push goes out with the parameters it came from."""

from __future__ import annotations

import numpy as np
import pytest

import psdk
from psdk.errors import PsdkError
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.models import ModelSpec, init_weights
from psdk.ps.rules import SGD

from .conftest import running_ps
from .helpers import FAST, forward_backward

SPEC = ModelSpec(hidden=(8,), input_dim=6, num_classes=3)
RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 32)


def test_overlapped_steps_carry_the_versions_they_were_computed_from() -> None:
    with running_ps(1) as ps:
        backend = NumpyBackend()
        model = backend.build_model(SPEC, init_weights(SPEC, 0))
        with psdk.connect(ps.cluster(1), 0, steps=20, options=FAST, transport=ps.transport) as session:
            opt = psdk.DistributedOptimizer(SGD(lr=0.1), model, session, backend=backend)
            opt.broadcast_parameters()
            forward_backward(model, X, Y)
            pending = opt.start_step(overlap=True, basis=session.client.basis())
            while True:
                forward_backward(model, X, Y)  # while the last push is on its way
                basis = session.client.basis()
                if pending.wait().done:
                    break
                pending = opt.start_step(overlap=True, basis=basis)
            session.finish(wait_s=10)
            stats = session.client.stats()[0]["stats"]
    # One worker: each gradient but the first was computed one version behind the store it reached.
    assert stats["workers"]["0"]["staleness"] == {"0": 1, "1": 19}


def test_overlap_is_refused_in_sync_mode() -> None:
    with running_ps(1) as ps:
        backend = NumpyBackend()
        model = backend.build_model(SPEC, init_weights(SPEC, 0))
        with psdk.connect(ps.cluster(1), 0, steps=1, sync="sync", options=FAST, transport=ps.transport) as session:
            opt = psdk.DistributedOptimizer(SGD(lr=0.1), model, session, backend=backend)
            opt.broadcast_parameters()
            forward_backward(model, X, Y)
            with pytest.raises(PsdkError, match="async and ssp mode only"):
                opt.start_step(overlap=True)
            assert opt.step().done  # the plain step still works (and ends this one-step job)
            session.finish(wait_s=10)
