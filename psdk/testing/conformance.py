"""The backend conformance suite: what every backend plugin must do, held to the numpy reference.

A plugin's tests subclass :class:`BackendConformance` and name their backend::

    # plugins/mybackend/tests/test_conformance.py
    from psdk.testing import BackendConformance

    class TestMyBackendConformance(BackendConformance):
        backend_name = "mybackend"

pytest then runs every check below against the installed backend of that
name (found through the ``psdk`` entry points, as a job finds it). The
reference is :class:`psdk.plugins.backends.numpy_backend.NumpyBackend`, the contract
at its plainest: same :func:`~psdk.plugins.models.init_weights`, same batch, so any
difference is the backend's. Tolerances are class attributes a subclass may
loosen, with a comment saying why.

The one line is enough; a subclass may also say more:

* :meth:`BackendConformance.refused_optimizers`: framework optimizers the ps
  must refuse (``torch.optim.SGD(..., dampening=0.5)``), each under the
  option its error must name;
* :attr:`BackendConformance.inspectable_optimizers` ``= False`` for a
  framework whose optimizers cannot be read (optax's are closures): an
  optimizer the backend did not make must then be refused with a message
  that shows ``rule=``, the way to state the ps rule instead.

The suite builds models on a backend fresh from :func:`psdk.plugins.load_backend`,
without :meth:`~psdk.plugins.backend.Backend.setup` (only the placement checks call it):
a backend must build, train and evaluate on its default device as it is made.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

import psdk
from psdk import plugins
from psdk.errors import ConfigError
from psdk.launch.placement import visible_gpus
from psdk.plugins.backend import Backend
from psdk.plugins.backends.numpy_backend import NumpyBackend
from psdk.plugins.hookspecs import ModelRecord
from psdk.plugins.models import ModelSpec, init_weights
from psdk.protocol.sharding import flat_size, layout, views
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing.ps import RunningPs, running_ps

# Frameworks that listing backends must never import, whichever plugin is tested.
KNOWN_FRAMEWORKS = ("jax", "keras", "tensorflow", "torch")
MAPPED_RULES: dict[str, UpdateRule] = {
    "sgd": SGD(lr=0.1),
    "momentum": SGD(lr=0.05, momentum=0.9),
    "nesterov-l2": SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": Adam(lr=0.001),
    "adam-options": Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
    "adam-tf-epsilon": Adam(lr=0.001, eps=1e-7, epsilon_mode="tf"),
    "adagrad": Adagrad(lr=0.1, initial_accumulator_value=0.1, weight_decay=1e-4),
    "rmsprop": RMSProp(lr=0.01),
    "rmsprop-centered": RMSProp(lr=0.01, alpha=0.9, centered=True),
    "rmsprop-momentum": RMSProp(lr=0.01, momentum=0.9, weight_decay=1e-4),
    "rmsprop-centered-momentum": RMSProp(lr=0.001, momentum=0.5, centered=True, eps=1e-7),
    "exponential-decay": SGD(lr=0.1, momentum=0.9, decay_rate=0.5, decay_steps=100),
    "cosine-decay": Adam(lr=0.001, decay="cosine", decay_rate=0.0, decay_steps=6000),
}
"""Every built-in rule, plain and with each of its options: what make_optimizer/optimizer_rule must round-trip."""


def random_batch(spec: ModelSpec, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` random inputs of ``spec`` and labels, from ``seed``: the batches every backend is held to."""
    rng = np.random.default_rng(seed)
    return rng.random((size, spec.input_dim), dtype=np.float32), rng.integers(0, spec.num_classes, size)


