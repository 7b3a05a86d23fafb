"""The conformance suites: a framework bridge, and a workload's trainer on one, each held to the numpy reference.

A framework plugin provides two things, and its tests check each apart:

* a **bridge** (its :class:`~psdk.plugins.backend.Backend`): variables,
  weights, gradients, devices, optimizers. :class:`BridgeConformance`::

    # plugins/mybackend/tests/test_conformance.py
    from psdk.testing import BridgeConformance, TrainerConformance

    class TestMyBridge(BridgeConformance):
        backend_name = "mybackend"

* a **trainer** for a workload on that framework (psdk's MNIST, through
  ``psdk_register_trainers``; see :mod:`psdk.plugins.trainer`).
  :class:`TrainerConformance`::

    class TestMyMnistTrainer(TrainerConformance):
        backend_name = "mybackend"   # the trainer for this backend's framework
        workload = "mnist"           # the default

pytest runs every check against the installed plugins of those names, found
through the ``psdk`` entry points as a job finds them. The reference is the
``numpy`` bridge (:class:`psdk.plugins.backends.numpy_backend.NumpyBackend`)
and the workload's trainer on it (MNIST's is
:class:`psdk.workloads.mnist.trainers.NumpyClassifier`): same weights
(:func:`~psdk.plugins.models.init_weights`), same batches, so any difference
is the plugin's. Tolerances are class attributes a subclass may loosen, with
a comment saying why. :class:`BackendConformance` is both suites at once, for
a backend and psdk's MNIST trainer on its framework.

The bridge suite needs a backward pass to read gradients back, and gets it
from the trainer of :attr:`BridgeConformance.trainer_workload` (MNIST) for
the bridge's framework. A workload other than MNIST tested with
:class:`TrainerConformance` names its models (:attr:`TrainerConformance.models`,
specs whose ``variables()`` and ``init_weights(seed)`` every framework
shares) and overrides :meth:`TrainerConformance.make_batch`; its numpy
trainer, if it registers one, is the reference (:attr:`TrainerConformance.reference_backend`).

A bridge subclass may also say more:

* :meth:`BridgeConformance.refused_optimizers`: framework optimizers the ps
  must refuse (``torch.optim.SGD(..., dampening=0.5)``), each under the
  option its error must name;
* :attr:`BridgeConformance.inspectable_optimizers` ``= False`` for a
  framework whose optimizers cannot be read (optax's are closures): an
  optimizer the backend did not make must then be refused with a message
  that shows ``rule=``, the way to state the ps rule instead.

The suites build models on a backend fresh from :func:`psdk.plugins.load_backend`,
without :meth:`~psdk.plugins.backend.Backend.setup` (only the placement checks call it):
a backend must build, train and predict on its default device as it is made.
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
from psdk.plugins.batches import Batch
from psdk.plugins.hookspecs import ModelRecord
from psdk.plugins.models import ModelSpec, init_weights
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Dense
from psdk.protocol.sharding import flat_size, layout, views
from psdk.ps.rules import SGD, Adagrad, Adam, RMSProp, UpdateRule
from psdk.testing.ps import RunningPs, running_ps

# Frameworks that listing plugins must never import, whichever plugin is tested.
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

DENSE_MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(name="conformance", hidden=(32, 16), input_dim=50, num_classes=10),
    "softmax": ModelSpec(name="softmax", hidden=(), input_dim=50, num_classes=10),
}
"""psdk's built-in dense stacks, small: two hidden layers (a mistake between layers shows) and none (softmax
regression, one layer, no ReLU). Every bridge builds them; the first is what single-model checks build."""


def random_batch(spec: ModelSpec, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` random inputs of ``spec`` and labels, from ``seed``: the batches every backend is held to."""
    rng = np.random.default_rng(seed)
    return rng.random((size, spec.input_dim), dtype=np.float32), rng.integers(0, spec.num_classes, size)


def mnist_batch(spec: ModelSpec, size: int, seed: int) -> Batch:
    """:func:`random_batch` as the MNIST workload's :class:`~psdk.plugins.batches.Batch`: ``image`` and labels."""
    from psdk.workloads.mnist.trainers import IMAGE

    x, y = random_batch(spec, size, seed)
    return Batch({IMAGE: x}, y)


