"""The JAX backend beyond the conformance suite: its model object, its options, and the functional path.

MNIST's loss and predictions are its trainer's (``test_mnist.py``); the bridge has neither.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from psdk_jax import record_gradients
from psdk_jax.models import DenseStack

import psdk
from psdk import plugins
from psdk.errors import ConfigError, PsdkError
from psdk.plugins.models import ModelSpec, init_weights

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec(hidden=(32, 16), input_dim=50, num_classes=10)


def batch(seed: int = 0, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((size, 50), dtype=np.float32), rng.integers(0, 10, size)


def test_the_model_is_a_params_dict_of_jax_arrays_on_the_backends_device() -> None:
    backend = plugins.load_backend("jax")
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    assert isinstance(model, DenseStack) and backend.owns(model)
    assert sorted(model.params) == sorted(name for name, _ in SPEC.variables())
    for name, shape in SPEC.variables():
        value = model.params[name]
        assert isinstance(value, jax.Array) and value.shape == shape and value.dtype == jnp.float32
        assert value.devices() == {jax.devices()[0]}


def test_a_partial_write_keeps_the_other_weights() -> None:
    backend = plugins.load_backend("jax")
    weights = init_weights(SPEC, 0)
    model = backend.build_model(SPEC, weights)
    backend.write_weights(model, {"logits/bias": np.full(10, 0.5, np.float32)})
    read = backend.read_weights(model)
    np.testing.assert_array_equal(read["logits/bias"], np.full(10, 0.5, np.float32))
    np.testing.assert_array_equal(read["hidden1/kernel"], weights["hidden1/kernel"])
    with pytest.raises(PsdkError, match="no variable 'hidden9/kernel'"):
        backend.write_weights(model, {"hidden9/kernel": np.zeros(3, np.float32)})


def test_the_bridge_has_no_loss_or_metric() -> None:
    """A workload's trainer holds them (psdk refuses a backend that still defines either)."""
    backend = plugins.load_backend("jax")
    assert not hasattr(backend, "forward_backward") and not hasattr(backend, "accuracy")
    assert not hasattr(backend.build_model(SPEC, init_weights(SPEC, 0)), "loss")


def test_an_unknown_matmul_precision_or_option_is_refused_by_key() -> None:
    backend = plugins.load_backend("jax", options={"matmul_precision": "fastest"})
    with pytest.raises(ConfigError, match=r"^backend_options.jax.matmul_precision: got 'fastest'.*highest"):
        backend.build_model(SPEC, init_weights(SPEC, 0))
    with pytest.raises(ConfigError, match=r"^backend_options.jax: the jax backend has no option\(s\) xla_flags"):
        plugins.load_backend("jax", options={"xla_flags": "--x"})


def test_a_script_computes_its_own_gradients_and_steps_the_ps_rule_like_optax(psdk_ps: Any) -> None:
    """The functional path: rule= instead of an optax optimizer, against optax.adam stepped locally."""
    rule, steps = psdk.rules.Adam(lr=0.01), 5
    batches = [batch(10 + t, 32) for t in range(steps)]
    backend = plugins.load_backend("jax")
    model = backend.build_model(SPEC, init_weights(SPEC, 0))

    def loss(params: Any, x: Any, y: Any) -> Any:  # the script's own loss, on the model's apply
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    grad = jax.jit(jax.grad(loss))
    with psdk.connect(psdk_ps.cluster(1), 0, steps=steps, transport=psdk_ps.transport) as session:
        opt = psdk.DistributedOptimizer(None, model, session, rule=rule)  # the backend: the one that owns model
        assert opt.backend.name == "jax"
        opt.broadcast_parameters()
        for x, y in batches:
            record_gradients(model, grad(model.params, x, y))
            opt.step()
        assert session.should_stop()
        session.finish(wait_s=30)
        opt.pull()

    local = backend.build_model(SPEC, init_weights(SPEC, 0))
    params, tx = local.params, optax.adam(0.01)
    state = tx.init(params)
    for x, y in batches:
        updates, state = tx.update(grad(params, x, y), state, params)
        params = optax.apply_updates(params, updates)
    # Adam divides by sqrt(v): where a gradient is near 0, float32 rounding (numpy on the ps, XLA here) is
    # magnified in m / sqrt(v); 1e-5 is a five-hundredth of what the 5 steps of lr 0.01 can move a weight.
    for name, value in backend.read_weights(model).items():
        np.testing.assert_allclose(value, np.asarray(params[name]), rtol=1e-5, atol=1e-5, err_msg=name)


def test_params_set_by_a_script_are_what_the_backend_reads() -> None:
    backend = plugins.load_backend("jax")
    model = backend.build_model(SPEC, init_weights(SPEC, 0))
    model.params = {name: jnp.ones(shape) for name, shape in SPEC.variables()}
    assert all(np.all(value == 1.0) for value in backend.read_weights(model).values())
    with pytest.raises(PsdkError, match="missing"):
        model.params = {"logits/bias": jnp.ones(10)}
    with pytest.raises(PsdkError, match="DenseStack"):
        record_gradients({"logits/bias": jnp.ones(10)}, {})  # type: ignore[arg-type]