def _random_weights(spec: Any, seed: int) -> dict[str, np.ndarray]:
    """Weights no backend would start from: every bias non-zero, so a dropped bias shows."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, shape in spec.variables()}


def _plugin_spec(record: ModelRecord) -> Any:
    """The spec of a model a plugin registered, with its defaults (as ``model=<name>`` alone gives it)."""
    cls = plugins.load_target(record.target, f"the spec of model {record.name!r}")
    named = dataclasses.is_dataclass(cls) and any(f.name == "name" for f in dataclasses.fields(cls))
    return cls(name=record.name) if named else cls()


def _initial_weights(spec: Any, seed: int) -> dict[str, np.ndarray]:
    made = getattr(spec, "init_weights", None)
    return dict(made(seed)) if callable(made) else init_weights(spec, seed)


def _flat_views(spec: ModelSpec) -> dict[str, np.ndarray]:
    """Zeroed gradient buffers shaped as the ps client hands them out: views of one flat array."""
    specs = layout(spec.variables())
    return views(np.zeros(flat_size(specs), np.float32), specs)


class BackendConformance:
    backend_name: ClassVar[str]
    """The name the backend is registered under (``backend=`` in a job)."""

    spec: ClassVar[ModelSpec] = ModelSpec(name="conformance", hidden=(32, 16), input_dim=50, num_classes=10)
    """The MLP-like network most checks build: two hidden layers, so a mistake between layers shows."""
    softmax_spec: ClassVar[ModelSpec] = ModelSpec(name="softmax", hidden=(), input_dim=50, num_classes=10)
    """Softmax regression (``model=softmax``): one layer, no ReLU."""
    inspectable_optimizers: ClassVar[bool] = True
    """Whether :meth:`~psdk.plugins.backend.Backend.optimizer_rule` can read a framework optimizer's kind and settings.

    ``False`` for closures (optax): only optimizers ``make_optimizer`` made map
    back (it remembers their rule, :func:`psdk.plugins.backends.kit.remember_rule`), and
    any other must be refused with a message showing ``rule=``.
    """
    loss_rtol: ClassVar[float] = 1e-5
    loss_atol: ClassVar[float] = 1e-6
    """Added to ``loss_rtol``: the loss (order 1 here) is float32 arithmetic whose last digits differ by CPU."""
    grad_rtol: ClassVar[float] = 1e-4
    grad_atol: ClassVar[float] = 1e-6
    train_atol: ClassVar[float] = 1e-5
    """Weights after a few steps through a ps, against the same steps in numpy."""

    # -------------------------------------------------------------- fixtures
    @pytest.fixture
    def backend(self) -> Backend:
        return plugins.load_backend(self.backend_name)

    @pytest.fixture
    def reference(self) -> NumpyBackend:
        return NumpyBackend()

    @pytest.fixture
    def ps(self) -> Iterator[RunningPs]:
        with running_ps() as ps:
            yield ps

    def build(self, backend: Backend, weights: dict[str, np.ndarray] | None = None) -> Any:
        return backend.build_model(self.spec, init_weights(self.spec, 0) if weights is None else weights)

    def refused_optimizers(self, model: Any) -> Mapping[str, Any]:
        """Framework optimizers for ``model`` that the ps must refuse, each under the text its error must show.

        The text is the option the ps cannot run (``"dampening"``), or the
        optimizer's name for a type without a rule (``"AdamW"``)::

            def refused_optimizers(self, model):
                params = list(model.parameters())
                return {"dampening": torch.optim.SGD(params, lr=0.1, dampening=0.5),
                        "AdamW": torch.optim.AdamW(params)}
        """
        return {}

    # ---------------------------------------------------------- registration
    def test_it_is_registered_under_its_name(self) -> None:
        installed = plugins.installed_backends()
        assert self.backend_name in installed, f"no backend {self.backend_name!r} among {sorted(installed)}"
        backend = plugins.load_backend(self.backend_name)
        assert isinstance(backend, Backend) and backend.name == self.backend_name

    def test_its_identity_is_its_records(self, backend: Backend) -> None:
        """Name, framework and aliases come from the plugin's record, also for an instance made directly."""
        record = plugins.installed_backends()[self.backend_name].record
        assert backend.record == record and backend.name == self.backend_name
        direct = type(backend)()  # no load_backend: the record is found by the class, i.e. by its target
        assert direct.record == record, f"{record.target} does not name {type(backend).__qualname__}"
        for alias in record.aliases:
            assert plugins.resolve_backend_name(alias) == self.backend_name, alias
        assert importlib.util.find_spec(record.framework) is not None, f"framework {record.framework!r} is no module"

    def test_registering_it_imports_no_framework(self) -> None:
        """Listing every kind of plugin (which imports each registration module) loads no framework.

        The plugin's own package is imported to register it, so it is no
        evidence either way and is never counted, even if listed in ``modules``.
        """
        record = plugins.installed_backends()[self.backend_name].record
        own = record.target.split(".")[0]
        frameworks = sorted({record.framework, *record.modules, *KNOWN_FRAMEWORKS} - {"psdk", own})
        code = (
            "import json, sys\n"
            "from psdk import plugins\n"
            "plugins.installed_backends(); plugins.installed_rules(); plugins.installed_models()\n"
            "plugins.installed_datasets()\n"
            f"loaded = sorted(m for m in {frameworks!r} if m in sys.modules)\n"
            f"print(json.dumps({{'module': {record.target!r}, 'loaded': loaded}}))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["loaded"] == [], f"registering via {result['module']} imported {result['loaded']}"

    # -------------------------------------------------------- canonical layout
    def test_variables_are_the_specs_in_order_and_shape(self, backend: Backend) -> None:
        model = self.build(backend)
        assert list(backend.variables(model).items()) == self.spec.variables()

    def test_weights_read_back_as_built(self, backend: Backend) -> None:
        weights = init_weights(self.spec, 1)
        read = backend.read_weights(self.build(backend, weights))
        assert list(read) == [name for name, _ in self.spec.variables()]
        for name, value in weights.items():
            assert read[name].dtype == np.float32 and read[name].flags.c_contiguous, name
            np.testing.assert_array_equal(read[name], value, err_msg=name)

    def test_weights_round_trip_through_the_canonical_layout(self, backend: Backend) -> None:
        model = self.build(backend)
        written = _random_weights(self.spec, 7)
        kept = {name: value.copy() for name, value in written.items()}
        backend.write_weights(model, written)
        for value in written.values():
            value += 1.0  # the caller keeps its arrays: the model must hold copies
        read = backend.read_weights(model)
        for name, value in kept.items():
            np.testing.assert_array_equal(read[name], value, err_msg=name)
        for value in read.values():
            value += 1.0  # and read_weights hands out copies
        for name, value in backend.read_weights(model).items():
            np.testing.assert_array_equal(value, kept[name], err_msg=name)

    @pytest.mark.parametrize("model", ["mlp", "softmax"])
    def test_each_builtin_model_builds_and_matches_the_reference(
        self, backend: Backend, reference: NumpyBackend, model: str
    ) -> None:
        """Both dense specs psdk ships (hidden layers, and none: softmax regression) build as numpy's do."""
        spec = self.spec if model == "mlp" else self.softmax_spec
        weights = _random_weights(spec, 11)
        built, ref = backend.build_model(spec, weights), reference.build_model(spec, weights)
        assert list(backend.variables(built).items()) == spec.variables()
        for name, value in backend.read_weights(built).items():
            np.testing.assert_array_equal(value, weights[name], err_msg=name)
        x, y = random_batch(spec, 64, 12)
        assert backend.forward_backward(built, x, y) == pytest.approx(
            reference.forward_backward(ref, x, y), rel=self.loss_rtol, abs=self.loss_atol
        )
        grads, expected = _flat_views(spec), _flat_views(spec)
        backend.read_gradients(built, grads)
        reference.read_gradients(ref, expected)
        for name in expected:
            np.testing.assert_allclose(
                grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
            )

    def test_models_from_plugins_build_on_it(self, backend: Backend) -> None:
        """Every installed model plugin with a builder for this backend: canonical variables, weights both ways."""
        records = [r for r in plugins.installed_models().values() if self.backend_name in r.builders]
        if not records:
            pytest.skip(f"no installed model plugin has a builder for {self.backend_name}")
        for record in records:
            spec = _plugin_spec(record)
            builder = plugins.load_target(record.builders[self.backend_name], f"the builder of {record.name!r}")
            weights = _initial_weights(spec, 0)
            model = builder(backend, spec, weights)
            expected = [(name, tuple(shape)) for name, shape in spec.variables()]
            assert list(backend.variables(model).items()) == expected, record.name
            for name, value in backend.read_weights(model).items():
                np.testing.assert_array_equal(value, weights[name], err_msg=f"{record.name}: {name}")
            written = _random_weights(spec, 13)
            backend.write_weights(model, written)
            for name, value in backend.read_weights(model).items():
                np.testing.assert_array_equal(value, written[name], err_msg=f"{record.name}: {name}")

    # --------------------------------------------------- loss and gradients
    def test_loss_and_gradients_match_the_numpy_reference(
        self,
        backend: Backend,
        reference: NumpyBackend,
    ) -> None:
        first = init_weights(self.spec, 2)
        model, ref = self.build(backend, first), reference.build_model(self.spec, first)
        for step, weights in enumerate((None, _random_weights(self.spec, 3))):
            if weights is not None:  # a write must reach the next forward pass
                backend.write_weights(model, weights)
                reference.write_weights(ref, weights)
            x, y = random_batch(self.spec, 64, step)
            loss = backend.forward_backward(model, x, y)
            assert loss == pytest.approx(reference.forward_backward(ref, x, y), rel=self.loss_rtol, abs=self.loss_atol)
            grads, expected = _flat_views(self.spec), _flat_views(self.spec)
            backend.read_gradients(model, grads)
            reference.read_gradients(ref, expected)
            for name in expected:
                np.testing.assert_allclose(
                    grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
                )

    def test_accuracy_agrees_with_the_reference_on_the_same_weights(
        self, backend: Backend, reference: NumpyBackend
    ) -> None:
        model, ref = self.build(backend), reference.build_model(self.spec, init_weights(self.spec, 0))
        weights = _random_weights(self.spec, 4)
        backend.write_weights(model, weights)
        reference.write_weights(ref, weights)
        x, y = random_batch(self.spec, 600, 5)
        logits, _ = ref.logits(x)
        y[::2] = np.argmax(logits, axis=1)[::2]  # half right by construction: not a trivial 0.1
        expected = reference.accuracy(ref, x, y)
        assert expected > 0.45
        assert backend.accuracy(model, x, y) == expected

    # ------------------------------------------------------------- placement
    def test_setup_on_the_cpu_stays_on_the_cpu(self, backend: Backend) -> None:
        backend.setup("cpu", threads=1)
        assert backend.device == "cpu"

    def test_cuda_without_a_gpu_falls_back_to_the_cpu(self, backend: Backend) -> None:
        if visible_gpus():
            pytest.skip("this machine has a GPU")
        backend.setup("cuda:0", threads=1)
        assert backend.device == "cpu"
        x, y = random_batch(self.spec, 8, 0)
        assert np.isfinite(backend.forward_backward(self.build(backend), x, y))

    # ------------------------------------------------------------- optimizer
    @pytest.mark.parametrize("case", list(MAPPED_RULES))
    def test_its_optimizer_maps_back_to_the_same_rule(self, backend: Backend, case: str) -> None:
        """make_optimizer then optimizer_rule gives the rule back, every option included."""
        rule = MAPPED_RULES[case]
        optimizer = backend.make_optimizer(self.build(backend), rule)
        try:
            assert backend.optimizer_rule(optimizer) == rule
        except ConfigError as exc:
            if self.inspectable_optimizers or "rule=" not in str(exc):
                raise
        assert backend.owns(optimizer)
        assert plugins.backend_for(optimizer).name == self.backend_name  # as DistributedOptimizer finds it

    def test_optimizers_the_ps_cannot_run_are_refused_by_name(self, backend: Backend) -> None:
        """Not an optimizer at all, and each of :meth:`refused_optimizers`: a ConfigError that names the problem."""
        with pytest.raises(ConfigError) as refused:
            backend.optimizer_rule(object())
        if not self.inspectable_optimizers:
            assert "rule=" in str(refused.value), f"the refusal does not say how to pass the rule: {refused.value}"
        for option, optimizer in self.refused_optimizers(self.build(backend)).items():
            with pytest.raises(ConfigError) as refused:
                backend.optimizer_rule(optimizer)
            assert option in str(refused.value), f"refusing {option}: {refused.value}"

    def test_it_owns_its_own_objects_and_no_others(self, backend: Backend) -> None:
        """``owns`` (how DistributedOptimizer finds the backend) says yes to its model and optimizer only."""
        model = self.build(backend)
        optimizer = backend.make_optimizer(model, SGD(lr=0.1))
        assert backend.owns(model) and backend.owns(optimizer)
        assert plugins.backend_for(model).name == self.backend_name  # rule= without an optimizer
        assert not backend.owns(np.zeros(3, np.float32))
        if not isinstance(optimizer, UpdateRule):  # numpy's optimizers are psdk's rules themselves
            assert not backend.owns(SGD(lr=0.1))

    # ------------------------------------------------------------ public API
    def test_it_trains_through_a_ps_as_numpy_does(
        self, backend: Backend, reference: NumpyBackend, ps: RunningPs
    ) -> None:
        """Five SGD steps of one worker through a real ps equal five local numpy steps."""
        rule, steps = SGD(lr=0.5), 5
        batches = [random_batch(self.spec, 32, 10 + t) for t in range(steps)]
        model = self.build(backend)
        with psdk.connect(ps.cluster(1), 0, steps=steps, transport=ps.transport) as session:
            opt = psdk.DistributedOptimizer(backend.make_optimizer(model, rule), model, session)
            opt.broadcast_parameters()
            for x, y in batches:
                backend.forward_backward(model, x, y)
                opt.step()
            assert session.should_stop()
            session.finish(wait_s=30)
            opt.pull()
        assert session.global_step == steps
        ref = reference.build_model(self.spec, init_weights(self.spec, 0))
        for x, y in batches:
            reference.forward_backward(ref, x, y)
            ref.flat -= rule.lr * ref.grad_flat
        for name, value in backend.read_weights(model).items():
            np.testing.assert_allclose(value, ref.params[name], rtol=0, atol=self.train_atol, err_msg=name)