def load_trainer(workload: str, bridge: Backend) -> Trainer:
    """The trainer ``workload`` names for ``bridge``'s framework, made on it as a job makes it."""
    records = plugins.installed_workloads()
    assert workload in records, f"no workload {workload!r} among {sorted(records)}"
    record, framework = records[workload], bridge.record.framework
    target = record.trainer(framework)
    assert target is not None, (
        f"workload {workload!r} has no trainer for {framework} (the {bridge.name} backend); "
        f"it has trainers for {sorted(record.trainers)}: register one with psdk_register_trainers"
    )
    cls = plugins.load_target(target, f"the {framework} trainer of workload {workload!r}")
    assert isinstance(cls, type) and issubclass(cls, Trainer), f"{target} is no psdk.plugins.trainer.Trainer"
    return cls(bridge, dict(record.options))


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


def _flat_views(spec: Any) -> dict[str, np.ndarray]:
    """Zeroed gradient buffers shaped as the ps client hands them out: views of one flat array."""
    specs = layout([(name, tuple(shape)) for name, shape in spec.variables()])
    return views(np.zeros(flat_size(specs), np.float32), specs)


def _gradients(bridge: Backend, model: Any, spec: Any) -> dict[str, np.ndarray]:
    """What ``bridge`` reads back of ``model``'s last backward pass, into psdk's buffers."""
    out = _flat_views(spec)
    bridge.read_gradients(model, out)
    return {name: view.copy() for name, view in out.items()}


class _Suite:
    """What both suites share: the plugin under test, the reference beside it, and the batches."""

    backend_name: ClassVar[str]
    """The name the backend is registered under (``backend=`` in a job)."""
    reference_backend: ClassVar[str] = "numpy"
    """The bridge the reference runs on, with the workload's trainer for its framework."""
    grad_rtol: ClassVar[float] = 1e-4
    grad_atol: ClassVar[float] = 1e-6

    @property
    def trained_workload(self) -> str:
        """The workload whose trainer the checks run (the suite's ``workload`` or ``trainer_workload``)."""
        raise NotImplementedError

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One test per model for checks that take one; pytest calls a test class's own hook for its tests only."""
        if "dense_model" in metafunc.fixturenames:
            metafunc.parametrize("dense_model", list(DENSE_MODELS))
        if "model_name" in metafunc.fixturenames:
            metafunc.parametrize("model_name", list(getattr(self, "models", DENSE_MODELS)))

    def make_batch(self, spec: Any, size: int, seed: int) -> Batch:
        """``size`` examples for ``spec`` from ``seed``, as the workload's shard would give them (MNIST's)."""
        if self.trained_workload != "mnist":
            raise NotImplementedError(
                f"the suite makes MNIST's batches only: override make_batch for workload {self.trained_workload!r}"
            )
        return mnist_batch(spec, size, seed)

    # -------------------------------------------------------------- fixtures
    @pytest.fixture
    def backend(self) -> Backend:
        return plugins.load_backend(self.backend_name)

    @pytest.fixture
    def reference(self) -> Backend:
        return plugins.load_backend(self.reference_backend)

    @pytest.fixture
    def trainer(self, backend: Backend) -> Trainer:
        return load_trainer(self.trained_workload, backend)

    @pytest.fixture
    def reference_trainer(self, reference: Backend) -> Trainer:
        return load_trainer(self.trained_workload, reference)


