"""Backends found through pluggy: built-in numpy, entry points, clear errors."""

from __future__ import annotations

import subprocess
import sys
import types

import pluggy
import pytest

from psdk import plugins
from psdk.errors import ConfigError, PluginError, UnknownBackendError
from psdk.plugins import hookspecs, registry
from psdk.plugins.backends.numpy_backend import NumpyBackend, NumpyModel
from psdk.plugins.hookspecs import BackendRecord, hookimpl
from psdk.plugins.models import ModelSpec, init_weights
from psdk.ps.rules import SGD


def test_the_numpy_backend_is_built_in() -> None:
    backends = plugins.installed_backends()
    assert backends["numpy"].distribution.startswith("psdk")
    assert isinstance(plugins.load_backend("numpy"), NumpyBackend)


def test_an_unknown_backend_lists_the_installed_ones() -> None:
    with pytest.raises(UnknownBackendError) as info:
        plugins.load_backend("mxnet")
    text = str(info.value)
    assert "backend" in text and "'mxnet'" in text and "numpy" in text


def test_the_backend_is_found_from_an_optimizer() -> None:
    assert isinstance(plugins.backend_for(SGD(lr=0.1)), NumpyBackend)
    with pytest.raises(UnknownBackendError, match="int"):
        plugins.backend_for(3)


def fake_manager(*records: list[BackendRecord]) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("psdk")
    pm.add_hookspecs(hookspecs)
    for i, recs in enumerate(records):
        module = types.ModuleType(f"fake_plugin_{i}")
        module.psdk_register_backends = hookimpl(lambda recs=recs: recs)  # type: ignore[attr-defined]
        pm.register(module, name=module.__name__)
    return pm


def test_two_plugins_claiming_one_name_are_both_named(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = fake_manager([BackendRecord("torch", "a:B", "torch")], [BackendRecord("torch", "c:D", "torch")])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    with pytest.raises(PluginError) as info:
        plugins.installed_backends()
    assert "a:B" in str(info.value) and "c:D" in str(info.value)


def test_a_backend_whose_module_is_missing_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = fake_manager([BackendRecord("ghost", "psdk_ghost.backend:Ghost", "ghostlib")])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    with pytest.raises(PluginError, match="ghostlib"):
        plugins.load_backend("ghost")


def test_listing_backends_imports_no_framework() -> None:
    code = (
        "import sys, psdk.plugins as p; p.installed_backends(); "
        "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_objects_of_a_frameworks_sibling_package_find_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorFlow's optimizers live in ``keras``: a record's ``modules`` claims them."""
    target = "psdk.plugins.backends.numpy_backend:NumpyBackend"
    pm = fake_manager([BackendRecord("fake", target, "fakeflow", modules=("fakeras",))])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    monkeypatch.setitem(sys.modules, "fakeras", types.ModuleType("fakeras"))  # its objects exist: it is loaded
    optimizer = type("SGD", (), {"__module__": "fakeras.optimizers"})()
    assert isinstance(plugins.backend_for(optimizer), NumpyBackend)
    with pytest.raises(UnknownBackendError):
        plugins.backend_for(type("SGD", (), {"__module__": "otherlib.optim"})())


def test_an_alias_from_the_record_names_the_backend() -> None:
    assert plugins.resolve_backend_name("np") == "numpy"
    assert plugins.load_backend("NP").name == "numpy"


def test_a_backend_made_directly_finds_its_record() -> None:
    backend = NumpyBackend()
    assert backend.name == "numpy" and backend.record.framework == "psdk"


def test_a_backend_gets_its_options_from_the_record_and_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    target = "psdk.plugins.backends.numpy_backend:NumpyBackend"
    pm = fake_manager([BackendRecord("opts", target, "psdk", options={"jit": True, "cache_dir": None})])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    assert plugins.load_backend("opts").options == {"jit": True, "cache_dir": None}
    assert plugins.load_backend("opts", {"jit": False}).option("jit") is False
    with pytest.raises(ConfigError, match=r"backend_options\.opts: the opts backend has no option\(s\) jti"):
        plugins.load_backend("opts", {"jti": False})


def test_finding_a_backend_asks_its_owns_and_imports_no_other_framework() -> None:
    code = (
        "import sys, psdk.plugins as p\n"
        "from psdk.ps.rules import SGD\n"
        "backend = p.backend_for(SGD(lr=0.1))\n"
        "print(backend.name, sorted(m for m in ('torch', 'tensorflow', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "numpy []"


class ScriptModel(NumpyModel):
    """A user's model class defined outside any framework's package (here: in a test module)."""


def test_a_users_own_model_class_finds_its_backend_through_its_base_classes() -> None:
    spec = ModelSpec(hidden=(4,), input_dim=3, num_classes=2)
    model = ScriptModel(spec, init_weights(spec, 0))
    assert type(model).__module__.split(".")[0] != "psdk" and plugins.backend_for(model).name == "numpy"


class OldStyleBackend(NumpyBackend):
    """A backend written before workloads: MNIST's loss and metric on the backend itself."""

    def forward_backward(self, model: NumpyModel, x: object, y: object) -> float:
        return 0.0

    def accuracy(self, model: NumpyModel, x: object, y: object) -> float:
        return 0.0


def test_a_backend_of_the_old_contract_is_refused_naming_what_to_move(monkeypatch: pytest.MonkeyPatch) -> None:
    target = f"{__name__}:OldStyleBackend"
    pm = fake_manager([BackendRecord("oldstyle", target, "psdk")])
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    with pytest.raises(PluginError) as info:
        plugins.load_backend("oldstyle")
    text = str(info.value)
    assert "defines forward_backward and accuracy" in text and "Trainer.forward_backward(model, batch)" in text
    assert "TrainerRecord('mnist'" in text and "docs/writing-a-backend.md, 'Moving a backend to a bridge'" in text


def test_finding_an_objects_backend_passes_over_one_that_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outdated plugin for a framework imported alongside (Keras imports JAX) must not break the others."""
    pm = fake_manager(
        [
            BackendRecord("aaold", f"{__name__}:OldStyleBackend", "psdk"),  # asked first: refused, passed over
            BackendRecord("fine", "psdk.plugins.backends.numpy_backend:NumpyBackend", "psdk"),
        ]
    )
    monkeypatch.setattr(registry, "get_plugin_manager", lambda: pm)
    assert plugins.backend_for(SGD(lr=0.1)).name == "fine"
    with pytest.raises(PluginError, match=r"no backend that loads owns otherlib.*defines forward_backward"):
        plugins.backend_for(type("SGD", (), {"__module__": "otherlib.optim"})())
