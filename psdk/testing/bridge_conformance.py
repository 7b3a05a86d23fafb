"""The bridge conformance suite: what every backend must do for the ps (:mod:`psdk.testing.conformance`)."""

from __future__ import annotations

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
from psdk.plugins.models import ModelSpec, init_weights
from psdk.plugins.trainer import Trainer
from psdk.plugins.variables import Dense
from psdk.ps.rules import SGD, UpdateRule
from psdk.testing.ps import RunningPs, running_ps

# Frameworks that listing plugins must never import, whichever plugin is tested.
from psdk.testing.suite import (
    DENSE_MODELS,
    KNOWN_FRAMEWORKS,
    MAPPED_RULES,
    _gradients,
    _initial_weights,
    _plugin_spec,
    _random_weights,
    _Suite,
)


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