class BridgeConformance(_Suite):
    """The bridge contract (:class:`~psdk.plugins.backend.Backend`), held to the numpy bridge."""

    trainer_workload: ClassVar[str] = "mnist"
    """The workload whose trainer (for this bridge's framework) runs the backward passes the bridge reads back."""
    inspectable_optimizers: ClassVar[bool] = True
    """Whether :meth:`~psdk.plugins.backend.Backend.optimizer_rule` can read a framework optimizer's kind and settings.

    ``False`` for closures (optax): only optimizers ``make_optimizer`` made map
    back (it remembers their rule, :func:`psdk.plugins.backends.kit.remember_rule`), and
    any other must be refused with a message showing ``rule=``.
    """
    train_atol: ClassVar[float] = 1e-5
    """Weights after a few steps through a ps, against the same steps on the reference."""

    @property
    def trained_workload(self) -> str:
        return self.trainer_workload

    @property
    def spec(self) -> ModelSpec:
        """The dense stack most checks build."""
        return next(iter(DENSE_MODELS.values()))

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
            "plugins.installed_datasets(); plugins.installed_workloads()\n"
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

    def test_its_variable_records_are_dense_with_the_same_shapes(self, backend: Backend) -> None:
        """A dense stack's variables are all of kind dense, named and shaped as ``variables()`` says."""
        model = self.build(backend)
        records = backend.variable_records(model)
        assert list(records) == list(backend.variables(model)), "variable_records names other variables"
        for name, shape in self.spec.variables():
            assert records[name] == Dense(shape), f"{name}: {records[name]!r}"

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

    def test_each_builtin_dense_stack_builds_as_the_reference_does(
        self, backend: Backend, reference: Backend, dense_model: str
    ) -> None:
        """Both dense specs psdk ships (hidden layers, and none: softmax regression) build as numpy's do."""
        spec = DENSE_MODELS[dense_model]
        weights = _random_weights(spec, 11)
        built, ref = backend.build_model(spec, weights), reference.build_model(spec, weights)
        assert list(backend.variables(built).items()) == list(reference.variables(ref).items()) == spec.variables()
        expected = reference.read_weights(ref)
        for name, value in backend.read_weights(built).items():
            np.testing.assert_array_equal(value, expected[name], err_msg=name)
            np.testing.assert_array_equal(value, weights[name], err_msg=name)

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

    # ------------------------------------------------------------- gradients
    def test_gradients_read_back_as_the_reference_computes_them(
        self, backend: Backend, reference: Backend, trainer: Trainer, reference_trainer: Trainer, dense_model: str
    ) -> None:
        """After the trainer's backward pass, ``read_gradients`` fills views of one flat array, canonical layout.

        Twice: the second after a ``write_weights``, which must reach the next forward pass.
        """
        spec = DENSE_MODELS[dense_model]
        first = init_weights(spec, 2)
        model, ref = backend.build_model(spec, first), reference.build_model(spec, first)
        for step, weights in enumerate((None, _random_weights(spec, 3))):
            if weights is not None:
                backend.write_weights(model, weights)
                reference.write_weights(ref, weights)
            batch = self.make_batch(spec, 64, step)
            trainer.forward_backward(model, batch)
            reference_trainer.forward_backward(ref, batch)
            grads, expected = _gradients(backend, model, spec), _gradients(reference, ref, spec)
            for name in expected:
                np.testing.assert_allclose(
                    grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
                )

    # ------------------------------------------------------------- placement
    def test_setup_on_the_cpu_stays_on_the_cpu(self, backend: Backend) -> None:
        backend.setup("cpu", threads=1)
        assert backend.device == "cpu"

    def test_cuda_without_a_gpu_falls_back_to_the_cpu(self, backend: Backend, trainer: Trainer) -> None:
        if visible_gpus():
            pytest.skip("this machine has a GPU")
        backend.setup("cuda:0", threads=1)
        assert backend.device == "cpu"
        assert np.isfinite(trainer.forward_backward(self.build(backend), self.make_batch(self.spec, 8, 0)))

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
        self, backend: Backend, reference: Backend, trainer: Trainer, reference_trainer: Trainer, ps: RunningPs
    ) -> None:
        """Five SGD steps of one worker through a real ps equal five local steps on the reference."""
        rule, steps = SGD(lr=0.5), 5
        batches = [self.make_batch(self.spec, 32, 10 + t) for t in range(steps)]
        model = self.build(backend)
        with psdk.connect(ps.cluster(1), 0, steps=steps, transport=ps.transport) as session:
            opt = psdk.DistributedOptimizer(backend.make_optimizer(model, rule), model, session)
            opt.broadcast_parameters()
            for batch in batches:
                trainer.forward_backward(model, batch)
                opt.step()
            assert session.should_stop()
            session.finish(wait_s=30)
            opt.pull()
        assert session.global_step == steps
        ref = reference.build_model(self.spec, init_weights(self.spec, 0))
        for batch in batches:
            reference_trainer.forward_backward(ref, batch)
            grads, weights = _gradients(reference, ref, self.spec), reference.read_weights(ref)
            reference.write_weights(ref, {name: weights[name] - rule.lr * grads[name] for name in weights})
        expected = reference.read_weights(ref)
        for name, value in backend.read_weights(model).items():
            np.testing.assert_allclose(value, expected[name], rtol=0, atol=self.train_atol, err_msg=name)


class TrainerConformance(_Suite):
    """A workload's trainer for one framework, held to the workload's trainer on the numpy bridge."""

    workload: ClassVar[str] = "mnist"
    """The workload whose trainer for the backend's framework is tested."""
    models: ClassVar[Mapping[str, Any]] = DENSE_MODELS
    """The models the trainer must build and train, by test id: the workload's own for a workload other than
    MNIST (specs with ``variables()`` and ``init_weights(seed)``); the first is what single-model checks build."""
    loss_rtol: ClassVar[float] = 1e-5
    loss_atol: ClassVar[float] = 1e-6
    """Added to ``loss_rtol``: the loss (order 1 here) is float32 arithmetic whose last digits differ by CPU."""
    predict_rtol: ClassVar[float] = 1e-4
    predict_atol: ClassVar[float] = 1e-5
    score_atol: ClassVar[float] = 1e-9
    """The workload's metrics of the trainer's predictions against the reference's: the same decisions, so
    equal (one MNIST answer flipped of 600 would be 1.7e-3)."""

    @property
    def trained_workload(self) -> str:
        return self.workload

    def first_model(self) -> Any:
        return next(iter(self.models.values()))

    def scoring_batch(self, batch: Batch, reference_predictions: np.ndarray) -> Batch:
        """``batch`` with targets that make the score telling: for classifier logits, half set to the reference's
        answer, so accuracy is about 0.55 rather than a trivial 0.1. Override for other predictions."""
        if reference_predictions.ndim != 2:
            return batch
        targets = batch.targets.copy()
        targets[::2] = np.argmax(reference_predictions, axis=1)[::2]
        return Batch(batch.inputs, targets, batch.ids)

    def built(self, trainer: Trainer, reference_trainer: Trainer, spec: Any, seed: int) -> tuple[Any, Any]:
        """``spec`` on both sides from the same weights: :func:`init_weights`-drawn but with every bias non-zero."""
        weights = _random_weights(spec, seed)
        return trainer.build_model(spec, weights), reference_trainer.build_model(spec, weights)

    # ---------------------------------------------------------- registration
    def test_its_trainer_is_registered_for_the_backends_framework(self, backend: Backend) -> None:
        """The workload names a trainer for the framework (its own entry or a plugin's TrainerRecord) that imports."""
        trainer = load_trainer(self.workload, backend)
        assert trainer.bridge is backend

    # ----------------------------------------------------------------- models
    def test_its_trainer_builds_each_model(self, trainer: Trainer, backend: Backend, model_name: str) -> None:
        spec = self.models[model_name]
        weights = _initial_weights(spec, 0)
        model = trainer.build_model(spec, weights)
        assert list(backend.variables(model).items()) == [(name, tuple(shape)) for name, shape in spec.variables()]
        for name, value in backend.read_weights(model).items():
            np.testing.assert_array_equal(value, weights[name], err_msg=name)

    # --------------------------------------------------- loss and gradients
    def test_its_loss_and_gradients_match_the_reference(
        self,
        backend: Backend,
        reference: Backend,
        trainer: Trainer,
        reference_trainer: Trainer,
        model_name: str,
    ) -> None:
        """Loss and gradients on the same weights and batch, also after a write of new weights."""
        spec = self.models[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 2)
        for step, weights in enumerate((None, _random_weights(spec, 3))):
            if weights is not None:  # a write must reach the next forward pass
                backend.write_weights(model, weights)
                reference.write_weights(ref, weights)
            batch = self.make_batch(spec, 64, step)
            loss = trainer.forward_backward(model, batch)
            expected_loss = reference_trainer.forward_backward(ref, batch)
            assert isinstance(loss, float), f"forward_backward returned a {type(loss).__name__}, not a float"
            assert loss == pytest.approx(expected_loss, rel=self.loss_rtol, abs=self.loss_atol)
            grads, expected = _gradients(backend, model, spec), _gradients(reference, ref, spec)
            for name in expected:
                np.testing.assert_allclose(
                    grads[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
                )

    def test_forward_backward_replaces_the_last_gradients(
        self, backend: Backend, reference: Backend, trainer: Trainer, reference_trainer: Trainer
    ) -> None:
        """A pass leaves its own batch's gradients, not a sum with the last pass's (the trainer zeroes them)."""
        spec = self.first_model()
        model, ref = self.built(trainer, reference_trainer, spec, 5)
        first, second = self.make_batch(spec, 32, 20), self.make_batch(spec, 32, 21)
        trainer.forward_backward(model, first)
        trainer.forward_backward(model, second)
        once = _gradients(backend, model, spec)
        trainer.forward_backward(model, second)
        again = _gradients(backend, model, spec)
        reference_trainer.forward_backward(ref, second)
        expected = _gradients(reference, ref, spec)
        for name in expected:
            np.testing.assert_allclose(
                once[name], expected[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name
            )
            np.testing.assert_allclose(again[name], once[name], rtol=self.grad_rtol, atol=self.grad_atol, err_msg=name)

    # ------------------------------------------------------------ predictions
    def test_its_predictions_match_the_reference(
        self, trainer: Trainer, reference_trainer: Trainer, model_name: str
    ) -> None:
        """``predict`` gives numpy as the reference's, and ``predictions`` in slices joins to the same."""
        spec = self.models[model_name]
        model, ref = self.built(trainer, reference_trainer, spec, 4)
        batch = self.make_batch(spec, 50, 6)
        expected = np.asarray(reference_trainer.predict(ref, batch))
        got = trainer.predict(model, batch)
        assert isinstance(got, np.ndarray), f"predict returned a {type(got).__name__}, not numpy"
        assert got.shape == expected.shape, f"predictions of shape {got.shape}, the reference's {expected.shape}"
        np.testing.assert_allclose(got, expected, rtol=self.predict_rtol, atol=self.predict_atol)
        np.testing.assert_allclose(
            trainer.predictions(model, batch, size=16), expected, rtol=self.predict_rtol, atol=self.predict_atol
        )

    def test_predicting_changes_no_gradient_and_no_weight(self, backend: Backend, trainer: Trainer) -> None:
        """Predictions between a backward pass and the push must leave what the push reads as it was."""
        spec = self.first_model()
        model = trainer.build_model(spec, _random_weights(spec, 8))
        trainer.forward_backward(model, self.make_batch(spec, 32, 30))
        grads, weights = _gradients(backend, model, spec), backend.read_weights(model)
        trainer.predictions(model, self.make_batch(spec, 40, 31), size=16)
        for name, value in _gradients(backend, model, spec).items():
            np.testing.assert_array_equal(value, grads[name], err_msg=f"predicting changed the gradient of {name}")
        for name, value in backend.read_weights(model).items():
            np.testing.assert_array_equal(value, weights[name], err_msg=f"predicting changed {name}")

    def test_its_score_equals_the_references(self, trainer: Trainer, reference_trainer: Trainer) -> None:
        """The workload's ``score`` of the trainer's predictions: the reference's, every metric."""
        record = plugins.installed_workloads()[self.workload]
        assert record.score, f"workload {self.workload!r} names no score entry"
        score = plugins.load_target(record.score, f"the score of workload {self.workload!r}")
        spec = self.first_model()
        model, ref = self.built(trainer, reference_trainer, spec, 9)
        batch = self.make_batch(spec, 600, 10)
        batch = self.scoring_batch(batch, np.asarray(reference_trainer.predictions(ref, batch)))
        expected = score(np.asarray(reference_trainer.predictions(ref, batch)), batch)
        got = score(trainer.predictions(model, batch), batch)
        assert expected and set(got) == set(expected), f"scored {sorted(got)}, the reference {sorted(expected)}"
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=0, abs=self.score_atol), name


class BackendConformance(BridgeConformance, TrainerConformance):
    """Both suites for a backend and psdk's MNIST trainer on its framework: a plugin's one-line test.

    The same as a :class:`BridgeConformance` and a :class:`TrainerConformance`
    (``workload = "mnist"``) subclass side by side; write those two to say
    more of either (a refused optimizer, a tolerance).
    """

    trainer_workload: ClassVar[str] = "mnist"
    workload: ClassVar[str] = "mnist"
